"""An estimate as a readable table and as JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning_tbp.estimate.step import StepEstimate
from lightning_tbp.estimate.verdict import slowdown, verdict
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.remat.step import LoopModel, PriorGradients


def estimate_dict(estimate: StepEstimate) -> dict[str, Any]:
    """JSON-ready: ``naive_peak_bytes``, ``fits`` (None without a device size), the plan's
    ``predicted_peak_bytes`` and ``budget_bytes``, and every part."""
    fit = estimate.fit
    answer = verdict(estimate)
    return {
        "naive_peak_bytes": estimate.naive_peak_bytes,
        "fits": answer.fits,  # as the strategy would train it (``verdict.py``), as the console says
        "verdict": answer.how,
        "assumed": estimate.assumed,
        "fits_without_plan": None if fit is None else fit.fits_without_plan,
        "device_memory_bytes": None if fit is None else fit.device_memory_bytes,
        "plan": None if fit is None else asdict(fit),
        "minimum_device_bytes": estimate.minimum_device_bytes,
        "minimum_plan_recompute_time_ratio": estimate.minimum_plan_recompute_time_ratio,
        "parts": {
            "parameter_bytes": estimate.parameter_bytes,
            "gradient_bytes": estimate.gradient_bytes,
            "optimizer_state_bytes": estimate.optimizer_state_bytes,
            "activation_bytes": estimate.activation_bytes,
            "batch_bytes": estimate.batch_bytes,
            "library_workspace_bytes": estimate.library_workspace_bytes,
            "kernel_workspace_bytes": estimate.kernel_workspace_bytes,
            "communication_bytes": estimate.communication_bytes,
            "forward_backward_peak_bytes": estimate.forward_backward_peak_bytes,
            "optimizer_step_peak_bytes": estimate.optimizer_step_peak_bytes,
            "target_naive_peak_bytes": estimate.target_naive_peak_bytes,
        },
        "unmeasured_workspace_ops": estimate.unmeasured_workspace_ops,
        "trainable_parameters": estimate.trainable_parameters,
        "target": estimate.target,
        "step_model": estimate.step_model,
        "gradients_at_forward": sorted(case.value for case in estimate.gradients_at_forward),
        "device": estimate.device,
        "layout": estimate.layout,
        "world_size": estimate.world_size,
        "estimate_seconds": estimate.estimate_seconds,
        "step_in_backward": estimate.step_in_backward,
        "with_step_in_backward": (
            None if estimate.with_step_in_backward is None else estimate_dict(estimate.with_step_in_backward)
        ),
        "host_tier": estimate.host_tier,
        "minimum_plan_host_bytes": estimate.minimum_plan_host_bytes,
        "host_state_bytes": estimate.host_state_bytes,
        "host_master_dtype": estimate.host_master_dtype,
        "host_parameters": None if estimate.host_parameters is None else list(estimate.host_parameters),
        "host_step_seconds": estimate.host_step_seconds,
        "step_seconds": estimate.step_seconds,
        "host_slowdown": estimate.host_slowdown,
        "with_host_tier": None if estimate.with_host_tier is None else estimate_dict(estimate.with_host_tier),
    }


def format_estimate(estimate: StepEstimate) -> str:
    per = f" per rank ({estimate.layout}, {estimate.world_size} ranks)" if estimate.layout != "single" else ""
    rows = [
        *((f"parameters and buffers: {name}", size) for name, size in estimate.parameter_bytes.items() if size),
        (f"gradients ({estimate.trainable_parameters:,} trainable parameters)", estimate.gradient_bytes),
        ("optimizer state", estimate.optimizer_state_bytes),
        ("activations at the step's peak", estimate.activation_bytes),
        ("kernel workspaces at the peak (measured on this CPU)", estimate.kernel_workspace_bytes),
        ("batch", estimate.batch_bytes),
        ("library workspace", estimate.library_workspace_bytes),
        ("communication (DDP buckets / FSDP2 gathered units)", estimate.communication_bytes),
    ]
    width = max(len(label) for label, _ in rows)
    step = "" if estimate.step_model == "plain" else f", {estimate.step_model} (the DP engine's backward)"
    lines = [f"tbp estimate: one training step on {estimate.device}{per}{step}"]
    if estimate.gradients_at_forward != {PriorGradients.RELEASED} or estimate.step_in_backward:
        loop = LoopModel(estimate.gradients_at_forward, step_in_backward=estimate.step_in_backward)
        lines.append(f"  the loop modelled: {loop.describe()}")
    lines += [f"  {label:<{width}}  {format_bytes(size):>12}" for label, size in rows if size]
    if estimate.host_state_bytes:
        lines.append(_host_state_line(estimate))
    lines.append(f"  {'naive peak (device total)':<{width}}  {format_bytes(estimate.naive_peak_bytes):>12}")
    if estimate.minimum_device_bytes is not None:
        lines.append(
            f"  {'smallest device with a plan':<{width}}  {format_bytes(estimate.minimum_device_bytes):>12}"
            f"  (lowest plan recomputes ~{estimate.minimum_plan_recompute_time_ratio:.0%} of the step at most)"
        )
    if estimate.fit is not None:
        lines.append(_fit_line(estimate, estimate.budget_arguments))
    fused = estimate.with_step_in_backward
    if fused is not None:
        lines.append(
            "with the optimizer stepping each parameter inside the backward (the strategy takes it by itself "
            f"here, optimizer_in_backward='auto'): naive peak {format_bytes(fused.naive_peak_bytes)}"
            + (
                ""
                if fused.minimum_device_bytes is None
                else f", smallest device with a plan {format_bytes(fused.minimum_device_bytes)}"
            )
        )
        if fused.fit is not None:
            lines.append("  " + _fit_line(fused, estimate.budget_arguments))
    hosted = estimate.with_host_tier
    if hosted is not None:
        inside = ", the optimizer inside the backward" if hosted.step_in_backward else ""
        if hosted.host_state_bytes:
            inside = ", the optimizer's state and step there" + (" for part of it" if hosted.host_parameters else "")
        lines.append(
            "with the host tier (saved activations offloaded to host memory where the plan chooses"
            f"{inside}; host_tier='auto' takes it by itself): naive peak {format_bytes(hosted.naive_peak_bytes)}"
            + (
                ""
                if hosted.minimum_device_bytes is None
                else f", smallest device with a plan {format_bytes(hosted.minimum_device_bytes)} "
                f"(its plan keeps {format_bytes(hosted.minimum_plan_host_bytes)} on the host)"
            )
        )
        if hosted.host_state_bytes:
            lines.append(_host_state_line(hosted))
        if hosted.fit is not None:
            lines.append("  " + _fit_line(hosted, estimate.budget_arguments))
    if estimate.unmeasured_workspace_ops:
        lines.append(
            f"  ({estimate.unmeasured_workspace_ops} ops too large to run on this machine: their kernels' temporaries "
            "are not counted)"
        )
    if estimate.fit is not None:
        lines.append(f"verdict: {verdict(estimate).how}")
    if estimate.assumed:
        lines.append("assumed (the config's strategy): " + ", ".join(f"{k}={v}" for k, v in estimate.assumed.items()))
    lines.append(f"(estimated in {estimate.estimate_seconds:.1f} s; what the figures model: docs/estimate.md)")
    return "\n".join(lines)


def _host_state_line(estimate: StepEstimate) -> str:
    slowdown = estimate.host_slowdown
    limit = estimate.max_slowdown
    refused = (
        f"; above max_slowdown={limit:g}, which refuses it "
        "(StallingPlanError): pass a larger max_slowdown, or step on a host CPU that is faster than this one"
        if limit is not None and slowdown > limit
        else ""
    )
    copies = (
        f"trainable weights' {estimate.host_master_dtype} masters"
        if estimate.host_master_dtype
        else "trainable weights' copies"
    )
    part = ""
    if estimate.host_parameters is not None:
        hosted, trainable = estimate.host_parameters
        part = f" for {hosted} of {trainable} parameters (those with the most state; the rest step on the device)"
    return (
        f"  the optimizer's state and step on the host{part}: {format_bytes(estimate.host_state_bytes)} there with the "
        f"{copies}; ~{estimate.host_step_seconds:.2f} s a step for the copies (at the modelled "
        f"link rate) and the step (at this machine's CPU rate), against ~{estimate.step_seconds:.2f} s for the "
        f"unplanned step on the device: {slowdown:.1f}x{refused}"
    )


def _fit_line(estimate: StepEstimate, budget_arguments: str) -> str:
    fit = estimate.fit
    assert fit is not None
    size = format_bytes(fit.device_memory_bytes)
    if fit.fits_without_plan:
        return f"fits in {size} without a plan"
    limit = estimate.max_slowdown
    if fit.fits_with_plan and limit is not None and slowdown(estimate) > limit:
        return (
            f"a plan reaches {format_bytes(fit.predicted_peak_bytes or 0)} in {size}, but its step is predicted "
            f"{slowdown(estimate):.1f}x slower than the unplanned one, above max_slowdown={limit:g}: refused"
        )
    if fit.fits_with_plan:
        return (
            f"fits in {size} with a plan: predicted peak {format_bytes(fit.predicted_peak_bytes or 0)}, "
            f"{fit.planned_blocks} blocks planned, ~{fit.recompute_time_ratio:.0%} extra step time "
            f"({fit.recompute_flop_ratio:.0%} extra FLOPs); train with {budget_arguments}{fit.device_memory_bytes}"
            + (f"; {format_bytes(fit.host_peak_bytes)} on the host tier" if fit.host_peak_bytes else "")
        )
    return f"does not fit in {size}: {fit.reason}"
