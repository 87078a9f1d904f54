"""What the optimizer's step costs where a plan puts it, measured on probes as it runs.

Stepped after the backward, the optimizer runs once over every parameter, outside the step the
planner times. Stepped inside the backward (``in_backward.py``) it runs once per parameter,
inside the step: a fixed cost per call (a small model's many tensors pay mostly that) and a cost
per byte. On the host (``host_state.py``) each parameter's gradient is copied down, the step is
handed to a worker thread and waited for, and the new values are copied back. Each is timed on
a twin of the user's optimizer (same class and options) over a one-element probe (the fixed
cost) and a large one (the rest, per byte), so the plan's predicted step time and its stall
guard (``Plan(max_slowdown=)``) count them.
"""

from __future__ import annotations

import statistics
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from lightning_tbp.compat import step_unobserved, unset_fake_temporarily
from lightning_tbp.memory.held import local_bytes, optimizer_twin


@dataclass(frozen=True)
class StepCost:
    """Time of stepping parameters one at a time: per call, and per byte of parameter."""

    per_tensor_ns: float
    per_byte_ns: float

    def of(self, tensors: int, nbytes: int) -> float:
        return tensors * self.per_tensor_ns + nbytes * self.per_byte_ns


NO_COST = StepCost(0.0, 0.0)


def _trainable(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def trainable_of(optimizer: Optimizer) -> tuple[int, int]:
    """How many parameters ``optimizer`` steps, and their bytes (this process's shards)."""
    trainable = _trainable(optimizer)
    return len(trainable), sum(local_bytes(p) for p in trainable)


def in_backward_step_cost(optimizer: Optimizer, device: torch.device, numel: int = 1 << 20) -> StepCost:
    """``optimizer`` stepping one parameter at a time on ``device``."""
    return _measured(optimizer, device, numel, on=device, worker=None)


def in_backward_ns(optimizer: Optimizer, device: torch.device) -> float:
    """Time of ``optimizer``'s steps inside the backward, each of its parameters alone, on ``device``."""
    return in_backward_step_cost(optimizer, device).of(*trainable_of(optimizer))


def host_ns(optimizer: Optimizer, device: torch.device, master_dtype: torch.dtype | None = None) -> float:
    """Time of ``optimizer``'s steps on the host, with the copies, for a model trained on
    ``device`` (its masters in ``master_dtype`` where that is wider: ``host_state.py``)."""
    return host_step_cost(optimizer, device, master_dtype=master_dtype).of(*trainable_of(optimizer))


def host_step_cost(
    optimizer: Optimizer, device: torch.device, numel: int = 1 << 20, master_dtype: torch.dtype | None = None
) -> StepCost:
    """``optimizer`` stepping one parameter at a time on the host for a model trained on
    ``device``: the gradient's copy down, the step on the host's worker thread (on a master of
    ``master_dtype`` where that is wider than the parameter's), the copy back. On CUDA, where
    the host's steps overlap the backward, an upper bound."""
    with ThreadPoolExecutor(1, thread_name_prefix="lightning_tbp-host-step-probe") as worker:
        return _measured(optimizer, device, numel, on=torch.device("cpu"), worker=worker, master_dtype=master_dtype)


def host_optimizer_ns_per_byte(optimizer: Optimizer, numel: int = 1 << 20, dtype: torch.dtype | None = None) -> float:
    """Time of ``optimizer``'s step on this machine's CPU per byte of parameter (a twin on a probe
    of ``numel`` elements of ``dtype``, by default its largest parameter's; the median of three
    after the step that makes the state): what ``tbp estimate`` charges for the host step."""
    dtype = dtype or _largest_dtype(optimizer)
    cpu = torch.device("cpu")
    with unset_fake_temporarily():
        ns = _median_step_ns(optimizer, dtype, numel, cpu, cpu, None)
    return ns / (numel * torch.empty((), dtype=dtype).element_size())


def _measured(
    optimizer: Optimizer,
    device: torch.device,
    numel: int,
    on: torch.device,
    worker: ThreadPoolExecutor | None,
    master_dtype: torch.dtype | None = None,
) -> StepCost:
    if not _trainable(optimizer):
        return NO_COST
    dtype = _largest_dtype(optimizer)
    widened = master_dtype if master_dtype is not None and master_dtype.itemsize > dtype.itemsize else dtype
    try:
        one, many = (_median_step_ns(optimizer, dtype, n, on, device, worker, widened) for n in (1, numel))
    except TypeError as error:  # a step that cannot be run unseen (``compat.step_unobserved``)
        warnings.warn(
            f"lightning_tbp: cannot time a {type(optimizer).__name__} step ({error}); plans count it as free",
            stacklevel=2,
        )
        return NO_COST
    nbytes = (numel - 1) * torch.empty((), dtype=dtype).element_size()
    return StepCost(one, max(0.0, many - one) / nbytes)


def _largest_dtype(optimizer: Optimizer) -> torch.dtype:
    trainable = _trainable(optimizer)
    return max(trainable, key=local_bytes).dtype if trainable else torch.float32


def _median_step_ns(
    optimizer: Optimizer,
    dtype: torch.dtype,
    numel: int,
    on: torch.device,
    device: torch.device,
    worker: ThreadPoolExecutor | None,
    probe_dtype: torch.dtype | None = None,
) -> float:
    """The median of three steps of a twin of ``optimizer`` on a probe of ``numel`` elements on
    ``on`` (after a warm-up that makes its state); with a ``worker``, as the host's steps run:
    the gradient copied from the training ``device``, the step handed to the worker thread and
    waited for, the new values copied back. ``probe_dtype``: the probe's (a wider master's),
    the gradient widened to it on the host."""
    probe = torch.zeros(numel, dtype=probe_dtype or dtype, device=on, requires_grad=True)
    twin = optimizer_twin(optimizer, [probe], portable=on.type != "cuda")
    grad = torch.ones(numel, dtype=dtype, device=device)
    param = torch.zeros(numel, dtype=dtype, device=device)

    def step_and_copy_back() -> None:
        step_unobserved(twin)
        param.copy_(probe.detach())

    def once() -> float:
        _synchronize(device)
        start = time.perf_counter_ns()
        if worker is None:
            probe.grad = grad
            step_unobserved(twin)
        else:
            probe.grad = grad.to(on, copy=True).to(probe.dtype)
            worker.submit(step_and_copy_back).result()
        _synchronize(device)
        return time.perf_counter_ns() - start

    once()
    return statistics.median(once() for _ in range(3))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
