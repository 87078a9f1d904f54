"""Compare run records side by side: stacked breakdown bars, timelines, peak against step time.

``compare_runs(paths, out_dir)`` (and ``tbp report RUN_JSON... --out DIR``) writes
``memory_breakdown_comparison.png``, ``memory_timeline.png``, ``performance_tradeoff.png`` and
``summary.txt``. The first run is the baseline of the ratios in the summary.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_tbp.memory.record import BREAKDOWN_KEYS, STAGES, format_stage_table, load_run_record, plan_promise


@dataclass
class ReportFiles:
    breakdown: Path
    timeline: Path
    tradeoff: Path
    summary: Path


def _labels(records: list[dict[str, Any]]) -> list[str]:
    labels = [
        f"{r['experiment']} (rank {r.get('rank', 0)})" if r.get("world_size", 1) > 1 else r["experiment"]
        for r in records
    ]
    counts = {label: labels.count(label) for label in labels}
    seen: dict[str, int] = {}
    unique = []
    for label in labels:  # two runs with one name stay apart: "name #2"
        seen[label] = seen.get(label, 0) + 1
        unique.append(f"{label} #{seen[label]}" if counts[label] > 1 else label)
    return unique


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _plot_breakdown(plt: Any, records: list[dict[str, Any]], labels: list[str], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(records) + 3), 4.8))
    bottoms = [0.0] * len(records)
    for key in BREAKDOWN_KEYS:
        values = [max(0.0, r["breakdown"][key]) for r in records]
        ax.bar(labels, values, bottom=bottoms, label=key.removesuffix("_mb").replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.scatter(labels, [r["peak_memory_mb"] for r in records], marker="_", s=900, color="black", zorder=3, label="peak")
    ax.set_ylabel("MiB")
    ax.set_title("Memory per category (each at its high-water mark) and peak")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_timeline(plt: Any, records: list[dict[str, Any]], labels: list[str], path: Path) -> None:
    """One segment per metered batch, side by side: what happens between them was not metered."""
    fig, ax = plt.subplots(figsize=(9, 4.8))
    stage_rank = {stage: i for i, stage in enumerate(STAGES)}
    for record, label in zip(records, labels, strict=True):
        batches = sorted({s["step"] for s in record["snapshots"]})
        color = None
        for ordinal, batch in enumerate(batches):
            snaps = [s for s in record["snapshots"] if s["step"] == batch]
            x = [ordinal + stage_rank.get(s["stage"], 0) / len(STAGES) for s in snaps]
            first = ordinal == 0
            (line,) = ax.plot(
                x,
                [s["current_mb"] for s in snaps],
                marker=".",
                color=color,
                label=f"{label}: current" if first else None,
            )
            color = line.get_color()
            ax.plot(
                x, [s["peak_mb"] for s in snaps], linestyle="--", color=color, label=f"{label}: peak" if first else None
            )
        promise = plan_promise(record)
        if promise is not None:
            ax.axhline(
                promise.budget_mb, color=color, linestyle="-", linewidth=2.5, alpha=0.4, label=f"{label}: budget"
            )
            ax.axhline(promise.predicted_mb, color=color, linestyle=":", label=f"{label}: predicted peak")
    ax.set_xlabel("metered batch (each: start, after forward, after backward, after step)")
    ax.set_ylabel("MiB")
    ax.set_title("Memory at each stage of the metered batches, against the plan's budget and prediction", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_tradeoff(plt: Any, records: list[dict[str, Any]], labels: list[str], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for record, label in zip(records, labels, strict=True):
        if record.get("avg_time_ms") is None:
            continue
        ax.scatter(record["avg_time_ms"], record["peak_memory_mb"], s=60)
        ax.annotate(
            label,
            (record["avg_time_ms"], record["peak_memory_mb"]),
            fontsize=8,
            xytext=(5, 5),
            textcoords="offset points",
        )
    ax.set_xlabel("mean step time, ms")
    ax.set_ylabel("peak memory, MiB")
    ax.set_title("Peak memory against step time")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _summary(records: list[dict[str, Any]], labels: list[str]) -> str:
    base = records[0]
    lines = [f"{len(records)} runs; ratios against {labels[0]}", ""]
    width = max(len(label) for label in labels)
    lines.append(
        f"{'run'.ljust(width)}  {'peak MiB':>9}  {'x peak':>7}  {'step ms':>8}  {'x time':>7}  {'activations MiB':>15}"
    )
    for record, label in zip(records, labels, strict=True):
        time, base_time = record.get("avg_time_ms"), base.get("avg_time_ms")
        time_cells = (
            f"{time:8.1f}  {time / base_time:7.3f}" if time is not None and base_time else f"{'-':>8}  {'-':>7}"
        )
        peak_ratio = record["peak_memory_mb"] / base["peak_memory_mb"] if base["peak_memory_mb"] else float("nan")
        lines.append(
            f"{label.ljust(width)}  {record['peak_memory_mb']:9.2f}  {peak_ratio:7.3f}  {time_cells}  "
            f"{record['breakdown']['activations_mb']:15.2f}"
        )
    for record, label in zip(records, labels, strict=True):
        promise = plan_promise(record)
        if promise is not None:
            verdict = "within" if record["peak_memory_mb"] <= promise.budget_mb else "OVER"
            lines.append(
                f"{label}: plan budget {promise.budget_mb:.2f} MiB on the device (held {promise.held_mb:.2f} + the "
                f"step's), predicted {promise.predicted_mb:.2f}; sampled peak {record['peak_memory_mb']:.2f} MiB, "
                f"{verdict} the budget"
            )
    for record in records:
        lines += ["", format_stage_table(record)]
        if record.get("timing_includes_meter"):
            lines.append("  (its step times include the CPU meter's profiler)")
    return "\n".join(lines) + "\n"


def compare_runs(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]) -> ReportFiles:
    """Write the comparison plots and ``summary.txt`` for the run records at ``paths``."""
    if not paths:
        raise ValueError("compare_runs needs at least one run record (memory_rank*.json)")
    records = [load_run_record(p) for p in paths]
    labels = _labels(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(
        breakdown=out / "memory_breakdown_comparison.png",
        timeline=out / "memory_timeline.png",
        tradeoff=out / "performance_tradeoff.png",
        summary=out / "summary.txt",
    )
    plt = _pyplot()
    _plot_breakdown(plt, records, labels, files.breakdown)
    _plot_timeline(plt, records, labels, files.timeline)
    _plot_tradeoff(plt, records, labels, files.tradeoff)
    files.summary.write_text(_summary(records, labels))
    return files
