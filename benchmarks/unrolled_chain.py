"""An unrolled chain of K calls of one U-Net, gradients through every call: peak, recompute and
planning time against K.

The chain is ``x <- x - 0.1 * unet(x, t - i)``, i = 0..K-1 (what reward fine-tuning through a
sampling chain backpropagates), with the reference U-Net of the ``small`` profile
(``cases.REFERENCE_UNET``) at 32x32. Per K: the unplanned step's exact peak; the plan at one
fixed byte budget for every K (the lowest budget the largest K meets, or the unplanned peak of a
single call if that is higher) with its predicted and
measured peak, predicted recomputation (FLOPs and time) and measured step time against the
unplanned step (interleaved rounds in this process); the lowest budget the planner names; the
planning time (profile, solve) and the number of planner nodes (one per call of each block).

Then the solver alone, on each K's trace priced by FLOPs (deterministic, so both searches are
compared on equal terms) at the same budget: the chain searched as one sequence (each block's
calls moved together, the last two calls planned again apart: ``repeats.py``) against the
search over every call's blocks apart (``Solver(tie_repeats=False)``), their solve time,
simulations and recomputation.

    python benchmarks/unrolled_chain.py --out docs/benchmarks [--calls 1 2 4 8 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DModel
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import REFERENCE_UNET
from common import device_label, grads_of, max_rel_diff, median_times_in_turns, pyplot, write_result

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.environment import machine_info
from lightning_tbp.memory import measure_peak
from lightning_tbp.remat.pricing import price_by_flops
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import Solver


class Unrolled(nn.Module):
    def __init__(self, unet: nn.Module, calls: int) -> None:
        super().__init__()
        self.unet, self.calls = unet, calls

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for i in range(self.calls):
            x = x - 0.1 * self.unet(x, t - i).sample
        return x


def _chain(calls: int, batch: int) -> tuple[Unrolled, torch.Tensor, torch.Tensor]:
    """The chain of ``calls`` calls, seeded, with its inputs."""
    torch.manual_seed(0)
    model = Unrolled(UNet2DModel(**REFERENCE_UNET, sample_size=32), calls)
    return model, torch.randn(batch, 3, 32, 32), torch.full((batch,), 900)


def _peak(model: nn.Module, step: Any) -> int:
    step()  # warm-up
    model.zero_grad(set_to_none=True)
    gc.collect()
    return measure_peak(step).peak_bytes


def measure(calls: int, batch: int, budget_bytes: int | None, rounds: int, lowest: int | None = None) -> dict[str, Any]:
    """One K's row; ``lowest``: its lowest budget if already known (else searched here)."""
    model, x, t = _chain(calls, batch)

    def step() -> None:
        model(x, t).square().mean().backward()

    naive = _peak(model, step)
    reference = grads_of(model)
    unplanned = copy.deepcopy(model)  # the same weights, never planned: the time reference

    def unplanned_step() -> None:
        unplanned(x, t).square().mean().backward()

    row: dict[str, Any] = {"calls": calls, "naive_peak_bytes": naive, "lowest_budget_bytes": lowest}
    if lowest is None:
        try:
            rematerialize(model, x, t, memory_budget=1)
        except InfeasibleBudgetError as error:
            row["lowest_budget_bytes"] = error.minimum_budget_bytes
    if budget_bytes is None:
        return row
    start = time.perf_counter()
    plan = rematerialize(model, x, t, memory_budget=budget_bytes)
    planning = time.perf_counter() - start
    try:
        shape_plan = plan.current
        assert shape_plan is not None
        measured = _peak(model, step)
        grads = grads_of(model)
        planned_seconds, naive_seconds = median_times_in_turns(
            [(model, step), (unplanned, unplanned_step)], rounds, torch.device("cpu")
        )
    finally:
        plan.remove()
    row.update(
        budget_bytes=shape_plan.budget_bytes,
        predicted_peak_bytes=shape_plan.predicted_peak_bytes,
        measured_peak_bytes=measured,
        planner_nodes=len(shape_plan.blocks),
        planned_blocks=len(shape_plan.options),
        recompute_flop_ratio=shape_plan.recompute_flop_ratio,
        predicted_time_ratio=1 + shape_plan.recompute_time_ratio,
        measured_time_ratio=planned_seconds / naive_seconds,
        planning_seconds=planning,
        profile_seconds=shape_plan.profile_seconds,
        solve_seconds=shape_plan.solve_seconds,
        grad_max_rel_diff=max_rel_diff(grads, reference),
    )
    return row


def compare_searches(calls: int, batch: int, budget_bytes: int) -> dict[str, Any]:
    """The two searches on one K's trace priced by FLOPs, at ``budget_bytes`` for the step."""
    model, x, t = _chain(calls, batch)
    trace = record_trace(model, (x, t), {}, measure=False)
    price_by_flops(trace)
    row: dict[str, Any] = {"calls": calls}
    for name, tie in (("as_one_sequence", True), ("call_by_call", False)):
        solver = Solver(Simulator(trace), tie_repeats=tie)
        start = time.perf_counter()
        try:
            solution = solver.solve(budget_bytes)
        except InfeasibleBudgetError as error:
            row[name] = {"minimum_budget_bytes": error.minimum_budget_bytes, "simulations": solver.simulations}
            continue
        row[name] = {
            "tied": solver.chained,
            "solve_seconds": time.perf_counter() - start,
            "simulations": solution.simulations,
            "recompute_flops": solution.result.recompute_flops,
            "predicted_peak_bytes": solution.result.peak_bytes,
        }
    print(row, flush=True)
    return row


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    rows = result["rows"]
    calls = [r["calls"] for r in rows]
    figure, (memory, cost, search) = plt.subplots(1, 3, figsize=(16, 4))
    mib = 2**20
    memory.plot(calls, [r["naive_peak_bytes"] / mib for r in rows], "o-", label="unplanned")
    memory.plot(calls, [r["measured_peak_bytes"] / mib for r in rows], "s-", label="plan (measured)")
    memory.plot(calls, [r["lowest_budget_bytes"] / mib for r in rows], "^--", label="lowest budget named")
    memory.axhline(rows[0]["budget_bytes"] / mib, color="grey", linestyle=":", label="budget (fixed)")
    memory.set(xlabel="calls of the U-Net (K)", ylabel="peak, MiB", xscale="log", yscale="log")
    memory.set_xticks(calls, [str(c) for c in calls])
    memory.legend()
    cost.plot(calls, [r["measured_time_ratio"] for r in rows], "s-", label="step time / unplanned (measured)")
    cost.plot(calls, [r["predicted_time_ratio"] for r in rows], "o--", label="step time / unplanned (predicted)")
    cost.plot(calls, [1 + r["recompute_flop_ratio"] for r in rows], "^:", label="1 + recomputed FLOPs share")
    cost.set(xlabel="calls of the U-Net (K)", ylabel="ratio", xscale="log")
    cost.set_xticks(calls, [str(c) for c in calls])
    twin = cost.twinx()
    twin.bar(calls, [r["planning_seconds"] for r in rows], width=[c * 0.3 for c in calls], alpha=0.2, color="k")
    twin.set_ylabel("planning seconds (bars)")
    cost.legend(loc="upper left")
    searches = result["searches_priced_by_flops"]
    for name, marker in (("as_one_sequence", "o-"), ("call_by_call", "s--")):
        solved = [r for r in searches if "solve_seconds" in r[name]]
        search.plot([r["calls"] for r in solved], [r[name]["solve_seconds"] for r in solved], marker, label=name)
    search.set(xlabel="calls of the U-Net (K)", ylabel="solve seconds (FLOPs pricing)", xscale="log", yscale="log")
    search.set_xticks(calls, [str(c) for c in calls])
    search.legend()
    figure.suptitle(f"Unrolled U-Net chain at a fixed budget, {device_label(result['machine'])}")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # the smallest budget every K meets (the largest K's lowest), or one unplanned call's peak if higher
    one_call = measure(1, args.batch, None, args.rounds)["naive_peak_bytes"]
    longest = max(args.calls)
    longest_lowest = measure(longest, args.batch, None, args.rounds)["lowest_budget_bytes"]
    budget = max(one_call, longest_lowest)
    rows = []
    for calls in args.calls:  # the longest chain's lowest budget is not searched twice
        row = measure(calls, args.batch, budget, args.rounds, longest_lowest if calls == longest else None)
        print(row, flush=True)
        rows.append(row)
    searches = [compare_searches(calls, args.batch, budget) for calls in args.calls if calls > 1]
    result = {
        "machine": machine_info(),
        "batch": args.batch,
        "budget_bytes": budget,
        "rows": rows,
        "searches_priced_by_flops": searches,
    }
    write_result(result, args.out, "unrolled_chain", plot)


if __name__ == "__main__":
    main()
