"""What planning an SD-1.5-size U-Net costs, against one naive training step of it.

The issue's target: profiling a U-Net of SD 1.5's size (860M parameters) costs less than one
naive training step. The U-Net is built from diffusers' defaults (SD 1.x's configuration, random
weights, no hub); a naive step is its forward and backward on an MSE loss. Naive steps and plans
(``rematerialize``: profile, calibration and solve) alternate in rounds after one warm-up step
and one warm-up plan, and the medians are compared. The peak of a 512x512 step at batch 1 is mostly the parameter
gradients, so a budget of 1.0 (a plan that checkpoints a little) keeps the plan feasible.

    python benchmarks/profile_cost.py --out docs/benchmarks/profile_cost [--latent 64 --batch 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_label, pyplot, timed_step, write_result
from estimate_table import sd15_unet

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.environment import machine_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latent", type=int, default=64, help="latent size (64: 512x512 images)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = sd15_unet().to(device)
    sample = torch.randn(args.batch, 4, args.latent, args.latent, device=device)
    timestep = torch.randint(0, 1000, (args.batch,), device=device)
    text = torch.randn(args.batch, 77, 768, device=device)

    def naive_step() -> float:
        return timed_step(
            model, lambda: model(sample, timestep, encoder_hidden_states=text).sample.square().mean().backward(), device
        )

    naive_step()  # warm-up: the allocator and the first kernels
    budget: float | int = args.budget
    try:  # also the planner's warm-up (option overheads are measured once per process)
        rematerialize(model, sample, timestep, encoder_hidden_states=text, memory_budget=budget).remove()
    except InfeasibleBudgetError as error:  # small latents: the gradients are the peak; plan at the minimum
        budget = error.minimum_budget_bytes
        print(f"--budget {args.budget} is infeasible here; planning at the minimum, {budget} bytes", flush=True)
    steps, plans = [], []
    for round_ in range(args.rounds):
        steps.append(naive_step())
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        plan = rematerialize(model, sample, timestep, encoder_hidden_states=text, memory_budget=budget)
        wall = time.perf_counter() - start  # planning synchronises the device as it measures
        shape_plan = plan.current
        plans.append(
            {
                "wall_seconds": wall,
                "profile_seconds": shape_plan.profile_seconds,
                "solve_seconds": shape_plan.solve_seconds,
                "predicted_peak_bytes": shape_plan.predicted_peak_bytes,
                "budget_bytes": shape_plan.budget_bytes,
            }
        )
        plan.remove()
        print(f"round {round_}: naive step {steps[-1]:.2f} s, plan {wall:.2f} s", flush=True)
    naive = statistics.median(steps)
    planning = statistics.median(p["wall_seconds"] for p in plans)
    result = {
        "experiment": "profile_cost",
        "machine": machine_info(),
        "config": vars(args) | {"out": str(args.out), "planned_budget": budget},
        "parameters": sum(p.numel() for p in model.parameters()),
        "naive_step_seconds": steps,
        "plans": plans,
        "planning_vs_naive_step": planning / naive,
    }
    print(f"planning {planning:.2f} s = {planning / naive:.2f} naive steps of {naive:.2f} s")
    write_result(result, args.out, "profile_cost", _plot)


def _plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(5, 3))
    plans = result["plans"]
    profile = statistics.median(p["profile_seconds"] for p in plans)
    solve = statistics.median(p["solve_seconds"] for p in plans)
    axis.barh(["naive step", "plan"], [statistics.median(result["naive_step_seconds"]), 0], color="tab:gray")
    axis.barh(["plan"], [profile], color="tab:blue", label="profile")
    axis.barh(["plan"], [solve], left=[profile], color="tab:orange", label="solve")
    axis.set_xlabel("seconds (medians)")
    axis.set_title(f"SD-1.5 U-Net, {device_label(result['machine'])}")
    axis.legend()
    return figure


if __name__ == "__main__":
    main()
