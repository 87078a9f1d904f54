"""What a plan may do with one block, and how options nest: read by the executor, the simulator and the solver."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class Option(IntEnum):
    """What the plan does with one block."""

    KEEP = 0
    """No checkpoint: autograd keeps what it saves (children may still be checkpointed)."""
    FULL = 1
    """Checkpoint the whole block: keep its inputs, recompute it in the backward."""
    SELECTIVE = 2
    """Keep inputs and heavy-op outputs, recompute the cheap ops (norms, activations, adds)."""
    LAZY = 3
    """No checkpoint: saved outputs of cheap ops become recipes rebuilt on demand (``lazy.py``)."""
    OFFLOAD = 4
    """No checkpoint: saved activations go to host memory and come back op by op (``host_tier.py``)."""
    STREAM = 5
    """Checkpoint the whole block, its frozen weights kept in host memory: copied in for its
    forward and again for its recompute, and dropped after each (``host_weights.py``)."""


#: Options that run the block under ``torch.utils.checkpoint``.
CHECKPOINTS = (Option.FULL, Option.SELECTIVE, Option.STREAM)
#: Options that keep a block's subtree plain and must not sit under a checkpoint: torch keeps a
#: selective region's cache alive for the whole enclosing checkpoint, a lazy block's recipes
#: would be recorded again by every recompute, and an offloaded block's saves would be copied
#: out by the forward and again by every recompute (whose saves the checkpoint holds anyway). A
#: streamed block's weights are its own: an enclosing recompute would run it with weights it
#: never brought in, and a checkpoint inside would copy them in again for its own recompute.
SOFT = (Option.SELECTIVE, Option.LAZY, Option.OFFLOAD, Option.STREAM)
#: Soft options that keep some of the block's tensors on the device (heavy-op outputs, recipe leaves).
KEEPS_SOME = (Option.SELECTIVE, Option.LAZY)


def checkpoint_context(parents: Sequence[int], node: int, region: int, options: Sequence[Option]) -> int:
    """The outermost checkpointed block strictly inside ``region`` that encloses ``node`` (or is
    it), or -1: the block whose recompute runs ``node``'s ops when ``region``'s backward needs them."""
    found = -1
    while node != region and node >= 0:
        if options[node] in CHECKPOINTS:
            found = node
        node = parents[node]
    return found


def enclosing_block(parents: Sequence[int], node: int, options: Sequence[Option], option: Option) -> int:
    """The block enclosing ``node`` (or ``node`` itself) whose option is ``option``, or -1 (soft
    options do not nest, so there is at most one of a soft option)."""
    while node > 0:
        if options[node] == option:
            return node
        node = parents[node]
    return -1


def next_options(current: Option, *, checkpointed_above: bool, plain_below: bool) -> tuple[Option, ...]:
    """The options a search may move a block to from ``current``: each move frees memory or makes
    the block's recompute lighter. Soft options need a plain subtree and no checkpoint above."""
    soft_allowed = not checkpointed_above and plain_below
    if current == Option.KEEP:
        return (Option.FULL, *SOFT) if soft_allowed else (Option.FULL,)
    if current == Option.SELECTIVE:
        return (Option.FULL, Option.LAZY, Option.OFFLOAD, Option.STREAM)  # no block-wide recompute
    if current in (Option.LAZY, Option.OFFLOAD):
        return (Option.FULL, Option.STREAM)
    if current == Option.STREAM:
        return ()
    # a full block whose recompute is the peak, or whose weights are
    return (Option.LAZY, Option.OFFLOAD, Option.STREAM) if soft_allowed else ()


def clears_soft_below(option: Option) -> bool:
    """Whether choosing ``option`` for a block turns soft options inside it back to KEEP."""
    return option in (Option.FULL, Option.STREAM)
