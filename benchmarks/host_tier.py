"""The host tier against fixed hand settings, at equal device peak.

Community trainers set activation offloading and checkpointing by hand: checkpoint every block
(diffusers' ``enable_gradient_checkpointing()``), offload every block's activations (torchtune's
and SimpleTuner's activation offloading), or a mix fixed per block. Per zoo architecture (batch
8): the unplanned step, then each hand setting applied to every block of the architecture's
commonest kind (checkpoint all, offload all, and checkpoint the first half with the rest
offloaded), with its exact device peak, host peak and step time; then the planner with
``host_tier="on"`` at each hand setting's measured peak as its byte budget (or, where that is
below the lowest budget the planner names, which keeps a 5% margin for its prediction, at that
lowest budget: ``plan_below_floor``): its device peak, host peak, step time and gradients
against plain autograd. Times are interleaved rounds in this
process; on a CPU the "host" is the same memory (copies are memcpy), so the memory columns carry
over to a GPU and the times do not: the GPU check times it on a device.

    python benchmarks/host_tier.py --out docs/benchmarks [--names unet2d flux sdxl_unet] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_label, grads_of, max_rel_diff, median_times_in_turns, pyplot, write_result

from lightning_tbp import InfeasibleBudgetError, Plan, rematerialize
from lightning_tbp.environment import machine_info
from lightning_tbp.memory import measure_peak
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.host_tier import host_use
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.testing.zoo_models import ZOO, ZooCase


def _seeded(case: ZooCase, model: nn.Module) -> Callable[[], None]:
    def step() -> None:
        torch.manual_seed(0)  # DiT-style models drop labels at random while training
        case.step(model)

    return step


def _peaks(model: nn.Module, step: Callable[[], None]) -> tuple[int, int]:
    """Exact device peak and host-tier peak of one step that starts without gradients."""
    step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    host_use.reset_peak()
    device = measure_peak(step).peak_bytes
    return device, host_use.peak


def hand_settings(case: ZooCase) -> dict[str, dict[str, Option]]:
    """The fixed settings, over every block of the repeated kind whose blocks save the most for
    the backward (a U-Net's resnets, a transformer's blocks), in call order."""
    trace = record_trace(case.model, case.args, case.kwargs)
    saved: Counter[str] = Counter()
    for node in trace.nodes[1:]:
        if node.has_events:
            events = range(node.first_event, node.last_event + 1)
            saved[node.kind] += sum(trace.storage_bytes[s] for e in events for s in trace.event_saves[e])
    repeated = Counter(node.kind for node in trace.nodes[1:] if node.has_events)
    kind = max((k for k in saved if repeated[k] > 1), key=lambda k: saved[k])
    blocks = [node.key for node in trace.nodes[1:] if node.has_events and node.kind == kind]
    half = len(blocks) // 2
    return {
        f"checkpoint every {kind}": dict.fromkeys(blocks, Option.FULL),
        f"offload every {kind}": dict.fromkeys(blocks, Option.OFFLOAD),
        f"checkpoint the first {half}, offload the rest": {
            key: Option.FULL if i < half else Option.OFFLOAD for i, key in enumerate(blocks)
        },
    }


def _plan_at(model: nn.Module, case: ZooCase, budget: int) -> tuple[Plan, str | None]:
    """The planner with the host tier at ``budget``, or at its lowest budget where ``budget`` is
    below it (the planner keeps a 5% margin for its prediction): the plan, and why it is not at
    ``budget`` (None: it is)."""
    try:
        return rematerialize(model, *case.args, memory_budget=budget, host_tier="on", **case.kwargs), None
    except InfeasibleBudgetError as error:
        lowest = error.minimum_budget_bytes
        plan = rematerialize(model, *case.args, memory_budget=lowest, host_tier="on", **case.kwargs)
        return plan, str(error).splitlines()[0]


def measure(name: str, batch: int, rounds: int) -> dict[str, Any]:
    case = ZOO[name].case(batch=batch)
    plain = case.model
    plain_step = _seeded(case, plain)
    naive, _ = _peaks(plain, plain_step)
    reference = grads_of(plain)
    rows: list[dict[str, Any]] = []
    for setting, options in hand_settings(case).items():
        model = copy.deepcopy(plain)
        wrappers = InstalledWrappers(model, options, {})
        wrappers.ensure(options)
        step = _seeded(case, model)
        planned_model = copy.deepcopy(plain)
        try:
            device, host = _peaks(model, step)
            grads = grads_of(model)
            plan, below_floor = _plan_at(planned_model, case, device)
            planned_step = _seeded(case, planned_model)
            try:
                shape_plan = plan.current
                assert shape_plan is not None
                plan_device, plan_host = _peaks(planned_model, planned_step)
                plan_grads = grads_of(planned_model)
                plan_seconds, hand_seconds, naive_seconds = median_times_in_turns(
                    [(planned_model, planned_step), (model, step), (plain, plain_step)], rounds, torch.device("cpu")
                )
            finally:
                plan.remove()
        finally:
            wrappers.remove()
        row = {
            "setting": setting,
            "blocks": len(options),
            "hand_peak_bytes": device,
            "hand_host_peak_bytes": host,
            "hand_time_ratio": hand_seconds / naive_seconds,
            "hand_grad_max_rel_diff": max_rel_diff(grads, reference),
            "plan_below_floor": below_floor,
            "plan_budget_bytes": shape_plan.budget_bytes,
            "plan_predicted_peak_bytes": shape_plan.predicted_peak_bytes,
            "plan_peak_bytes": plan_device,
            "plan_host_peak_bytes": plan_host,
            "plan_predicted_host_peak_bytes": shape_plan.planned.host_peak_bytes,
            "plan_time_ratio": plan_seconds / naive_seconds,
            "plan_predicted_time_ratio": 1 + shape_plan.recompute_time_ratio,
            "plan_decisions": dict(Counter(o.name.lower() for o in shape_plan.options.values())),
            "plan_grad_max_rel_diff": max_rel_diff(plan_grads, reference),
        }
        print(name, row, flush=True)
        rows.append(row)
    return {"name": name, "batch": batch, "naive_peak_bytes": naive, "rows": rows}


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    models = result["models"]
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    mib = 2**20
    for axis, entry in zip(axes[0], models, strict=True):
        labels = [f"{i + 1}" for i in range(len(entry["rows"]))]
        x = range(len(labels))
        axis.bar([i - 0.2 for i in x], [r["hand_peak_bytes"] / mib for r in entry["rows"]], 0.4, label="hand: device")
        axis.bar([i + 0.2 for i in x], [r["plan_peak_bytes"] / mib for r in entry["rows"]], 0.4, label="plan: device")
        axis.plot(x, [r["hand_host_peak_bytes"] / mib for r in entry["rows"]], "o", label="hand: host")
        axis.plot(x, [r["plan_host_peak_bytes"] / mib for r in entry["rows"]], "s", label="plan: host")
        axis.axhline(entry["naive_peak_bytes"] / mib, color="grey", linestyle=":", label="unplanned")
        axis.set_xticks(list(x), labels)
        axis.set(title=entry["name"], xlabel="hand setting (see the JSON)", ylabel="MiB")
    axes[0][0].legend()
    figure.suptitle(f"Host tier against hand settings at equal device peak, {device_label(result['machine'])}")
    return figure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--names", nargs="+", default=["unet2d", "flux", "sdxl_unet"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    models = [measure(name, args.batch, args.rounds) for name in args.names]
    write_result({"machine": machine_info(), "models": models}, args.out, "host_tier", plot)


if __name__ == "__main__":
    main()
