"""Every promise of the planner, checked on a zoo of diffusers architectures nobody tuned it on.

For each architecture of ``zoo_models.py`` (each in its own process with ``--all``), one training
step (forward, MSE to a fixed target, backward, fp32) is measured plainly and under:

* ``diffusers``: the model's own ``enable_gradient_checkpointing()`` (where it has one);
* ``tbp:0.5`` and ``tbp:lowest``: lightning_tbp plans at half the naive peak and at the lowest
  budget the planner reaches;
* ``tbp:at_diffusers``: a plan whose budget is the peak diffusers' checkpointing measured (the
  planner aims 5% below a budget, so this plan peaks lower than diffusers);
* ``tbp:equal_peak``: a plan allowed to peak where diffusers' checkpointing peaks (the budget
  whose margin ends at that peak): the comparison at equal peak.

Per mode: the exact allocator peak (CPU: profiler events; CUDA: allocator statistics), the
budget and the predicted peak, FLOPs (recomputation included), the median step time over
interleaved rounds (every mode sees the same drift), the predicted and measured time overhead
over the plain step, and the largest relative gradient difference from plain autograd. On Linux
the script re-runs itself with glibc's malloc thresholds fixed (``common.STEADY_MALLOC``), so step
times do not depend on how often a process happens to page-fault its tensors afresh.

    python benchmarks/zoo.py --all --out docs/benchmarks/zoo          # every architecture, CPU
    python benchmarks/zoo.py --all --held-out --out DIR                # the held-out architectures instead
    python benchmarks/zoo.py --arch sd3 --out /tmp/zoo                 # one
    python benchmarks/zoo.py --all --device cuda --out DIR              # on a GPU (CUDA allocator peaks)
    python benchmarks/zoo.py --summarize --out docs/benchmarks/zoo     # summary, table.md and plot of the files there
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_label, grads_of, malloc_settings, max_rel_diff, pyplot, run_with_steady_malloc, timed_step

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.environment import machine_info
from lightning_tbp.memory import measure_peak
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.flops import FLOP_FORMULAS
from lightning_tbp.remat.solve import budget_for_peak
from lightning_tbp.testing.zoo_models import BENCH_ONLY, HELD_OUT, ZOO, ZooCase

#: Batch per architecture: activations, not parameter gradients, dominate the step at these.
BATCHES = {"unet2d": 2, "sdxl_unet": 8, "controlnet": 8, "vae": 2, "dit": 8, "pixart": 8, "sana": 2, "sd3": 8}
BATCHES |= {"flux": 4, "cogvideox": 2, "reference_unet": 4}


def _peak(case: ZooCase) -> int:
    """Exact peak of one step that starts without gradients (freed before the metered region)."""
    case.model.zero_grad(set_to_none=True)
    gc.collect()
    return measure_peak(case.step, case.target.device).peak_bytes


def _flops(case: ZooCase) -> int:
    case.model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        case.step()
    return counter.get_total_flops()


def _grads(case: ZooCase) -> dict[str, torch.Tensor]:
    case.model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    case.step()
    return grads_of(case.model)


def run_architecture(name: str, trials: int, device_name: str = "cpu") -> dict[str, Any]:
    architecture = {**ZOO, **BENCH_ONLY, **HELD_OUT}[name]
    case = architecture.case(batch=BATCHES.get(name, 2), device=device_name)
    model = case.model
    device = case.target.device
    case.step()  # warm-up
    reference = _grads(case)
    rows: dict[str, dict[str, Any]] = {"naive": {"peak_bytes": _peak(case), "flops": _flops(case)}}
    diffusers = getattr(model, "enable_gradient_checkpointing", None)
    if diffusers is None and hasattr(model, "controlnet"):
        diffusers, inner = model.controlnet.enable_gradient_checkpointing, model.controlnet
    else:
        inner = model
    if diffusers is not None and getattr(inner, "_supports_gradient_checkpointing", False):
        diffusers()
        rows["diffusers"] = {
            "peak_bytes": _peak(case),
            "flops": _flops(case),
            "grad_max_rel_diff": max_rel_diff(_grads(case), reference),
        }
        inner.disable_gradient_checkpointing()
    plans: dict[str, dict[str, Any]] = {}
    budgets: dict[str, object] = {"tbp:0.5": 0.5, "tbp:lowest": "lowest"}
    if "diffusers" in rows:
        budgets["tbp:at_diffusers"] = rows["diffusers"]["peak_bytes"]
        budgets["tbp:equal_peak"] = budget_for_peak(rows["diffusers"]["peak_bytes"])
    for mode, budget in budgets.items():
        if budget == "lowest":
            try:
                rematerialize(model, *case.args, memory_budget=1, **case.kwargs).remove()
            except InfeasibleBudgetError as error:
                budget = error.minimum_budget_bytes
        try:
            plan = rematerialize(model, *case.args, memory_budget=budget, **case.kwargs)
        except InfeasibleBudgetError as error:
            rows[mode] = {"error": str(error).split(";")[0]}
            continue
        shape_plan = plan.current
        rows[mode] = {
            "peak_bytes": _peak(case),
            "flops": _flops(case),
            "grad_max_rel_diff": max_rel_diff(_grads(case), reference),
            "budget_bytes": shape_plan.budget_bytes,
            "predicted_peak_bytes": shape_plan.predicted_peak_bytes,
            "predicted_overhead": shape_plan.recompute_time_ratio,
            "predicted_naive_step_seconds": shape_plan.step_ns / 1e9,
            "plan_seconds": shape_plan.profile_seconds + shape_plan.solve_seconds,
            "decisions": {path: option.name.lower() for path, option in shape_plan.options.items()},
        }
        plans[mode] = (dict(shape_plan.options), dict(shape_plan.cache_limits))
        plan.remove()
    _time_in_turns(case, rows, plans, inner, trials, device)
    naive = rows["naive"]
    for row in rows.values():
        if "peak_bytes" in row:
            row["peak_vs_naive"] = row["peak_bytes"] / naive["peak_bytes"]
            row["flops_vs_naive"] = row["flops"] / naive["flops"]
        if "predicted_peak_bytes" in row:
            row["measured_vs_predicted"] = row["peak_bytes"] / row["predicted_peak_bytes"]
            row["measured_vs_budget"] = row["peak_bytes"] / row["budget_bytes"]
            if "diffusers" in rows:
                row["peak_vs_diffusers"] = row["peak_bytes"] / rows["diffusers"]["peak_bytes"]
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "architecture": name,
        "family": architecture.family,
        "batch": BATCHES.get(name, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_gradient_share_of_naive": parameter_bytes / naive["peak_bytes"],
        "rows": rows,
        "machine": machine_info(),
        "malloc": malloc_settings(),
    }


def _time_in_turns(case, rows, plans, inner, trials: int, device: torch.device) -> None:
    """Median step seconds of every mode, timed round-robin so drift hits them all alike."""
    table: dict[str, Any] = {}
    limits: dict[str, int] = {}
    wrappers = InstalledWrappers(case.model, table, limits)
    wrappers.ensure({path for options, _ in plans.values() for path in options})
    modes = [m for m in rows if "peak_bytes" in rows[m]]
    samples: dict[str, list[float]] = {m: [] for m in modes}

    def use(mode: str) -> None:
        options, cache_limits = plans.get(mode, ({}, {}))
        table.clear()
        table.update(options)
        limits.clear()
        limits.update(cache_limits)
        if mode == "diffusers":
            inner.enable_gradient_checkpointing()
        elif "diffusers" in rows:
            inner.disable_gradient_checkpointing()

    try:
        for mode in modes:
            use(mode)
            timed_step(case.model, case.step, device)  # warm-up of each mode
        for _ in range(trials):
            for mode in modes:
                use(mode)
                samples[mode].append(timed_step(case.model, case.step, device))
    finally:
        wrappers.remove()
        if "diffusers" in rows:
            inner.disable_gradient_checkpointing()
    naive = statistics.median(samples["naive"])
    for mode in modes:
        rows[mode]["step_seconds"] = statistics.median(samples[mode])
        rows[mode]["time_vs_naive"] = rows[mode]["step_seconds"] / naive
        if "predicted_overhead" in rows[mode]:
            rows[mode]["measured_overhead"] = rows[mode]["time_vs_naive"] - 1
            rows[mode]["naive_step_predicted_vs_measured"] = rows[mode]["predicted_naive_step_seconds"] / naive


def plot(results: list[dict[str, Any]]) -> Any:
    plt = pyplot()
    figure, (memory, time_axis) = plt.subplots(1, 2, figsize=(13, 4.5))
    modes = ["diffusers", "tbp:equal_peak", "tbp:at_diffusers", "tbp:0.5", "tbp:lowest"]
    width = 0.16
    names = [r["architecture"] for r in results]
    for offset, mode in enumerate(modes):
        xs = [i + (offset - 2) * width for i in range(len(names))]
        peaks = [r["rows"].get(mode, {}).get("peak_vs_naive", 0) for r in results]
        times = [r["rows"].get(mode, {}).get("time_vs_naive", 0) for r in results]
        memory.bar(xs, peaks, width, label=mode)
        time_axis.bar(xs, times, width, label=mode)
    for axis, title in ((memory, "peak / naive peak"), (time_axis, "step time / naive step time")):
        axis.set_xticks(range(len(names)), names, rotation=30, ha="right")
        axis.set_title(title)
        axis.axhline(1.0, color="grey", linewidth=0.8)
    memory.legend(fontsize=8)
    figure.suptitle(f"lightning_tbp on the diffusers zoo ({device_label(results[0]['machine'])})")
    return figure


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The table of docs/benchmarks.md, from the result files (numbers are never typed by hand)."""
    lines = [
        "| architecture | mode | peak MiB | peak / naive | measured / budget | measured / predicted "
        "| FLOPs / naive | time / naive | time / diffusers | overhead predicted / measured "
        "| naive step predicted / measured | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        rows = result["rows"]
        diffusers = rows.get("diffusers", {}).get("step_seconds")
        for index, (mode, row) in enumerate((m, r) for m, r in rows.items() if "peak_bytes" in r):
            planned = "predicted_overhead" in row
            cells = [
                result["architecture"] if index == 0 else "",
                mode,
                f"{row['peak_bytes'] / 2**20:.1f}",
                f"{row['peak_vs_naive']:.3f}",
                f"{row['measured_vs_budget']:.3f}" if planned else "",
                f"{row['measured_vs_predicted']:.3f}" if planned else "",
                f"{row['flops_vs_naive']:.3f}",
                f"{row['time_vs_naive']:.2f}",
                f"{row['step_seconds'] / diffusers:.2f}" if diffusers else "",
                f"{row['predicted_overhead']:.2f} / {row['measured_overhead']:.2f}" if planned else "",
                f"{row['naive_step_predicted_vs_measured']:.2f}" if planned else "",
                f"{row['plan_seconds']:.1f}" if planned else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ZOO | BENCH_ONLY | HELD_OUT), help="one architecture, in this process")
    parser.add_argument("--all", action="store_true", help="every architecture, each in its own process")
    parser.add_argument("--held-out", action="store_true", help="--all and --summarize take zoo_models.HELD_OUT")
    parser.add_argument("--summarize", action="store_true", help="summary and plot from the JSON files in --out")
    parser.add_argument("--trials", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: the models and inputs are moved there")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.arch:
        run_with_steady_malloc()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arch:
        result = run_architecture(args.arch, args.trials, args.device)
        (args.out / f"{args.arch}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps({m: {k: v for k, v in r.items() if k != "decisions"} for m, r in result["rows"].items()}))
        return
    if not (args.all or args.summarize):
        parser.error("give --arch NAME, --all or --summarize")
    results, failed = [], {}
    for name in HELD_OUT if args.held_out else ZOO:
        if args.all:
            command = [sys.executable, __file__, "--arch", name, "--trials", str(args.trials), "--out", str(args.out)]
            command += ["--device", args.device]
            completed = subprocess.run(command, capture_output=True, text=True)
            if completed.returncode != 0:
                failed[name] = completed.stderr.strip().splitlines()[-1] if completed.stderr.strip() else "failed"
                continue
        elif not (args.out / f"{name}.json").is_file():
            failed[name] = "no result file"
            continue
        results.append(json.loads((args.out / f"{name}.json").read_text()))
    (args.out / "summary.json").write_text(json.dumps({"results": results, "failed": failed}, indent=2))
    figure = plot(results)
    figure.tight_layout()
    figure.savefig(args.out / "zoo.png", dpi=120)
    (args.out / "table.md").write_text(markdown_table(results) + "\n")
    print(f"wrote {args.out}/summary.json, table.md and zoo.png; failed: {failed or 'none'}")


if __name__ == "__main__":
    main()
