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


#: Options that run the block under ``torch.utils.checkpoint``.
CHECKPOINTS = (Option.FULL, Option.SELECTIVE)
#: Options that keep a block's subtree plain and must not sit under a checkpoint: torch keeps a
#: selective region's cache alive for the whole enclosing checkpoint, and a lazy block's recipes
#: would be recorded again by every recompute.
SOFT = (Option.SELECTIVE, Option.LAZY)


def checkpoint_context(parents: Sequence[int], node: int, region: int, options: Sequence[Option]) -> int:
    """The outermost checkpointed block strictly inside ``region`` that encloses ``node`` (or is
    it), or -1: the block whose recompute runs ``node``'s ops when ``region``'s backward needs them."""
    found = -1
    while node != region and node >= 0:
        if options[node] in CHECKPOINTS:
            found = node
        node = parents[node]
    return found


def enclosing_lazy_block(parents: Sequence[int], node: int, options: Sequence[Option]) -> int:
    """The lazy block enclosing ``node`` (or ``node`` itself), or -1."""
    while node > 0:
        if options[node] == Option.LAZY:
            return node
        node = parents[node]
    return -1


def next_options(current: Option, *, checkpointed_above: bool, plain_below: bool) -> tuple[Option, ...]:
    """The options a search may move a block to from ``current``: each move frees memory or makes
    the block's recompute lighter. Soft options need a plain subtree and no checkpoint above."""
    soft_allowed = not checkpointed_above and plain_below
    if current == Option.KEEP:
        return (Option.FULL, Option.SELECTIVE, Option.LAZY) if soft_allowed else (Option.FULL,)
    if current == Option.SELECTIVE:
        return (Option.FULL, Option.LAZY)  # lazy: no block-wide recompute
    if current == Option.LAZY:
        return (Option.FULL,)
    return (Option.LAZY,) if soft_allowed else ()  # a full block whose recompute is the peak


def clears_soft_below(option: Option) -> bool:
    """Whether choosing ``option`` for a block turns soft options inside it back to KEEP."""
    return option == Option.FULL
