"""Where a training step's memory goes: parameters, gradients, optimizer state, activations, DP, rest.

Parameter, gradient and optimizer-state bytes are read from the tensors themselves, counting
each storage once (tied weights, views and flat buffers share storage) and only on the metered
device (Adam's ``step`` counters stay on the CPU when the parameters are on a GPU). Activations
and the rest come from the allocator meters: see :func:`split_untracked`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tbp.compat import storage_key
from lightning_tbp.memory.homes import hosted_state


@dataclass
class Breakdown:
    """Bytes per category at one snapshot; the fields sum to the snapshot's current bytes."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    """Bytes allocated since the step began that are none of the tracked kinds: tensors saved for
    backward, outputs and the loss after the forward; transient gradients during the backward."""
    dp_buffers: int = 0
    """Buffers of a differential-privacy engine (per-sample norms, cached activations/gradients)."""
    other: int = 0
    """The rest: what was allocated before the step and is tracked nowhere (the batch, caches)."""

    @property
    def tracked(self) -> int:
        """Bytes read from tensors rather than inferred from the meter."""
        return self.parameters + self.gradients + self.optimizer_state + self.dp_buffers

    def as_mib(self) -> dict[str, float]:
        return {f"{f.name}_mb": getattr(self, f.name) / 2**20 for f in fields(self)}


def _storages_bytes(tensors: Iterable[torch.Tensor], device_type: str, seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if isinstance(tensor, DTensor):  # FSDP2's sharded parameters: this process holds its shard
            tensor = tensor.to_local()
        if tensor.device.type != device_type:
            continue
        key = storage_key(tensor)  # defined for fake tensors too (a model built without data)
        nbytes = tensor.untyped_storage().nbytes()
        if key is None or key in seen or nbytes == 0:
            continue
        seen.add(key)
        total += nbytes
    return total


def is_quantized_wrapper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a subclass that keeps its data in inner tensors through the subclass
    protocol (``__tensor_flatten__``: torchao's quantized weights and low-bit optimizer states),
    other than a DTensor (a shard, counted as its local tensor)."""
    return hasattr(type(tensor), "__tensor_flatten__") and not isinstance(tensor, DTensor)


def plain_tensors(state: object) -> Iterator[torch.Tensor]:
    """Every tensor in ``state`` (a tensor, or nested dicts, lists and tuples of them: one
    parameter's optimizer state), as the allocator holds them.

    A tensor subclass that keeps its data in inner tensors (torchao's low-bit optimizer states:
    8-bit codes and a scale per block, shown as a float32 tensor of the parameter's shape;
    torchao's int8 and NF4 quantized weights) is replaced by those, through the subclass
    protocol's ``__tensor_flatten__``: its own size is the apparent tensor's, not what it holds,
    and a wrapper has no storage of its own."""
    if isinstance(state, torch.Tensor):
        if is_quantized_wrapper(state):
            names, _ = state.__tensor_flatten__()  # type: ignore[attr-defined]  # the subclass protocol
            for name in names:
                yield from plain_tensors(getattr(state, name))
            return
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from plain_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from plain_tensors(value)


def tensor_bytes(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device | str, dp_buffers: int = 0
) -> Breakdown:
    """Parameter, gradient and optimizer-state bytes held on ``device`` (the tracked part)."""
    device_type = torch.device(device).type
    seen: set[int] = set()  # a storage counts once, in the first category that holds it
    params = list(module.parameters())
    parameters = _storages_bytes(plain_tensors(params), device_type, seen)
    gradients = _storages_bytes((p.grad for p in params if p.grad is not None), device_type, seen)
    optimizer_state = 0
    for optimizer in optimizers:
        hosted = hosted_state(optimizer)  # the host tier's (``optim/host_state.py``)
        optimizer_state += sum(
            _storages_bytes(plain_tensors(state), device_type, seen)
            for param, state in optimizer.state.items()
            if id(param) not in hosted
        )
    return Breakdown(parameters, gradients, optimizer_state, dp_buffers=dp_buffers)


def split_untracked(current: int, tracked: Breakdown, start_current: int, start_tracked: int) -> Breakdown:
    """Complete a tracked breakdown with activations and the rest.

    Activations are the growth since the step began of the bytes no tensor accounts for; what
    is left of ``current`` is ``other``. On the CPU meter, ``current`` is relative to the step's
    start plus the tracked bytes then, so ``other`` is zero up to bytes allocated before the
    step and freed during it (which make it slightly negative).
    """
    activations = max(0, (current - start_current) - (tracked.tracked - start_tracked))
    return Breakdown(
        parameters=tracked.parameters,
        gradients=tracked.gradients,
        optimizer_state=tracked.optimizer_state,
        activations=activations,
        dp_buffers=tracked.dp_buffers,
        other=current - tracked.tracked - activations,
    )
