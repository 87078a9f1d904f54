"""Shared measurement helpers for the benchmarks: one training step, measured four ways."""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_tbp.memory import measure_peak
from lightning_tbp.remat.flops import FLOP_FORMULAS
from lightning_tbp.remat.overheads import timed_ns

#: glibc malloc settings for timed CPU benchmarks. With glibc's defaults, blocks above a moving
#: threshold are mapped on allocation and unmapped on free, so a step page-faults its large
#: tensors afresh more or less often from run to run: the same plan of a small VAE measured 0.13
#: and 0.34 of a step's overhead in two processes (0.23 and 0.25 with these). Fixed thresholds keep
#: freed blocks for reuse, as CUDA's caching allocator does. Torch's own byte counts (the memory
#: meters) do not depend on them.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}


def run_with_steady_malloc() -> None:
    """Re-run this script with :data:`STEADY_MALLOC` in its environment unless it already has it
    (glibc reads these once, at start-up). Does nothing off Linux."""
    if sys.platform != "linux" or all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_MALLOC})


def malloc_settings() -> dict[str, str]:
    """The malloc settings this process runs with, for result files."""
    return {k: os.environ.get(k, "default") for k in STEADY_MALLOC}


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
    warmup: int = 1,
) -> StepMeasurement:
    """Warm up, then: exact peak (CPU profiler events or CUDA allocator), FLOPs, median time."""
    device = next(model.parameters()).device

    for _ in range(warmup):  # (and compilation, for compiled models)
        model.zero_grad(set_to_none=True)
        step()
    model.zero_grad(set_to_none=True)
    peak = measure_peak(step, device).peak_bytes
    grads = grads_of(model)
    flops = 0
    if count_flops:
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
            step()
        flops = counter.get_total_flops()
    seconds = statistics.median(timed_step(model, step, device) for _ in range(trials))
    diff = max_rel_diff(grads, reference_grads) if reference_grads is not None else None
    return StepMeasurement(peak, flops, seconds, diff)


def timed_step(model: nn.Module, step: Callable[[], None], device: torch.device) -> float:
    """Seconds of one step that starts without gradients."""
    model.zero_grad(set_to_none=True)
    return timed_ns(step, device) / 1e9


def median_times_in_turns(
    runs: list[tuple[nn.Module, Callable[[], None]]], trials: int, device: torch.device
) -> list[float]:
    """Median step seconds of each (model, step), timed round-robin: on a shared machine whose
    speed drifts, every run then sees the same drift and their ratios stay meaningful."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(trials):
        for spent, (model, step) in zip(times, runs, strict=True):
            spent.append(timed_step(model, step, device))
    return [statistics.median(spent) for spent in times]


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def device_label(machine: dict[str, Any]) -> str:
    return machine.get("gpu", machine["processor"])


def write_result(result: dict[str, Any], out: Path, name: str, plot: Callable[[dict[str, Any]], Any]) -> None:
    """``out/name.json`` and ``out/name.png``, the figure that ``plot`` draws from the result."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    figure = plot(result)
    figure.tight_layout()
    figure.savefig(out / f"{name}.png", dpi=120)
    pyplot().close(figure)
    print(f"wrote {out / name}.json and .png")
