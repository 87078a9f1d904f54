"""DP modes under a rematerialization plan, timed in turns in one process.

For each DP mode (and non-private training) the same model runs without a plan and with a plan
at ``--budget`` of that mode's naive step, every run on its own copy of the model (same weights)
with its own engine. Per run: the exact allocator peak of one step that starts without
gradients, the plan's budget and predicted peak, the largest gradient difference from the same
mode without a plan (noise 0, so the clipped sums must agree), and the median step time over
``--trials`` rounds in which every run takes one step in turn (so drift on a shared machine hits
all runs alike):

    python benchmarks/dp_plan_time.py --out docs/benchmarks/dp_plan_time                # dit_dp_bench.py's DiT
    python benchmarks/dp_plan_time.py --arch unet2d --out docs/benchmarks/dp_plan_time  # a zoo architecture
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import grads_of, median_times_in_turns
from dit_dp_bench import PROFILES, build_dit

from lightning_tbp.environment import machine_info
from lightning_tbp.memory import measure_peak
from lightning_tbp.privacy import attach
from lightning_tbp.remat import Plan
from lightning_tbp.testing.zoo_models import BENCH_ONLY, ZOO, sample

MODES = ("vanilla", "ghost", "bookkeeping")
Forward = Callable[[torch.nn.Module], torch.Tensor]


def make_run(model: torch.nn.Module, forward: Forward, target: torch.Tensor, mode: str, budget: float | None) -> dict:
    """One (mode, plan) run on its own copy of ``model``: its step, engine and plan."""
    model = copy.deepcopy(model)
    engine = None if mode == "vanilla" else attach(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    passes = 1 if engine is None else engine.backward_passes
    plan = None if budget is None else Plan(model, budget, backward_passes=passes)

    def step() -> None:
        per_sample = (forward(model).float() - target).square().flatten(1).mean(dim=1)
        if engine is None:
            per_sample.sum().backward()
        else:
            engine.backward(per_sample)

    return {"mode": mode, "budget": budget, "model": model, "engine": engine, "plan": plan, "step": step}


def workload(arch: str, profile: str, batch: int) -> tuple[torch.nn.Module, Forward, torch.Tensor, dict[str, Any]]:
    """The model (eval mode: a planned and an unplanned step must agree), its call and target."""
    torch.manual_seed(0)
    if arch == "dit":
        config = {**PROFILES[profile], "profile": profile, "batch": batch}
        model = build_dit(config).eval()
        size, channels = config["image_size"], config["channels"]
        x = torch.randn(batch, channels, size, size)
        t, labels = torch.randint(0, 1000, (batch,)), torch.randint(0, config["classes"], (batch,))
        return model, lambda m: m(x, timestep=t, class_labels=labels).sample, torch.randn_like(x), config
    case = {**ZOO, **BENCH_ONLY}[arch].case(batch=batch)
    config = {"arch": arch, "batch": batch}
    return case.model.eval(), lambda m: sample(m(*case.args, **case.kwargs)), case.target, config


def measure(run: dict[str, Any], warmup: int) -> None:
    model, step = run["model"], run["step"]
    for _ in range(warmup):  # the plan is made in the first step
        model.zero_grad(set_to_none=True)
        step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    run["peak_bytes"] = measure_peak(step).peak_bytes
    run["grads"] = grads_of(model)


def _largest_difference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest entry-wise difference over the largest reference entry, over all parameters
    (attention's key bias has a zero true gradient, so a per-parameter ratio would be noise over noise)."""
    scale = max(float(g.abs().max()) for g in reference.values())
    return max(float((grads[name] - g).abs().max()) for name, g in reference.items()) / scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="dit", help="dit (dit_dp_bench.py's, see --profile) or a zoo architecture")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of each mode's naive step")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("outputs/dp_plan_time"))
    args = parser.parse_args(argv)

    model, forward, target, config = workload(args.arch, args.profile, args.batch)
    runs = [make_run(model, forward, target, mode, budget) for mode in MODES for budget in (None, args.budget)]
    for run in runs:
        measure(run, args.warmup)
    seconds = median_times_in_turns([(run["model"], run["step"]) for run in runs], args.trials, torch.device("cpu"))

    unplanned = {run["mode"]: run for run in runs if run["plan"] is None}
    rows = []
    for run, spent in zip(runs, seconds, strict=True):
        base = unplanned[run["mode"]]
        row = {
            "mode": run["mode"],
            "plan_budget": run["budget"],
            "peak_mb": run["peak_bytes"] / 2**20,
            "peak_vs_unplanned": run["peak_bytes"] / base["peak_bytes"],
            "median_step_ms": spent * 1e3,
            "grad_max_rel_diff": _largest_difference(run["grads"], base["grads"]),
        }
        plan = run["plan"]
        if plan is not None:
            current = plan.current
            row |= {
                "budget_mb": current.budget_bytes / 2**20,
                "predicted_peak_mb": current.predicted_peak_bytes / 2**20,
                "measured_over_budget": run["peak_bytes"] / current.budget_bytes,
                "measured_over_predicted": run["peak_bytes"] / current.predicted_peak_bytes,
                "predicted_time_overhead": current.recompute_time_ratio,
                "measured_time_overhead": spent / (seconds[runs.index(base)]) - 1,
                "decisions": {path: option.name.lower() for path, option in current.options.items()},
            }
        rows.append(row)
    for row in rows:
        row["time_vs_vanilla"] = row["median_step_ms"] / rows[0]["median_step_ms"]
    settings = {**config, "budget": args.budget, "trials": args.trials}
    result = {"config": settings, "rows": rows, "machine": machine_info()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dp_plan_time_{args.arch}.json").write_text(json.dumps(result, indent=2))
    for row in rows:
        plan = "no plan" if row["plan_budget"] is None else f"plan {row['plan_budget']}"
        extra = f", {row['measured_over_budget']:.3f} of budget" if "measured_over_budget" in row else ""
        print(
            f"{row['mode']:12s} {plan:9s} peak {row['peak_mb']:6.2f} MiB{extra}, "
            f"median {row['median_step_ms']:6.1f} ms ({row['time_vs_vanilla']:.2f}x vanilla), "
            f"grad diff {row['grad_max_rel_diff']:.1e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
