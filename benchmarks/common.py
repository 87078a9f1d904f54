"""Shared measurement helpers for the benchmarks: one training step, measured four ways."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_tbp.memory import measure_peak
from lightning_tbp.remat.flops import FLOP_FORMULAS


@dataclass
class StepMeasurement:
    peak_bytes: int
    flops: int
    step_seconds: float
    grad_max_rel_diff: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    if grads.keys() != reference.keys():
        return float("inf")
    return max(
        ((grads[k] - ref).abs().max() / ref.abs().max().clamp_min(torch.finfo(ref.dtype).tiny)).item()
        for k, ref in reference.items()
    )


def measure_step(
    model: nn.Module,
    step: Callable[[], None],
    trials: int,
    reference_grads: dict[str, torch.Tensor] | None = None,
    count_flops: bool = True,
) -> StepMeasurement:
    """Warm up, then: exact peak (CPU profiler events or CUDA allocator), FLOPs, median time."""
    device = next(model.parameters()).device

    def fresh_step() -> None:
        model.zero_grad(set_to_none=True)
        step()

    fresh_step()  # warm-up (and compilation, for compiled models)
    model.zero_grad(set_to_none=True)
    peak = measure_peak(step, device).peak_bytes
    grads = grads_of(model)
    flops = 0
    if count_flops:
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
            step()
        flops = counter.get_total_flops()
    times = []
    for _ in range(trials):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    diff = max_rel_diff(grads, reference_grads) if reference_grads is not None else None
    return StepMeasurement(peak, flops, statistics.median(times), diff)
