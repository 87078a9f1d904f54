"""One answer to "will it fit": what the strategy would do with the config on a device of that size.

An estimate holds several steps: the config's own, and where that does not fit the same step
with what the strategy would take by itself (the optimizer inside the backward, the host tier).
The verdict walks them in the strategy's order and takes the first that fits and that the
strategy would accept: a step predicted more than ``max_slowdown`` times slower than the
unplanned one is refused there (``StallingPlanError``), so it is no fit here either. The console
table and the JSON both print this verdict, never a part's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_tbp.estimate.step import StepEstimate
from lightning_tbp.remat.budget import format_bytes


@dataclass(frozen=True)
class Verdict:
    fits: bool | None
    """None without a device size to fit."""
    how: str
    """How it fits (which of the strategy's means it takes), or why it does not."""


def slowdown(estimate: StepEstimate) -> float:
    """The step with the plan that fits (its recomputation, the optimizer's step on the host) over
    the unplanned step, as the strategies' ``max_slowdown`` checks it."""
    return estimate.total_step_seconds / max(estimate.step_seconds, 1e-9)


def verdict(estimate: StepEstimate) -> Verdict:
    """Whether the config's step fits the estimate's device size as the strategy would train it."""
    fit = estimate.fit
    if fit is None:
        return Verdict(None, "no device size to fit (--device-memory)")
    size = format_bytes(fit.device_memory_bytes)
    steps = [
        ("", estimate),
        (" with the optimizer stepping inside the backward", estimate.with_step_in_backward),
        (" with the host tier", estimate.with_host_tier),
    ]
    refused: list[str] = []
    for means, step in steps:
        if step is None or step.fit is None or not (step.fit.fits_without_plan or step.fit.fits_with_plan):
            continue
        limit = estimate.max_slowdown
        if limit is not None and step.fit.fits_with_plan and slowdown(step) > limit:
            refused.append(
                f"it would fit{means}, but that step is predicted {slowdown(step):.1f}x slower than the unplanned "
                f"one, above max_slowdown={limit:g}, which refuses it"
            )
            continue
        planned = "without a plan" if step.fit.fits_without_plan else "with a plan"
        return Verdict(True, f"fits in {size} {planned}{means}")
    why = "; ".join(refused) if refused else (fit.reason or "no plan reaches it")
    return Verdict(False, f"does not fit in {size}: {why}")
