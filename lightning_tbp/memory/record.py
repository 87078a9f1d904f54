"""The run record: one JSON file per process with a run's memory snapshots, breakdown and timing.

Written by :class:`~lightning_tbp.callbacks.MemoryProfilerCallback` and by the benchmarks, read
by :mod:`lightning_tbp.memory.report`. Sizes are MiB (2**20 bytes) in fields named ``*_mb``.

Top-level keys: ``experiment``, ``config``, ``peak_memory_mb``, ``avg_time_ms``, ``breakdown``,
``snapshots``, plus ``schema_version``, ``rank``, ``world_size``, ``device``, ``meter``,
``median_time_ms``, ``timed_steps``, ``timing_includes_meter`` (the times are of metered
batches, slowed by the CPU meter's profiler), ``machine``.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lightning_tbp.environment import machine_info
from lightning_tbp.memory.breakdown import Breakdown

SCHEMA_VERSION = 1
STAGES = ("batch_start", "after_forward", "after_backward", "after_step")
"""The points of a training batch that MemoryProfilerCallback meters, in order."""
REQUIRED_KEYS = ("experiment", "config", "peak_memory_mb", "avg_time_ms", "breakdown", "snapshots")
BREAKDOWN_KEYS = tuple(f"{f.name}_mb" for f in fields(Breakdown))


@dataclass
class Snapshot:
    """Memory when one stage of one sampled training batch ended."""

    step: int
    """Index of the training batch (micro-batches count separately under accumulation)."""
    global_step: int
    """Optimizer steps taken so far (Lightning's ``trainer.global_step``)."""
    stage: str
    time_s: float
    """Seconds since fit started."""
    current_bytes: int
    peak_bytes: int
    """Highest allocation since the previous stage of the same batch."""
    rss_bytes: int
    reserved_bytes: int | None
    peak_reserved_bytes: int | None
    breakdown: Breakdown
    dp_peak_bytes: int | None = None
    """Under DP: the most bytes the engine held since the previous stage (its buffers' peak in
    the backward); None without DP."""

    def to_dict(self) -> dict[str, Any]:
        def mib(value: int | None) -> float | None:
            return None if value is None else value / 2**20

        return {
            "step": self.step,
            "global_step": self.global_step,
            "stage": self.stage,
            "time_s": self.time_s,
            "current_mb": mib(self.current_bytes),
            "peak_mb": mib(self.peak_bytes),
            "reserved_mb": mib(self.reserved_bytes),
            "peak_reserved_mb": mib(self.peak_reserved_bytes),
            "rss_mb": mib(self.rss_bytes),
            "breakdown": self.breakdown.as_mib(),
            "dp_peak_mb": mib(self.dp_peak_bytes),
        }


def highest_step(snapshots: list[Snapshot]) -> list[Snapshot]:
    """The snapshots of the sampled batch whose peak is highest."""
    if not snapshots:
        return []
    top = max(snapshots, key=lambda s: s.peak_bytes).step
    return [s for s in snapshots if s.step == top]


def high_water_breakdown(step_snapshots: list[Snapshot]) -> Breakdown:
    """Per category, its largest value over the stages of one step.

    What each part of training needs at most; the parts were not necessarily all live at the
    same moment (gradients peak after the backward, activations after the forward). DP buffers
    peak inside the backward, so their high-water mark is the engine's own peak.
    """
    high = {f.name: max(getattr(s.breakdown, f.name) for s in step_snapshots) for f in fields(Breakdown)}
    high["dp_buffers"] = max(high["dp_buffers"], *(s.dp_peak_bytes or 0 for s in step_snapshots))
    return Breakdown(**high)


def build_run_record(
    *,
    experiment: str,
    config: dict[str, Any],
    snapshots: list[Snapshot],
    step_times_s: list[float],
    device: str,
    meter: str,
    rank: int = 0,
    world_size: int = 1,
    timing_includes_meter: bool = False,
) -> dict[str, Any]:
    """The JSON-able record of one process's run (see the module docstring for the keys)."""
    top = highest_step(snapshots)
    return {
        "schema_version": SCHEMA_VERSION,
        "experiment": experiment,
        "rank": rank,
        "world_size": world_size,
        "device": device,
        "meter": meter,
        "config": config,
        "peak_memory_mb": max((s.peak_bytes for s in snapshots), default=0) / 2**20,
        "avg_time_ms": statistics.fmean(step_times_s) * 1e3 if step_times_s else None,
        "median_time_ms": statistics.median(step_times_s) * 1e3 if step_times_s else None,
        "timed_steps": len(step_times_s),
        "timing_includes_meter": timing_includes_meter,
        "breakdown": high_water_breakdown(top).as_mib() if top else Breakdown().as_mib(),
        "snapshots": [s.to_dict() for s in snapshots],
        "machine": machine_info(),
    }


def write_run_record(record: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path


def load_run_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a run record, refusing files that lack the keys the report needs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"run record {path} does not exist")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from error
    missing = [key for key in REQUIRED_KEYS if key not in record] if isinstance(record, dict) else list(REQUIRED_KEYS)
    if missing:
        raise ValueError(
            f"{path} is not a run record: missing {', '.join(missing)} (expected {', '.join(REQUIRED_KEYS)})"
        )
    return record


@dataclass(frozen=True)
class PlanPromise:
    """A run's plan on the device: what training holds outside the step plus the step's budget
    and predicted peak, in MiB (the snapshots' scale)."""

    held_mb: float
    budget_mb: float
    predicted_mb: float


def plan_promise(record: dict[str, Any]) -> PlanPromise | None:
    """The plan's budget and prediction as device totals, or None for a run without a plan."""
    plan = record.get("config", {}).get("plan")
    if not plan or not plan.get("held_bytes"):
        return None
    parts = plan["held_bytes"]
    held = parts["parameters"] + parts["optimizer_state"] + parts.get("gradient_buckets", 0)
    return PlanPromise(
        held / 2**20, (held + plan["budget"]["bytes"]) / 2**20, (held + plan["predicted_peak_bytes"]) / 2**20
    )


def format_stage_table(record: dict[str, Any]) -> str:
    """A readable table of the highest sampled step, stage by stage, with the run's totals."""
    snapshots = record["snapshots"]
    lines = [f"memory report: {record['experiment']} (rank {record.get('rank', 0)}, {record.get('meter', '?')})"]
    if not snapshots:
        lines.append("  no step was sampled (fewer training batches than warmup_steps + 1?)")
        return "\n".join(lines)
    top = max(snapshots, key=lambda s: s["peak_mb"])["step"]
    header = ["stage", "current", "peak", *(key.removesuffix("_mb") for key in BREAKDOWN_KEYS)]
    rows = [
        [s["stage"], s["current_mb"], s["peak_mb"], *(s["breakdown"][key] for key in BREAKDOWN_KEYS)]
        for s in snapshots
        if s["step"] == top
    ]
    widths = [max(len(header[0]), *(len(r[0]) for r in rows)), *(max(len(h), 9) for h in header[1:])]
    lines.append(f"  batch {top}, MiB:")
    lines.append(
        "  " + "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))
    )
    for row in rows:
        cells = [row[0].ljust(widths[0]), *(f"{v:{w}.2f}" for v, w in zip(row[1:], widths[1:], strict=True))]
        lines.append("  " + "  ".join(cells))
    time = record.get("avg_time_ms")
    dp_peak = max((s.get("dp_peak_mb") or 0.0 for s in snapshots if s["step"] == top), default=0.0)
    if dp_peak:
        lines.append(f"  DP engine buffers peaked at {dp_peak:.2f} MiB inside the backward (in the peak above)")
    lines.append(
        f"  peak {record['peak_memory_mb']:.2f} MiB over {len({s['step'] for s in snapshots})} sampled batches; "
        + (f"step time {time:.1f} ms (mean of {record['timed_steps']} steps)" if time is not None else "no timed steps")
    )
    promise = plan_promise(record)
    if promise is not None:
        verdict = "within" if record["peak_memory_mb"] <= promise.budget_mb else "OVER"
        lines.append(
            f"  the plan: budget {promise.budget_mb:.2f} MiB (training holds {promise.held_mb:.2f} MiB outside the "
            f"step), predicted peak {promise.predicted_mb:.2f} MiB; the sampled peak is {verdict} the budget"
        )
    return "\n".join(lines)
