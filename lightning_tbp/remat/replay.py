"""Fully checkpointed blocks that a training step runs once more after its backward.

Bookkeeping DP clipping (``lightning_tbp.privacy``) forms each layer's clipped gradient sum
only once every sample's gradient norm is known, at the end of the backward. It used to keep
every layer's input and output gradient until then, and inside a checkpointed block those
inputs are exactly what the plan recomputes, so the plan saved nothing. Instead, a block the
plan checkpoints in full (and that no other planned block encloses) can be *recorded*: its call,
its inputs and the RNG and autocast state it ran under. The step then keeps only those inputs
and the gradient that reaches the block's outputs, and after the backward runs the block again,
forward and backward, with each sample's output gradient scaled by its clipping coefficient:
that backward yields the clipped sums of every layer inside, exactly (a block's output row
depends on its own sample only, which the engine's independence probe checks).

Who changes the step registers a :class:`CheckpointRecorder` for the module
(:func:`register_checkpoint_recorder`); the checkpoint wrappers (``apply.py``) offer it each
eligible call. The remat package knows nothing of DP.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from lightning_tbp.compat import storage_key, tree_flatten, tree_map, version_counter
from lightning_tbp.remat.step import set_per_module

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class _AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype


@dataclass(eq=False)
class CheckpointedCall:
    """One recorded call of a fully checkpointed block, with what running it again needs."""

    name: str
    """The block's qualified name in the model (for errors)."""
    function: Callable[..., Any]
    """The block's forward taking every tensor argument positionally (``apply._positional_call``)."""
    inputs: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    """Each input's in-place write count when the call was recorded: the replay refuses inputs
    written since, as autograd refuses modified saved tensors."""
    cpu_rng: torch.Tensor
    device_rng: tuple[list[int], list[torch.Tensor]]
    autocast: tuple[_AutocastState, ...]
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """Gradient at each output (by position among the output tensors), filled in by the backward."""
    replayable: bool = False
    """Set once the block has run, if its outputs allow a replay (``watch_outputs``); until then,
    and otherwise, the layers inside keep what they need like any other layer."""

    @classmethod
    def capture(cls, name: str, function: Callable[..., Any], inputs: list[torch.Tensor]) -> CheckpointedCall:
        """Record a call about to run (the RNG state *before* it, as torch's checkpoint stashes it)."""
        autocast = tuple(
            _AutocastState(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if device == "cpu" or torch.cuda.is_available()
        )
        detached = tuple(t.detach() for t in inputs)  # no reference to the graph that made them
        versions = tuple(version_counter(t) for t in inputs)
        return cls(name, function, detached, versions, torch.get_rng_state(), get_device_states(*inputs), autocast)

    def drop(self) -> None:
        """Let go of what running again needs (the inputs, the RNG state): the call will not run
        again, and the graph's nodes of the layers inside keep it for as long as the graph lives
        (until the loss is dropped), long after the block's backward."""
        self.inputs, self.versions, self.cpu_rng, self.device_rng = (), (), torch.empty(0, dtype=torch.uint8), ([], [])

    def rerun(self) -> list[torch.Tensor]:
        """Run the block again on its (detached) inputs, so no gradient leaves it, under the recorded RNG
        and autocast state; returns its output tensors, in the order ``output_grads`` uses.

        Raises ``RuntimeError`` if an input was written in place since the call was recorded (the
        block would run on other values than it did, and the clipped sums would be wrong)."""
        for position, (tensor, version) in enumerate(zip(self.inputs, self.versions, strict=True)):
            if version_counter(tensor) != version:
                raise RuntimeError(
                    f"lightning_tbp: tensor argument {position} of checkpointed block {self.name!r} was modified in "
                    f"place after the block was called (write count {version} -> {version_counter(tensor)}); "
                    "bookkeeping DP runs the block again from its inputs after the backward, which would give wrong "
                    "clipped gradients. Replace the in-place op on the block's input (e.g. `x += block(x)` -> "
                    "`x = x + block(x)`), or leave this block out of the plan"
                )
        devices, states = self.device_rng
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(self.cpu_rng)
            set_device_states(devices, states)
            for state in self.autocast:
                stack.enter_context(torch.autocast(state.device_type, dtype=state.dtype, enabled=state.enabled))
            stack.enter_context(torch.enable_grad())
            outputs = self.function(*self.inputs)
        return output_tensors(outputs)


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """The distinct tensors in a block's output (a tensor, a tuple, a dataclass), in a fixed order.

    A tensor returned twice (diffusers' down blocks return their last hidden state also among
    their skip outputs) counts once: its hook sees the whole gradient, which the replay must
    backpropagate once."""
    leaves, _ = tree_flatten(outputs)
    return list({id(leaf): leaf for leaf in leaves if isinstance(leaf, torch.Tensor)}.values())


class CheckpointRecorder(Protocol):
    """Whoever runs a step that replays checkpoints (a bookkeeping DP engine)."""

    def record_checkpoint(self, call: CheckpointedCall) -> bool:
        """Take ``call`` (True) or let the block run as a plain checkpoint (False)."""

    def checkpoint_output_grad(self, call: CheckpointedCall, index: int, grad: torch.Tensor) -> None:
        """The backward reached output ``index`` of a taken call with ``grad``."""


_RECORDERS: weakref.WeakKeyDictionary[nn.Module, CheckpointRecorder] = weakref.WeakKeyDictionary()
_INSIDE_PLANNED_BLOCK: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lightning_tbp_inside_planned_block", default=False
)
_RECORDING: contextvars.ContextVar[CheckpointedCall | None] = contextvars.ContextVar(
    "lightning_tbp_recording", default=None
)


def register_checkpoint_recorder(modules: list[nn.Module], recorder: CheckpointRecorder | None) -> None:
    """Offer (or with ``None`` stop offering) the full checkpoints of ``modules`` to ``recorder``."""
    set_per_module(_RECORDERS, modules, recorder)


def recorder_for(module: nn.Module) -> CheckpointRecorder | None:
    """The recorder offered ``module``'s full checkpoints, unless another planned block encloses
    the call (its inputs are then recomputed by that block, and keeping them would cost memory)."""
    if _INSIDE_PLANNED_BLOCK.get():
        return None
    return _RECORDERS.get(module)


@contextlib.contextmanager
def inside_planned_block() -> Iterator[None]:
    """Mark the running code as part of a planned block (a checkpoint, its recomputation, a lazy block)."""
    token = _INSIDE_PLANNED_BLOCK.set(True)
    try:
        yield
    finally:
        _INSIDE_PLANNED_BLOCK.reset(token)


@contextlib.contextmanager
def recording(call: CheckpointedCall) -> Iterator[None]:
    """While ``call``'s block runs its forward: layers inside can ask :func:`recorded_call`."""
    token = _RECORDING.set(call)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def recorded_call() -> CheckpointedCall | None:
    """The recorded checkpoint whose forward is running, if any: layers inside it are replayed
    after the backward (if ``replayable``, known once the block has run) and then need not keep
    anything for it."""
    return _RECORDING.get()


def outputs_replayable(tensors: list[torch.Tensor]) -> bool:
    """Whether a block with these (distinct) output tensors can be replayed: it has one, and no
    two share memory."""
    storages = [storage_key(t) for t in tensors]
    return bool(storages) and None not in storages and len(set(storages)) == len(storages)


def replayed(call: CheckpointedCall | None) -> bool:
    """Whether a layer recorded inside ``call`` (``recorded_call()`` at its forward) is replayed."""
    return call is not None and call.replayable


def watch_outputs(call: CheckpointedCall, outputs: Any, recorder: CheckpointRecorder) -> Any:
    """Hand each output's gradient from outside the block to ``recorder`` when the backward
    reaches it, mark the call replayable, and return ``outputs`` with each tensor replaced by an
    alias (a view of all of it) that carries the hook.

    The replay backpropagates these gradients through the block again, whose own graph adds what
    the block's layers read of its outputs. A down block's skip states are outputs it also feeds
    to its next layer: a hook on such a tensor sees the gradient from outside *and* from inside
    the block, and the inside's would be counted twice. The alias is read only outside, so its
    gradient is the outside's alone.

    Nothing is watched (and ``outputs`` come back as they are, ``call`` dropped) when two
    outputs share memory (a view and its base, say): the gradient one sees may then include the
    other's. The hooks (and
    through them ``call`` and its inputs) live as long as the graph does: a forward whose graph
    is dropped without a backward keeps nothing."""
    tensors = output_tensors(outputs)
    if not outputs_replayable(tensors):
        call.drop()  # its layers book what they need like any other layer's
        return outputs
    aliases = {id(tensor): tensor.view_as(tensor) for tensor in tensors}
    for index, tensor in enumerate(tensors):
        alias = aliases[id(tensor)]
        if alias.requires_grad:
            alias.register_hook(functools.partial(recorder.checkpoint_output_grad, call, index))
    call.replayable = True
    return tree_map(lambda leaf: aliases.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf, outputs)
