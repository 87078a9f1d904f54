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

With ``--lora RANK`` the models are frozen with LoRA adapters of that rank (their base weights can
stream), and the hand settings are kohya's "block swap" with gradient checkpointing: checkpoint
every block, stream every block's weights, stream the first half and checkpoint the rest
(``--blocks_to_swap`` at half). Peaks then count against the parameters as loaded (a plan that
streams can peak below zero); ``parameter_bytes`` turns them into device totals.

    python benchmarks/host_tier.py --out docs/benchmarks [--names unet2d flux sdxl_unet] [--rounds 3]
    python benchmarks/host_tier.py --out docs/benchmarks --lora 4 --names flux sd3 --batch 2
    python benchmarks/host_tier.py --out DIR --device cuda --names flux   # the GPU check's part
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

from lightning_tbp import InfeasibleBudgetError, Plan
from lightning_tbp.diffusion.lora import add_lora, lora_options
from lightning_tbp.environment import machine_info
from lightning_tbp.memory import measure_peak
from lightning_tbp.memory.held import HeldMemory
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.host_tier import host_use
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.shape_plan import streamed_names
from lightning_tbp.remat.trace_facts import TraceFacts
from lightning_tbp.testing.zoo_models import ZOO, ZooCase


def _seeded(case: ZooCase, model: nn.Module) -> Callable[[], None]:
    def step() -> None:
        torch.manual_seed(0)  # DiT-style models drop labels at random while training
        case.step(model)

    return step


def _peaks(model: nn.Module, step: Callable[[], None], device: torch.device, streamed: int = 0) -> tuple[int, int]:
    """Exact device peak (against the parameters as loaded: ``streamed`` bytes of weights on the
    host come off) and host-tier peak (streamed weights included) of one step that starts
    without gradients."""
    step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    host_use.reset_peak()
    others = host_use.live - streamed  # what other models' plans keep on the host
    peak = measure_peak(step, device).peak_bytes - streamed
    return peak, host_use.peak - others


def hand_settings(case: ZooCase, stream: bool) -> tuple[dict[str, dict[str, Option]], dict[str, tuple[str, ...]]]:
    """The fixed settings, over every block of the repeated kind whose blocks save the most for
    the backward (a U-Net's resnets, a transformer's blocks), in call order; with ``stream``,
    block swap's (see the module doc). Returns them and each block's streamable weights."""
    trace = record_trace(case.model, case.args, case.kwargs)
    facts = TraceFacts(trace)
    weights = {node.key: streamed_names(trace, facts.block_weights[node.index], node.path) for node in trace.nodes[1:]}
    saved: Counter[str] = Counter()
    for node in trace.nodes[1:]:
        if node.has_events:
            events = range(node.first_event, node.last_event + 1)
            saved[node.kind] += sum(trace.storage_bytes[s] for e in events for s in trace.event_saves[e])
    repeated = Counter(node.kind for node in trace.nodes[1:] if node.has_events)
    kind = max((k for k in saved if repeated[k] > 1), key=lambda k: saved[k])
    blocks = [node.key for node in trace.nodes[1:] if node.has_events and node.kind == kind]
    if stream:  # block swap's unit: the model's own repeated blocks (a Flux's double and single blocks)
        kinds = {n.kind for n in trace.nodes[1:] if n.parent == 0 and repeated[n.kind] > 1 and weights[n.key]}
        kind = " or ".join(sorted(kinds))
        blocks = [n.key for n in trace.nodes[1:] if n.parent == 0 and n.kind in kinds]
    if stream:  # kohya's --blocks_to_swap, with gradient checkpointing on every block
        return _settings(kind, blocks, Option.STREAM, first_half=Option.STREAM), weights
    return _settings(kind, blocks, Option.OFFLOAD, first_half=Option.FULL), weights


_VERB = {Option.FULL: "checkpoint", Option.OFFLOAD: "offload", Option.STREAM: "stream"}


def _settings(kind: str, blocks: list[str], other: Option, first_half: Option) -> dict[str, dict[str, Option]]:
    """Every block checkpointed, every block ``other``, and the first half ``first_half`` with
    the rest the other of the two."""
    half = len(blocks) // 2
    rest = other if first_half == Option.FULL else Option.FULL
    return {
        f"checkpoint every {kind}": dict.fromkeys(blocks, Option.FULL),
        f"{_VERB[other]} every {kind}": dict.fromkeys(blocks, other),
        f"{_VERB[first_half]} the first {half}, {_VERB[rest]} the rest": {
            key: first_half if i < half else rest for i, key in enumerate(blocks)
        },
    }


def _plan_at(model: nn.Module, case: ZooCase, budget: int) -> tuple[Plan, str | None]:
    """The planner with the host tier at ``budget`` for the step (against the parameters as
    loaded, so below zero where weights must stream), or at its lowest budget where ``budget``
    is below it (the planner keeps a 5% margin for its prediction): the plan, and why it is not
    at ``budget`` (None: it is). The budget is given as a device's total with the parameters
    held, as the strategies do: ``rematerialize`` takes no budget below zero."""
    parameters = _parameter_bytes(model)

    def planned(step_budget: int) -> Plan:
        plan = Plan(model, parameters + step_budget, host_tier="on", held=lambda: HeldMemory(parameters=parameters))
        try:
            with torch.enable_grad():
                plan.plan_for(case.args, case.kwargs)
        except BaseException:
            plan.remove()
            raise
        return plan

    try:
        return planned(budget), None
    except InfeasibleBudgetError as error:
        return planned(error.minimum_budget_bytes), str(error).splitlines()[0]


def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(name: str, batch: int, rounds: int, lora: int = 0, device: str = "cpu") -> dict[str, Any]:
    on = torch.device(device)
    case = ZOO[name].case(batch=batch, device=device)
    if lora:
        add_lora(case.model, lora_options(lora))
    plain = case.model
    plain_step = _seeded(case, plain)
    naive, _ = _peaks(plain, plain_step, on)
    reference = grads_of(plain)
    rows: list[dict[str, Any]] = []
    settings, weights = hand_settings(case, stream=lora > 0)
    for setting, options in settings.items():
        model = copy.deepcopy(plain)
        wrappers = InstalledWrappers(
            model, options, {}, {k: weights[k] for k, o in options.items() if o == Option.STREAM}
        )
        wrappers.ensure(options)
        wrappers.place_weights()
        step = _seeded(case, model)
        planned_model = copy.deepcopy(plain)
        try:
            hand_peak, host = _peaks(model, step, on, wrappers.weights.moved_bytes)
            grads = grads_of(model)
            plan, below_floor = _plan_at(planned_model, case, hand_peak)
            planned_step = _seeded(case, planned_model)
            try:
                shape_plan = plan.current
                assert shape_plan is not None
                plan_device, plan_host = _peaks(planned_model, planned_step, on, plan.streamed_bytes)
                plan_grads = grads_of(planned_model)
                plan_seconds, hand_seconds, naive_seconds = median_times_in_turns(
                    [(planned_model, planned_step), (model, step), (plain, plain_step)], rounds, on
                )
            finally:
                plan.remove()
        finally:
            wrappers.remove()
        row = {
            "setting": setting,
            "blocks": len(options),
            "hand_peak_bytes": hand_peak,
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
    return {
        "name": name,
        "batch": batch,
        "lora_rank": lora,
        "parameter_bytes": _parameter_bytes(plain),
        "naive_peak_bytes": naive,
        "rows": rows,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    models = result["models"]
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    mib = 2**20
    for axis, entry in zip(axes[0], models, strict=True):
        labels = [f"{i + 1}" for i in range(len(entry["rows"]))]
        x = range(len(labels))
        # device totals where weights stream (peaks count against the parameters as loaded)
        base = entry["parameter_bytes"] if entry["lora_rank"] else 0
        rows = entry["rows"]
        axis.bar([i - 0.2 for i in x], [(base + r["hand_peak_bytes"]) / mib for r in rows], 0.4, label="hand: device")
        axis.bar([i + 0.2 for i in x], [(base + r["plan_peak_bytes"]) / mib for r in rows], 0.4, label="plan: device")
        axis.plot(x, [r["hand_host_peak_bytes"] / mib for r in rows], "o", label="hand: host")
        axis.plot(x, [r["plan_host_peak_bytes"] / mib for r in rows], "s", label="plan: host")
        axis.axhline((base + entry["naive_peak_bytes"]) / mib, color="grey", linestyle=":", label="unplanned")
        axis.set_xticks(list(x), labels)
        ylabel = "MiB on the device (parameters included)" if base else "MiB"
        axis.set(title=entry["name"], xlabel="hand setting (see the JSON)", ylabel=ylabel)
    axes[0][0].legend()
    figure.suptitle(f"Host tier against hand settings at equal device peak, {device_label(result['machine'])}")
    return figure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--names", nargs="+", default=["unet2d", "flux", "sdxl_unet"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on a frozen base (0: full fine-tune)")
    parser.add_argument("--device", default="cpu", help="cuda: the host tier is pinned memory, copies timed")
    args = parser.parse_args(argv)
    models = [measure(name, args.batch, args.rounds, args.lora, args.device) for name in args.names]
    stem = f"host_tier_lora{args.lora}" if args.lora else "host_tier"
    write_result({"machine": machine_info(), "models": models}, args.out, stem, plot)


if __name__ == "__main__":
    main()
