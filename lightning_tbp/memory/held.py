"""What training holds on a device outside the step: parameters and optimizer state.

A per-device budget in bytes is a promise about the whole device, but the rematerialization
plan only shapes the step (forward, backward, gradients). So the strategies subtract what is held
anyway: this process's parameters (its shards under FSDP2, EMA copies included) and the
optimizer state, including the state that does not exist yet. Torch's optimizers create their
state at the first ``step()``, after the plan was made for the first batch, so that part is
predicted: a throwaway copy of the optimizer (same class, same defaults) takes one step on a
probe of each distinct parameter shape, and what it keeps is counted as it is (full copies,
factored rows and columns, low-bit codes and scales), with no table of optimizer classes to keep
up to date.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tbp.compat import FakeTensor, step_unobserved, unobserved_step
from lightning_tbp.memory.breakdown import plain_tensors, tensor_bytes
from lightning_tbp.memory.homes import home_of, hosted_state
from lightning_tbp.memory.meters import allocator_peak
from lightning_tbp.optim.choice import is_low_bit


@dataclass(frozen=True)
class HeldMemory:
    """Bytes held on one device outside the planned step."""

    parameters: int = 0
    optimizer_state: int = 0  # existing plus predicted
    optimizer_state_pending: int = 0  # of which the first optimizer step has yet to create
    gradient_buckets: int = 0  # DDP's: a copy of the trainable gradients, made as it wraps the model

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_state + self.gradient_buckets


def held_memory(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> HeldMemory:
    """Parameters and optimizer state of ``module`` on ``device``, predicting state not made yet."""
    optimizers = list(optimizers)
    existing = tensor_bytes(module, optimizers, device)
    pending = sum(_pending_state_bytes(optimizer, device) for optimizer in optimizers)
    # weights streamed from the host count where they were loaded (plans count from there)
    streamed = sum(
        local_bytes(p)
        for p in module.parameters()
        if (home := home_of(p)) is not None and home.type == device.type and p.device.type != device.type
    )
    return HeldMemory(existing.parameters + streamed, existing.optimizer_state + pending, pending)


def _pending_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes the optimizer's first step will allocate on ``device`` for parameters that have no
    state yet (and whose state is not the host tier's): a twin's state for a probe of each
    distinct shape, dtype and group, times how many parameters share it (see
    :func:`state_bytes_of_a_step`)."""
    hosted = hosted_state(optimizer)
    return state_bytes_to_come(
        optimizer,
        (
            (index, p, p.dtype)
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
            if p.requires_grad and not optimizer.state.get(p) and p.device.type == device.type and id(p) not in hosted
        ),
    )


def state_bytes_to_come(
    optimizer: torch.optim.Optimizer, params: Iterable[tuple[int, torch.Tensor, torch.dtype]]
) -> int:
    """Bytes ``optimizer``'s first step makes for ``params`` (group index, parameter, the dtype it
    is stepped in: its own, or its master's on the host), probed once per distinct shape."""
    shapes: Counter[tuple[int, tuple[int, ...], torch.dtype]] = Counter(
        (index, tuple(_local(p).shape), dtype) for index, p, dtype in params
    )
    return sum(
        count * state_bytes_of_a_step(optimizer, optimizer.param_groups[index], shape, dtype)
        for (index, shape, dtype), count in shapes.items()
    )


def state_bytes_of_a_step(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype
) -> int:
    """The state one step of ``optimizer`` makes for a parameter of ``shape`` and ``dtype`` in
    ``group``: a fresh twin (same class, defaults and group options) steps a zero probe of that
    shape on the CPU, once, and its state is counted as :func:`~lightning_tbp.memory.breakdown.plain_tensors`
    reads it, so whatever the optimizer keeps comes out as it is, with no table of optimizers:
    Adam's two copies, Adafactor's factored rows and columns of a matrix, torchao's 8-bit and
    4-bit codes and block scales (only for parameters large enough to quantize). Scalars (step
    counters, kept on the CPU unless the step is fused or capturable) are left out. The twin runs
    with ``torch.compile`` off (``force_eager``): a compiled step (torchao's) keeps the same state,
    and compiling one probe per shape would cost more than the step.

    torch's own optimizers run eagerly anyway, so their probe at full size costs what their step
    does. An optimizer from elsewhere may be written for ``torch.compile`` alone (eager torchao
    quantizes through a table of 256 entries per element: an SDXL weight's probe would take
    13 GiB), so a parameter of more than ``_STATE_PROBE_NUMEL`` elements is probed as a vector
    of a divisor of its size that keeps its factors of two up to 2^12 (block sizes are powers
    of two), and the state scaled up by the quotient: per-element and per-block state scales
    exactly; what does not scale is overcounted (torchao's code book, one table shared by every
    state, counted once per probe's worth: 1.6% over on a 640-channel conv with 8-bit AdamW)."""
    eager = type(optimizer).__module__.startswith("torch.optim")
    probe_shape, scale = (shape, 1) if eager else _probe_shape(shape)
    probe = _probe(probe_shape, dtype, torch.device("cpu"))
    options = _options(group)
    try:
        twin = optimizer_twin(optimizer, [{**options, "params": [probe]}], portable=True)
        with torch.compiler.set_stance("force_eager"):
            step_unobserved(twin)
    except Exception as error:  # an optimizer we cannot imitate: say so rather than guess
        warnings.warn(
            f"lightning_tbp: cannot predict the state of {type(optimizer).__name__} ({error}); "
            "the memory budget leaves no room for the optimizer state its first step creates",
            stacklevel=4,
        )
        return 0
    return scale * sum(t.numel() * t.element_size() for t in plain_tensors(twin.state.get(probe, {})) if t.dim() > 0)


#: Largest parameter a state probe takes at its own shape (see :func:`state_bytes_of_a_step`).
_STATE_PROBE_NUMEL = 1 << 16


def _probe_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """A probe shape for a parameter of ``shape`` and how many such probes it is worth."""
    numel = math.prod(shape)
    if numel <= _STATE_PROBE_NUMEL:
        return shape, 1
    twos = min((numel & -numel).bit_length() - 1, 12)
    divisors = {d for i in range(1, math.isqrt(numel) + 1) if numel % i == 0 for d in (i, numel // i)}
    size = max(d for d in divisors if d <= _STATE_PROBE_NUMEL and d % (1 << twos) == 0)
    return (size,), numel // size


def optimizer_twin(optimizer: torch.optim.Optimizer, params: list[Any], portable: bool) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and defaults over ``params``. Only what the
    constructor takes (AdamW's defaults hold a key its ``__init__`` refuses); ``portable``: without
    the device-only switches (``fused``, ``capturable``), which refuse a CPU probe and do not
    change what state is kept."""
    unobserved_step(type(optimizer))  # refuses, before a twin is made, a class whose step cannot run unseen
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in _options(optimizer.defaults).items() if k in accepted}
    if portable:
        defaults.update({k: False for k in ("fused", "capturable") if defaults.get(k)})
    return type(optimizer)(params, **defaults)


def _options(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's options for a twin, real: an option held as a tensor (torchao keeps the
    learning rate in one) is fake under ``tbp estimate``, and a fake tensor cannot step a real
    probe; its value does not change what a step keeps or allocates, so 1e-3 stands in."""
    return {
        k: torch.full(tuple(v.shape), 1e-3, dtype=v.dtype) if isinstance(v, FakeTensor) else v
        for k, v in group.items()
        if k != "params"
    }


#: Elements the step probe's replica of the parameters may hold at most (4 MiB in float32).
_REPLICA_NUMEL = 1 << 20


def optimizer_step_bytes(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> int:
    """What an optimizer step allocates on ``device`` beyond the gradients and the state (its
    temporaries), the highest of ``optimizers``.

    Measured on a twin (same class, defaults and parameter groups) stepping a replica of the
    parameters on the device, each scaled down by one factor (at most ``_REPLICA_NUMEL``
    elements in all), then scaled up: a step's temporaries are element-wise, so they scale with
    the sizes, and the replica keeps what decides them, whether an implementation works on a
    group at once (torch's ``foreach``, the default on CUDA: in proportion to the group's total)
    or one parameter at a time (the default on CPU: the largest, and the last one's temporaries
    still held while the next one's are made). An optimizer that cannot be imitated is predicted
    at 0, with a warning.

    torchao's low-bit optimizers step one parameter at a time through a compiled kernel, and run
    eagerly they quantize through a table of 256 entries per element: their step is measured
    compiled, on one probe of the largest parameter's shape (:func:`parameter_step_ratio`;
    the real step then finds that shape compiled on a CPU), and is its temporaries."""
    return max((_step_bytes(optimizer, device) for optimizer in optimizers), default=0)


def _step_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    if is_low_bit(optimizer):
        largest = max(_trainable_on(optimizer, device), key=local_bytes, default=None)
        return 0 if largest is None else math.ceil(_parameter_ratio(optimizer, device) * local_bytes(largest))
    groups = [
        [p for p in group["params"] if p.requires_grad and p.device.type == device.type]
        for group in optimizer.param_groups
    ]
    numels = [local_bytes(p) // p.element_size() for group in groups for p in group]
    if not numels:
        return 0
    scale = max(1, math.ceil(sum(numels) / _REPLICA_NUMEL))
    replica = [
        {
            **_options(group),
            "params": [_probe(math.ceil(local_bytes(p) / p.element_size() / scale), p.dtype, device) for p in params],
        }
        for group, params in zip(optimizer.param_groups, groups, strict=True)
        if params
    ]
    return _temporaries(optimizer, replica, device) * scale


def parameter_step_ratio(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> float:
    """What an optimizer step of one parameter allocates beyond its gradient and state, per byte
    of the parameter, the highest of ``optimizers``: the temporaries each parameter's step adds
    while it runs when the optimizer steps inside the backward (``lightning_tbp.optim``).

    Measured like :func:`optimizer_step_bytes`, on a twin stepping one probe parameter of the
    dtype and group of the largest parameter (at most ``_REPLICA_NUMEL`` elements): a step of one
    parameter is element-wise in it."""
    return max((_parameter_ratio(optimizer, device) for optimizer in optimizers), default=0.0)


def _parameter_ratio(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    grouped = [
        (group, p)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and p.device.type == device.type
    ]
    if not grouped:
        return 0.0
    group, largest = max(grouped, key=lambda pair: local_bytes(pair[1]))
    shape = tuple(_local(largest).shape)
    if math.prod(shape) > _REPLICA_NUMEL:
        shape = (_REPLICA_NUMEL,)
    probe = _probe(shape, largest.dtype, device)
    replica = [{**_options(group), "params": [probe]}]
    return _temporaries(optimizer, replica, device) / (probe.numel() * largest.element_size())


def _trainable_on(optimizer: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    return [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and p.device.type == device.type
    ]


def _temporaries(optimizer: torch.optim.Optimizer, replica: list[dict[str, Any]], device: torch.device) -> int:
    """Peak bytes a twin of ``optimizer`` over ``replica`` allocates in a step beyond the state it adds."""
    try:
        twin = optimizer_twin(optimizer, replica, portable=device.type != "cuda")
        highest = 0
        # torchao's steps as they run, compiled; any other eagerly (one that compiles its own step
        # would compile the replica's shapes, which the real step never uses)
        stance = "default" if is_low_bit(optimizer) else "force_eager"
        for _ in range(2):  # the first makes the state (not counted), the second steps with it
            before = _state_bytes(twin)
            with allocator_peak(device) as reading, torch.compiler.set_stance(stance):
                step_unobserved(twin)
            highest = max(highest, reading.peak_bytes - (_state_bytes(twin) - before))
    except Exception as error:
        warnings.warn(
            f"lightning_tbp: cannot predict the temporaries of a {type(optimizer).__name__} step ({error}); "
            "plans leave no room for them",
            stacklevel=5,
        )
        return 0
    return highest


def _probe(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero parameter of ``shape`` whose gradient is ones."""
    probe = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    return probe


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in plain_tensors(state))


def local_bytes(param: torch.Tensor) -> int:
    """Bytes of this process's part of ``param``: its shard when FSDP2 sharded it into a DTensor
    (its gradient and optimizer state are shards too), all of it otherwise."""
    local = _local(param)
    return local.numel() * local.element_size()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
