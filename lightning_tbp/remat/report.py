"""A plan as people read it (a table) and as programs do (a JSON-able dict)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_tbp.remat.budget import MemoryBudget, format_bytes, format_room
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.shape_plan import BlockDecision, ShapePlan, describe_held, describe_loss
from lightning_tbp.remat.step import PLAIN_LOOP
from lightning_tbp.remat.trace import CALL_SEPARATOR, module_path
from lightning_tbp.remat.verify import describe_step_time


def format_report(budget: MemoryBudget, sp: ShapePlan) -> str:
    """Per block the decision, nesting level, bytes and cost; then the budget, prediction and measurement."""
    header = f"{'block':<44} {'decision':<10} {'level':>5} {'kept':>11} {'naive kept':>11} {'GFLOP':>8} {'recomp':>6}"
    lines = [header, "-" * len(header)]
    for b in sp.blocks:
        lines.append(
            f"{b.path:<44} {b.option.name.lower():<10} {b.level:>5} {format_bytes(b.kept_bytes):>11} "
            f"{format_bytes(b.naive_kept_bytes):>11} {b.forward_flops / 1e9:>8.3f} {b.recomputations:>6}"
        )
    budget_line = (
        f"device budget {budget.describe()} less {describe_held(sp.held)} held outside the step leaves "
        f"{format_room(sp.budget_bytes)} for the step; "
        if sp.held is not None and budget.kind == "bytes"
        else f"budget {format_room(sp.budget_bytes)} ({budget.describe()}); "
    )
    if sp.streamed_bytes:
        budget_line += (
            f"with {format_bytes(sp.streamed_bytes)} of frozen weights streamed from the host, "
            f"{sp.level(sp.budget_bytes)} above what stays on the device; "
        )
    step = "" if sp.step == "plain" else f" (the step simulated: {sp.step})"
    loop = "" if sp.loop == PLAIN_LOOP else f"\nthe training loop modelled: {sp.loop.describe()}"
    if sp.alongside.total:
        loop += (
            f"\nbeside the module's step (counted): {format_bytes(sp.alongside.through_step)} through it (the batch, "
            f"the module's inputs), {format_bytes(sp.alongside.until_backward)} until its backward (what "
            "training_step made before the call)"
        )
    lines.append("-" * len(header))
    lines += [_describe_calls(path, calls) for path, calls in call_summaries(sp).items()]
    lines += [
        budget_line + f"predicted peak {sp.level(sp.predicted_peak_bytes)} = "
        f"{sp.ratio(sp.predicted_peak_bytes, sp.naive.peak_bytes):.3f} of naive {sp.level(sp.naive.peak_bytes)} "
        f"(parameter gradients {format_bytes(sp.parameter_grad_bytes)} included), at the {sp.peak_block}{step}{loop}",
        f"the prediction counts {describe_loss(sp.loss_bytes, sp.loss_measured)}"
        if sp.loss_bytes
        else "the loss computed from the module's outputs is not counted until a metered step measures it",
    ]
    lines += [f"taken besides recomputation: {action}" for action in sp.actions]
    offloaded = sum(1 for b in sp.blocks if b.option == Option.OFFLOAD)
    if offloaded or sp.streamed or sp.loop.host_state_bytes:
        uses = [f"{offloaded} block(s) offload their saved activations to host memory"] if offloaded else []
        if sp.loop.host_state_bytes:
            uses.append(
                f"the optimizer's state and step ({format_bytes(sp.loop.host_state_bytes)} with the trainable "
                f"weights' copies; its steps there take about {sp.loop.host_step_ns / 1e6:.1f} ms a step with the "
                "copies, est.)"
            )
        if sp.streamed:
            uses.append(
                f"{len(sp.streamed)} block(s) stream their frozen weights from it "
                f"({format_bytes(sp.streamed_bytes)} off the device, copied in for each block's forward and "
                "recompute; peaks here are above what stays on the device, the streamed weights on the host)"
            )
        lines.append(
            f"host tier: {'; '.join(uses)}; at most {format_bytes(sp.planned.host_peak_bytes)} there at once (host "
            f"budget {format_bytes(int(sp.host_budget_bytes))}); copies are charged in the time estimate"
        )
    if sp.correction > 1:
        lines.append(
            f"re-planned: an earlier plan for this shape measured {sp.correction:.3f}x its prediction, so this one "
            "was solved for the budget divided by that"
        )
    if sp.measured_peak_bytes is not None:
        within = "within" if sp.measured_peak_bytes <= sp.budget_bytes else "OVER"
        against = (
            f"{sp.ratio(sp.measured_peak_bytes, sp.predicted_peak_bytes):.3f} of predicted"
            if sp.measured_at_planned_batch
            else f"at batch {sp.measured_batch_size} of up to {sp.batch_size}"
        )
        loss = "" if sp.measured_loss_bytes is None else f" (its loss {format_bytes(sp.measured_loss_bytes)})"
        lines.append(f"measured peak {sp.level(sp.measured_peak_bytes)} = {against}, {within} the budget{loss}")
    lines.append(
        f"recompute {sp.planned.recompute_flops / 1e9:.3f} GFLOP = {sp.recompute_flop_ratio:.3f} of a training "
        f"step's FLOPs; the plan adds about {sp.recompute_time_ratio:.3f} of the step's time (est.); profiled in "
        f"{sp.profile_seconds:.2f}s, solved in {sp.solve_seconds:.2f}s"
    )
    if sp.measured_step_ns is not None:
        lines.append(describe_step_time(sp))
    return "\n".join(lines)


def call_summaries(sp: ShapePlan) -> dict[str, list[dict[str, Any]]]:
    """Per module the step runs several times (the outermost of such modules: a chain's U-Net,
    not its blocks), per call in order: its decision, how many of its blocks are planned, and
    what it keeps after the forward against its unplanned share. A chain's plan is graded, so
    this is where its shape shows."""
    by_call: dict[str, list[BlockDecision]] = {}
    for block in sp.blocks:
        if block.call:
            by_call.setdefault(block.call, []).append(block)
    summary: dict[str, list[dict[str, Any]]] = {}
    for key, blocks in by_call.items():
        head = next(block for block in blocks if block.path == key)
        summary.setdefault(module_path(key), []).append(
            {
                "call": key,
                "decision": head.option.name.lower(),
                "planned_blocks": sum(block.option != Option.KEEP for block in blocks),
                "blocks": len(blocks),
                "kept_bytes": head.kept_bytes,
                "naive_kept_bytes": head.naive_kept_bytes,
            }
        )
    return summary


def _describe_calls(path: str, calls: list[dict[str, Any]]) -> str:
    def one(call: dict[str, Any]) -> str:
        number = call["call"].partition(CALL_SEPARATOR)[2] or "0"
        return (
            f"#{number} {call['decision']}, {call['planned_blocks']}/{call['blocks']} blocks planned, keeps "
            f"{format_bytes(call['kept_bytes'])} of {format_bytes(call['naive_kept_bytes'])}"
        )

    return f"calls of {path} ({len(calls)} in the step): " + "; ".join(one(call) for call in calls)


def shape_plan_dict(module_name: str, budget: MemoryBudget, sp: ShapePlan) -> dict[str, Any]:
    """JSON-able summary of one signature's plan."""
    return {
        "module": module_name,
        "signature": [[*t[0], str(t[1]), t[2]] for t in sp.signature[1]],
        "budget": {"spec": budget.describe(), "bytes": sp.budget_bytes},
        "held_bytes": None if sp.held is None else dataclasses.asdict(sp.held),
        "step": sp.step,
        "naive_peak_bytes": sp.naive.peak_bytes,
        "predicted_peak_bytes": sp.predicted_peak_bytes,
        "predicted_peak_ratio": sp.predicted_peak_bytes / sp.naive.peak_bytes,
        "predicted_peak_at": sp.peak_block,
        "loop": {
            "gradients_at_forward": sorted(case.value for case in sp.loop.gradients),
            "optimizer_step_bytes": sp.loop.optimizer_step_bytes,
            "step_in_backward": sp.loop.step_in_backward,
            "optimizer_state_on_host_bytes": sp.loop.host_state_bytes,
            "host_step_ns": sp.loop.host_step_ns,
            "actions": list(sp.actions),
            "predicted_peak_bytes_by_case": {case.value: peak for case, peak in sp.planned.case_peaks.items()},
            "alongside_bytes": dataclasses.asdict(sp.alongside),
        },
        "host_peak_bytes": sp.planned.host_peak_bytes,
        "streamed_weight_bytes": sp.streamed_bytes,
        "host_budget_bytes": None if sp.host_budget_bytes == float("inf") else int(sp.host_budget_bytes),
        "measured_peak_bytes": sp.measured_peak_bytes,
        "measured_batch_size": sp.measured_batch_size,
        "correction": sp.correction,
        "loss_bytes": sp.loss_bytes,
        "loss_measured": sp.loss_measured,
        "measured_loss_bytes": sp.measured_loss_bytes,
        "parameter_grad_bytes": sp.parameter_grad_bytes,
        "forward_flops": sp.forward_flops,
        "predicted_recompute_flops": sp.planned.recompute_flops,
        "predicted_recompute_ns": sp.planned.recompute_cost,
        "predicted_step_ns": sp.step_ns,
        "predicted_planned_step_ns": sp.planned_step_ns,
        "measured_step_ns": sp.measured_step_ns,
        "recompute_time_ratio_of_step": sp.recompute_time_ratio,
        "recompute_flop_ratio_of_step": sp.recompute_flop_ratio,
        "profile_seconds": sp.profile_seconds,
        "solve_seconds": sp.solve_seconds,
        "repeated_calls": call_summaries(sp),
        "blocks": [
            {
                "path": b.path,
                "call": b.call,
                "decision": b.option.name.lower(),
                "level": b.level,
                "kept_bytes": b.kept_bytes,
                "naive_kept_bytes": b.naive_kept_bytes,
                "forward_flops": b.forward_flops,
                "recomputations": b.recomputations,
            }
            for b in sp.blocks
        ],
        "edges": [{"from": a, "to": b, "bytes": size} for a, b, size in sp.edges],
    }
