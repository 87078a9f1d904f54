"""Forward and backward workspace of heavy ops, measured rather than guessed.

Convolution and matmul kernels allocate temporaries beyond the tensors they return (weight and
layout reorders on CPU, cuDNN/cuBLAS workspaces on CUDA), in the forward (and so in every
recomputation) and in the backward. They sit on top of whatever is live at that moment, so the
simulator must know them. Each distinct (op, shapes, dtypes, arguments) is run once on its own
under the exact allocator meter: the forward workspace is the forward peak minus the outputs,
the backward workspace the backward peak minus the gradients it leaves behind. One op at a time
keeps this memory-safe.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from lightning_tbp.memory.meters import allocator_peak, measure_peak, profiler_active


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool

    def materialise(self) -> torch.Tensor:
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if self.dtype.is_floating_point:
            tensor.normal_()
        else:
            tensor.zero_()
        return tensor.requires_grad_(self.needs_grad)


class WorkspaceCalibrator:
    """Collects heavy ops during tracing and measures their backward workspace afterwards."""

    def __init__(self) -> None:
        self._specs: dict[tuple, tuple[Any, tuple, dict]] = {}
        self.event_keys: dict[int, tuple] = {}

    def note(self, event: int, func: Any, args: tuple, kwargs: dict, needs_grad: list[bool]) -> None:
        """Remember the op of ``event``; ``needs_grad`` flags which tensor arguments need gradients."""
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

    def measure(self) -> dict[int, tuple[int, int]]:
        """(forward, backward) workspace bytes per noted event (none under a running profiler)."""
        if profiler_active() and any(_device_of(spec).type == "cpu" for spec in self._specs.values()):
            warnings.warn(
                "lightning_tbp: a torch profiler is running, so op workspaces cannot be measured on CPU; "
                "plans made now predict peaks a few percent low (plan outside the profiler to avoid this)",
                stacklevel=4,
            )
            return {}
        per_key = {key: _measure_one(*spec) for key, spec in self._specs.items()}
        return {event: per_key[key] for event, key in self.event_keys.items()}


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
