"""The planner's memory promise under DP, on every zoo architecture the engine accepts.

For each architecture of ``zoo_models.py`` and each DP mode asked for, an engine is attached
(noise 0, clipping at 1.0) and ``rematerialize`` plans the DP step at half its naive peak and at
the lowest budget it names. Per plan: the exact allocator peak of the DP step (forward, per-sample
MSE, ``engine.backward``), the budget, the prediction, and how far the clipped gradients are from
the unplanned DP step's (``largest_difference``), and the same step's peak without DP. Memory
and gradients only: the step times of DP plans are ``dp_plan_time.py``'s.

    python benchmarks/dp_zoo.py --out docs/benchmarks/dp_zoo                 # all, ghost and bookkeeping
    python benchmarks/dp_zoo.py --arch sd3 --modes bookkeeping --out /tmp/dp  # one
    python benchmarks/dp_zoo.py --arch video_unet --out docs/benchmarks/dp_video_unet  # folded rows
"""

from __future__ import annotations

import argparse
import gc
import warnings
from pathlib import Path
from typing import Any

import torch
from common import device_label, grads_of, measure_step, pyplot, write_result

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.environment import machine_info
from lightning_tbp.privacy import MODES, CoverageError, PerSampleLossError, attach
from lightning_tbp.testing.zoo_models import BENCH_ONLY, HELD_OUT, ZOO, sample

BATCH = 4


def _measured(model: torch.nn.Module, step: Any) -> tuple[int, dict[str, torch.Tensor]]:
    """Exact peak of a step (after a warm-up, without gradients at its start), and its gradients."""
    gc.collect()
    peak = measure_step(model, step, trials=1, count_flops=False).peak_bytes
    return peak, grads_of(model)


def largest_difference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest difference of any gradient entry, over the largest entry of the reference. Not per
    parameter: attention key biases have a zero gradient (softmax ignores a shift shared by a
    query's keys), so theirs are rounding noise of 1e-12 whose relative difference means nothing."""
    if grads.keys() != reference.keys():
        return float("inf")
    scale = max(float(ref.abs().max()) for ref in reference.values())
    return max(float((grads[k] - ref).abs().max()) for k, ref in reference.items()) / scale


def run(name: str, mode: str) -> dict[str, Any]:
    case = {**ZOO, **BENCH_ONLY, **HELD_OUT}[name].case(batch=BATCH)
    model = case.model.eval()  # no dropout: the per-sample loss must not depend on the batch

    def plain_step() -> None:
        (sample(model(*case.args, **case.kwargs)).float() - case.target).square().mean().backward()

    plain, _ = _measured(model, plain_step)
    engine = attach(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)

    def step() -> None:
        engine.probe_next_step()  # every measured step probes, as the step a plan is made for does
        out = sample(model(*case.args, **case.kwargs))
        engine.backward((out.float() - case.target).square().flatten(1).mean(dim=1))

    try:
        try:
            naive, reference = _measured(model, step)
        except (CoverageError, PerSampleLossError) as error:  # refused before a gradient is written
            return {"architecture": name, "mode": mode, "refused": str(error).splitlines()[0]}
        try:
            rematerialize(model, *case.args, memory_budget=1, **case.kwargs)
        except InfeasibleBudgetError as error:
            lowest = error.minimum_budget_bytes
        rows = {}
        for label, budget in (("0.5", 0.5), ("lowest", lowest)):
            try:
                plan = rematerialize(model, *case.args, memory_budget=budget, **case.kwargs)
            except InfeasibleBudgetError as error:
                rows[label] = {"infeasible": True, "minimum_budget_bytes": error.minimum_budget_bytes}
                continue
            try:
                planned = plan.current
                peak, grads = _measured(model, step)
            finally:
                plan.remove()
            rows[label] = {
                "budget_bytes": planned.budget_bytes,
                "predicted_peak_bytes": planned.predicted_peak_bytes,
                "peak_bytes": peak,
                "measured_vs_budget": peak / planned.budget_bytes,
                "measured_vs_predicted": peak / planned.predicted_peak_bytes,
                "planned_blocks": sum(1 for option in planned.options.values() if option.name != "KEEP"),
                "grad_largest_difference": largest_difference(grads, reference),
            }
        return {
            "architecture": name,
            "mode": mode,
            "batch": BATCH,
            "plain_peak_bytes": plain,  # the same step without DP
            "naive_peak_bytes": naive,
            "rows": rows,
        }
    finally:
        engine.detach()


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    runs = [r for r in result["runs"] if "rows" in r]
    labels = [f"{r['architecture']}\n{r['mode']}" for r in runs]
    for axis, key, title in (
        (axes[0], "measured_vs_budget", "measured / budget (must be <= 1)"),
        (axes[1], "measured_vs_predicted", "measured / predicted"),
    ):
        for offset, budget in ((-0.2, "0.5"), (0.2, "lowest")):
            values = [r["rows"].get(budget, {}).get(key, float("nan")) for r in runs]
            axis.bar([i + offset for i in range(len(runs))], values, width=0.4, label=f"budget {budget}")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(runs)), labels, rotation=90, fontsize=7)
        axis.set_ylim(0.8, 1.1)
        axis.set_title(title)
        axis.legend()
    figure.suptitle(f"DP plans on the diffusers zoo ({device_label(result['machine'])})")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ZOO | BENCH_ONLY | HELD_OUT), nargs="*", default=sorted(ZOO))
    parser.add_argument("--modes", choices=MODES, nargs="*", default=["ghost", "bookkeeping"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    runs = []
    for name in args.arch:
        for mode in args.modes:
            runs.append(run(name, mode))
            for budget, row in runs[-1].get("rows", {}).items():
                print(name, mode, budget, {k: round(v, 4) for k, v in row.items() if k.startswith("measured")})
    write_result({"machine": machine_info(), "runs": runs}, args.out, "dp_zoo", plot)


if __name__ == "__main__":
    main()
