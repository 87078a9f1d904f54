"""Per-op calibration, measured rather than guessed: time, and workspace of heavy ops.

**Time.** The planner minimises recomputation *time*. FLOPs mislead: on a CPU a group norm over
a 64x64 map can cost as much as the small convolution next to it. Each distinct (op, shapes,
dtypes, arguments) of the trace is run on its own, without gradients, and timed (best of two
runs after a warm-up; CUDA synchronised); pure views cost nothing and are not run.
Each op's backward is timed the same way (random output gradients), so the naive step's time
is predicted from its parts too. Forward times are then scaled to the real forward of the block
around each op (``trace._scale_to_framework``): recomputation runs in the framework, with its
Python and autograd work; what the plan options add beyond their ops is ``overheads.py``'s.

**Workspace.** Convolution and matmul kernels allocate temporaries beyond the tensors they return (weight and
layout reorders on CPU, cuDNN/cuBLAS workspaces on CUDA), in the forward (and so in every
recomputation) and in the backward. They sit on top of whatever is live at that moment, so the
simulator must know them. Each distinct (op, shapes, dtypes, arguments) is run once on its own
under the exact allocator meter: the forward workspace is the forward peak minus the outputs,
the backward workspace the backward peak minus the gradients it leaves behind. One op at a time
keeps this memory-safe.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from lightning_tbp.compat import op_schema, tree_flatten, tree_map
from lightning_tbp.memory.meters import allocator_peak, garbage_collection_held, measure_peak, profiler_active


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool

    def materialise(self) -> torch.Tensor:
        # Fill a flat storage, then view it with the recorded strides: strides may overlap
        # (an ``expand``ed input has stride 0), and in-place fills refuse overlapping tensors.
        extent = 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True))
        storage = torch.empty(extent if all(self.shape) else 0, dtype=self.dtype, device=self.device)
        if self.dtype.is_floating_point:
            storage.normal_()
        else:
            storage.zero_()
        tensor = storage.as_strided(self.shape, self.stride)
        return tensor.requires_grad_(self.needs_grad)


class OpCalibrator:
    """Collects the ops of a trace and measures their time (all) and workspace (heavy ones)."""

    def __init__(self) -> None:
        self._specs: dict[tuple, tuple[Any, tuple, dict]] = {}
        self.event_keys: dict[int, tuple] = {}
        self._workspace_keys: set[tuple] = set()
        self._timed_keys: set[tuple] = set()

    def note(self, event: int, func: Any, args: tuple, kwargs: dict, needs_grad: list[bool], workspace: bool) -> None:
        """Remember the op of ``event``; ``needs_grad`` flags which tensor arguments need gradients;
        ``workspace``: also measure its forward/backward workspace. Pure views are not timed:
        they only make metadata."""
        flags = iter(needs_grad)

        def describe(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            grad = next(flags) and x.is_floating_point()
            return _TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype, x.device, grad)

        spec = tree_map(describe, (args, kwargs))
        key = (func, *tree_flatten(spec)[0])
        self._specs.setdefault(key, (func, *spec))
        self.event_keys[event] = key
        if workspace:
            self._workspace_keys.add(key)
        if not _is_view(func) and not _is_communication(func):
            self._timed_keys.add(key)

    def measure_times(self) -> dict[int, tuple[float, float]]:
        """(forward, backward) nanoseconds per noted event (0 for views)."""
        per_key = {key: (_time_op(*self._specs[key]), _time_op_backward(*self._specs[key])) for key in self._timed_keys}
        return {event: per_key.get(key, (0.0, 0.0)) for event, key in self.event_keys.items()}

    def measure_workspaces(self) -> dict[int, tuple[int, int]]:
        """(forward, backward) workspace bytes per heavy event (none under a running profiler)."""
        specs = {key: self._specs[key] for key in self._workspace_keys}
        if profiler_active() and any(_device_of(spec).type == "cpu" for spec in specs.values()):
            warnings.warn(
                "lightning_tbp: a torch profiler is running, so op workspaces cannot be measured on CPU; "
                "plans made now predict peaks a few percent low (plan outside the profiler to avoid this)",
                stacklevel=4,
            )
            return {}
        with garbage_collection_held():  # one collection for all the ops, not one each
            per_key = {key: _measure_one(*spec) for key, spec in specs.items()}
        return {event: per_key[key] for event, key in self.event_keys.items() if key in per_key}


_TIMING_RUNS = 2


def _is_view(func: Any) -> bool:
    """An op whose outputs alias an input without writing to it (view, transpose, expand, ...)."""
    returns = op_schema(func).returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _is_communication(func: Any) -> bool:
    """Collectives (FSDP2's all-gathers run inside the forward): timing one alone on one process
    would wait for the others forever, and no plan recomputes them."""
    return func.namespace in _COMMUNICATION_NAMESPACES


_COMMUNICATION_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "fsdp"})


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(func: Any, spec_args: tuple, spec_kwargs: dict) -> float:
    """Best-of-``_TIMING_RUNS`` forward time of one op in nanoseconds (0 if it cannot run alone)."""
    device = _device_of((func, spec_args, spec_kwargs))
    args, kwargs = tree_map(
        lambda x: x.materialise().detach() if isinstance(x, _TensorSpec) else x,
        (spec_args, spec_kwargs),
        is_leaf=lambda x: isinstance(x, _TensorSpec),
    )
    best = float("inf")
    with torch.no_grad():
        try:
            func(*args, **kwargs)  # warm-up (allocator, kernel selection)
            for _ in range(_TIMING_RUNS):
                _synchronise(device)
                start = time.perf_counter_ns()
                func(*args, **kwargs)
                _synchronise(device)
                best = min(best, time.perf_counter_ns() - start)
        except (RuntimeError, IndexError, ValueError):  # data-dependent ops fail on random data
            return 0.0
    return float(best)


def _time_op_backward(func: Any, spec_args: tuple, spec_kwargs: dict) -> float:
    """Best-of-``_TIMING_RUNS`` time of one op's backward for random output gradients (0 if none)."""
    specs = [x for x in tree_flatten((spec_args, spec_kwargs))[0] if isinstance(x, _TensorSpec)]
    if not any(x.needs_grad for x in specs):
        return 0.0
    device = specs[0].device
    args, kwargs = tree_map(
        lambda x: x.materialise() if isinstance(x, _TensorSpec) else x,
        (spec_args, spec_kwargs),
        is_leaf=lambda x: isinstance(x, _TensorSpec),
    )
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    best = float("inf")
    try:
        with torch.enable_grad():
            results = tree_flatten([func(*args, **kwargs)])[0]
        outs = [o for o in results if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return 0.0
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)  # warm-up
        for _ in range(_TIMING_RUNS):
            _synchronise(device)
            start = time.perf_counter_ns()
            torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
            _synchronise(device)
            best = min(best, time.perf_counter_ns() - start)
    except (RuntimeError, IndexError, ValueError):  # data-dependent ops fail on random data
        return 0.0
    return float(best)


def _device_of(spec: tuple) -> torch.device:
    tensors = [x for x in tree_flatten(spec[1:])[0] if isinstance(x, _TensorSpec)]
    return tensors[0].device if tensors else torch.device("cpu")


def _measure_one(func: Any, spec_args: tuple, spec_kwargs: dict) -> tuple[int, int]:
    specs = [x for x in tree_flatten((spec_args, spec_kwargs))[0] if isinstance(x, _TensorSpec)]
    device = specs[0].device
    if not any(x.needs_grad for x in specs) or device.type not in ("cpu", "cuda"):
        return 0, 0
    args, kwargs = tree_map(
        lambda x: x.materialise() if isinstance(x, _TensorSpec) else x,
        (spec_args, spec_kwargs),
        is_leaf=lambda x: isinstance(x, _TensorSpec),
    )
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    result: list[Any] = []
    with torch.enable_grad(), allocator_peak(device) as forward:
        result.append(func(*args, **kwargs))
    outs = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor)]
    forward_workspace = max(0, forward.peak_bytes - forward.net_bytes)
    outs = [o for o in outs if o.requires_grad]
    if not outs:
        return forward_workspace, 0
    grads_out = [torch.randn_like(o) for o in outs]
    grad_bytes = sum(x.numel() * x.element_size() for x in inputs)
    peak = measure_peak(lambda: torch.autograd.backward(outs, grads_out), device).peak_bytes
    return forward_workspace, max(0, peak - grad_bytes)
