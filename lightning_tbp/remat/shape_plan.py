"""One input signature's plan, solved from its trace: a pure function of the trace and the budget.

``solve_shape`` runs the solver on a simulator of the trace and packs the answer with what the
reports need (per-block decisions, the predicted peak and where it falls). It touches no module:
installing the plan is :class:`~lightning_tbp.remat.plan.Plan`'s job, reporting it
``report.py``'s, metering it ``verify.py``'s.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from lightning_tbp.memory.held import HeldMemory
from lightning_tbp.remat.budget import MemoryBudget, device_level_ratio, format_bytes, format_level, format_room
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.signature import Signature
from lightning_tbp.remat.simulate import SimResult, Simulator
from lightning_tbp.remat.solve import InfeasibleBudgetError, Solver, budget_for_peak
from lightning_tbp.remat.step import NOTHING_ALONGSIDE, PLAIN_LOOP, Alongside, LoopModel, PriorGradients
from lightning_tbp.remat.trace import Trace


class NothingToPlanWarning(UserWarning):
    """The module has no block that a checkpoint could wrap; it runs unchanged."""


@dataclass
class BlockDecision:
    path: str
    option: Option
    level: int  # number of checkpoints enclosing this block, itself included
    kept_bytes: int  # held after the forward under the plan
    naive_kept_bytes: int  # held after the forward without any checkpoint
    forward_flops: int
    recomputations: int
    call: str = ""
    """The key of the outermost repeated call enclosing the block (itself included): a call of a
    module the step runs several times, as a chain's U-Net ("" if none)."""


@dataclass
class ShapePlan:
    """The plan for one input signature."""

    signature: Signature
    batch_size: int | None  # leading size of the inputs it was profiled with
    options: dict[str, Option]
    cache_limits: dict[str, int]  # per selective block: heavy-op outputs its checkpoint caches
    budget_bytes: int  # for the step, after what training holds outside it
    held: HeldMemory | None
    naive: SimResult
    planned: SimResult
    forward_flops: int
    forward_ns: float  # sum of the calibrated op times of one forward
    step_ns: float  # predicted time of the unplanned step (``Simulator.step_ns``)
    parameter_grad_bytes: int
    step: str = "plain"  # the step model it was solved for ("dp:ghost", ...)
    loop: LoopModel = PLAIN_LOOP  # the training loop's cases it holds in
    alongside: Alongside = NOTHING_ALONGSIDE  # what the loop keeps beside the step, in every prediction
    actions: tuple[str, ...] = ()  # loop alternatives the plan took beyond recomputation, described
    blocks: list[BlockDecision] = field(default_factory=list)
    edges: list[tuple[str, str, int]] = field(default_factory=list)  # (producer, consumer, bytes)
    peak_block: str = ""  # the block whose forward, recompute or backward the predicted peak falls in
    profile_seconds: float = 0.0
    solve_seconds: float = 0.0
    correction: float = 1.0  # measured over predicted peak folded into a re-plan (1: none)
    measured_peak_bytes: int | None = None  # filled when the plan's step is metered
    measured_batch_size: int | None = None  # that step's batch: below ``batch_size``, only the budget is comparable
    loss_bytes: int = 0  # what the prediction allows for the loss computed from the outputs (``loss.py``)
    loss_measured: bool = False  # that loss was measured on a step (else assumed)
    measured_loss_bytes: int | None = None  # the loss of the metered step (``verify.StepReading``)
    measured_step_ns: float | None = None  # median time of its timed steps (``verify.StepClock``)
    host_budget_bytes: float = float("inf")  # the most the host tier may hold (inf: no host tier)
    # per streamed block: the names, in the block, of the weights it streams (``host_weights.py``)
    streamed: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def measured_at_planned_batch(self) -> bool:
        """Whether the metered step had the batch the plan was profiled with (then the prediction
        is comparable too; a smaller Poisson batch under a plan made for the ceiling is checked
        against the budget only)."""
        return self.measured_batch_size is None or self.measured_batch_size == self.batch_size

    @property
    def predicted_peak_bytes(self) -> int:
        """The highest of the loop's cases (``loop``)."""
        return self.planned.peak_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes of the weights it streams: off the device, against the parameters as loaded."""
        return self.planned.streamed_bytes

    def level(self, step_bytes: int) -> str:
        """``step_bytes`` as the reports give them (:func:`format_level`)."""
        return format_level(step_bytes, self.streamed_bytes)

    def ratio(self, measured_bytes: int, reference_bytes: int) -> float:
        """``measured_bytes`` over ``reference_bytes`` as device levels (:func:`device_level_ratio`)."""
        return device_level_ratio(measured_bytes, reference_bytes, self.streamed_bytes)

    def predicted_case_bytes(self, case: PriorGradients) -> int:
        """The predicted peak of a step in ``case`` (with the gradients the loop holds then)."""
        return self.planned.case_peaks.get(case, self.planned.peak_bytes)

    @property
    def planned_step_ns(self) -> float:
        """Predicted time of the step under the plan: the unplanned step's and the plan's extra."""
        return self.step_ns + self.planned.recompute_cost

    @property
    def recompute_time_ratio(self) -> float:
        """Predicted extra time of the plan (recomputation and what its options add) over the
        predicted time of the unplanned step."""
        return self.planned.recompute_cost / max(self.step_ns, 1.0)

    @property
    def recompute_flop_ratio(self) -> float:
        """Recomputed FLOPs over an estimated training step (forward + 2x forward backward)."""
        return self.planned.recompute_flops / max(3 * self.forward_flops, 1)


def solve_shape(
    trace: Trace,
    solver: Solver,
    signature: Signature,
    batch_size: int | None,
    budget: MemoryBudget,
    device: torch.device,
    held: HeldMemory | None,
    *,
    correction: float = 1.0,
    loss_measured: bool = False,
    batch_ceiling: int | None = None,
    module_name: str = "module",
    fraction_of: int | None = None,
) -> ShapePlan:
    """The cheapest plan for ``trace`` under ``budget`` (see :class:`Solver`).

    ``correction`` (>= 1): a measured step peaked this much above its prediction; the plan is
    solved for the budget divided by it, so the measured peak lands under the budget.
    Raises :class:`InfeasibleBudgetError` with notes on what took the memory; "auto" on a device
    without a memory limit falls back to the minimum feasible budget with a warning.
    ``fraction_of``: the naive peak a fractional budget is of, where that is another loop's (the
    user's, when the plan took an alternative); default: ``solver``'s.
    """
    simulator = solver.sim
    naive = solver.naive()
    budget_bytes = budget.resolve(fraction_of or naive.peak_bytes, device, held)
    plannable = [n for n in trace.nodes[1:] if n.has_events]

    def explain(error: InfeasibleBudgetError) -> None:
        """Notes on what took the memory, for a budget refused as given."""
        loss = describe_loss(simulator.loss_bytes, loss_measured)
        _explain(error, budget, budget_bytes, held, batch_ceiling, correction, loss)

    if not plannable:
        if naive.peak_bytes * correction > budget_bytes and not budget.is_fraction_default(device):
            # a budget is a promise: running unchanged above it would break it silently
            error = InfeasibleBudgetError(budget_bytes, naive.peak_bytes, naive.peak_bytes)
            error.add_note(
                f"nothing to plan in {module_name}: it has no submodule with children of its own (leaf layers "
                "such as a single Linear are not checkpointed), so its step peaks where it does unplanned. Plan "
                "a module that holds it, or give a budget at or above the minimum"
            )
            explain(error)
            raise error
        # "auto" without a device limit is a default fraction: here the unplanned step is its minimum
        if budget.is_fraction_default(device):
            budget_bytes = max(budget_bytes, budget_for_peak(math.ceil(naive.peak_bytes * correction)))
        options, planned, solve_seconds = [Option.KEEP] * len(trace.nodes), naive, 0.0
    else:
        try:
            # divided by the correction, in the frame of ``ShapePlan.ratio`` (a budget below zero, too)
            solution = solver.solve(int(budget_bytes - abs(budget_bytes) * (1 - 1 / correction)))
        except InfeasibleBudgetError as error:
            if not budget.is_fraction_default(device):
                explain(error)
                raise
            warnings.warn(
                f"lightning_tbp: memory_budget='auto' means {budget.describe_resolved(device)} here, below what "
                f"{module_name} can reach; planning at its minimum feasible budget "
                f"{format_bytes(error.minimum_step_bytes)} "
                f"({error.minimum_step_bytes / naive.peak_bytes:.3f} of naive) instead",
                stacklevel=5,
            )
            budget_bytes = error.minimum_step_bytes
            solution = solver.solve(budget_bytes)
        options, planned, solve_seconds = solution.options, solution.result, solution.solve_seconds
    return ShapePlan(
        signature=signature,
        batch_size=batch_size,
        options={trace.nodes[i].key: o for i, o in enumerate(options) if i > 0 and o != Option.KEEP},
        cache_limits={
            trace.nodes[i].key: simulator.cache_limit(i) for i, o in enumerate(options) if o == Option.SELECTIVE
        },
        streamed={
            trace.nodes[i].key: streamed_names(trace, simulator.facts.block_weights[i], trace.nodes[i].path)
            for i, o in enumerate(options)
            if o == Option.STREAM
        },
        budget_bytes=budget_bytes,
        held=held,
        naive=naive,
        planned=planned,
        forward_flops=sum(trace.event_flops),
        forward_ns=sum(trace.event_cost),
        step_ns=simulator.step_ns,
        parameter_grad_bytes=trace.parameter_grad_bytes,
        step=simulator.step.name,
        loop=simulator.loop,
        alongside=simulator.alongside,
        blocks=_block_table(trace, simulator, options, planned),
        edges=trace.block_edges(),
        peak_block=_peak_block(trace, simulator, options, planned),
        solve_seconds=solve_seconds,
        correction=correction,
        loss_bytes=simulator.loss_bytes,
        loss_measured=loss_measured,
        host_budget_bytes=simulator.host_budget_bytes,
    )


def streamed_names(trace: Trace, sids: list[int], path: str) -> tuple[str, ...]:
    """The names, relative to the block at ``path``, of the frozen weights ``sids``."""
    prefix = f"{path}." if path else ""
    return tuple(trace.frozen_weights[sid].removeprefix(prefix) for sid in sids)


def _explain(
    error: InfeasibleBudgetError,
    budget: MemoryBudget,
    budget_bytes: int,
    held: HeldMemory | None,
    batch_ceiling: int | None,
    correction: float,
    loss: str,
) -> None:
    if held is not None:
        error.minimum_device_bytes = error.minimum_step_bytes + held.total
    if held is not None and budget.kind == "bytes":
        error.add_note(
            f"the budget {budget.describe()} is the device's total, and training holds {describe_held(held)} "
            f"outside the step, which leaves "
            f"{format_room(budget_bytes)}"
            "; a device budget of "
            f"{format_bytes(error.minimum_step_bytes + held.total)} "
            f"({error.minimum_step_bytes + held.total} bytes) or more fits"
        )
    if batch_ceiling is not None:
        error.add_note(
            f"the plan is made for the batch ceiling, {batch_ceiling} samples per call (Poisson batches vary in "
            "size), so the budget must hold a batch that large"
        )
    if loss:
        error.add_note(f"the minimum counts {loss}: a loss that holds less needs less")
    if correction > 1:
        error.add_note(
            f"a measured step peaked {correction:.3f}x above its prediction, so plans are solved for the budget "
            "divided by that; the minimum named above is before that correction"
        )


def describe_loss(loss_bytes: int, measured: bool) -> str:
    """How a plan counts the loss computed from the module's outputs (empty when it does not)."""
    if not loss_bytes:
        return ""
    how = "as measured on a step" if measured else "assumed: an MSE of its first output, until a step is metered"
    return f"the loss computed from the module's outputs, {format_bytes(loss_bytes)} ({how})"


def describe_held(held: HeldMemory) -> str:
    pending = f", {format_bytes(held.optimizer_state_pending)} of it made at the first step"
    buckets = f", DDP's gradient buckets {format_bytes(held.gradient_buckets)}"
    return (
        f"{format_bytes(held.total)} (parameters {format_bytes(held.parameters)}, optimizer state "
        f"{format_bytes(held.optimizer_state)}{pending if held.optimizer_state_pending else ''}"
        f"{buckets if held.gradient_buckets else ''})"
    )


def _kept_by_block(simulator: Simulator, options: list[Option]) -> dict[int, int]:
    """Bytes held at the end of the forward, each storage charged to its first holder's block."""
    trace = simulator.trace
    holdings = simulator.holdings_at(options, trace.num_events - 1)
    kept: dict[int, int] = {}
    charged: set[int] = set()
    holds = [(trace.event_node[e], sids) for e, sids in holdings.event_holds.items()]
    holds += list(holdings.node_holds.items())
    for node, sids in holds:
        for sid in sids:
            if sid not in charged:
                charged.add(sid)
                kept[node] = kept.get(node, 0) + holdings.sizes.get(sid, 0)
    return kept


def _peak_block(trace: Trace, simulator: Simulator, options: list[Option], planned: SimResult) -> str:
    if planned.peak_in_optimizer_step:
        return "optimizer step (on the gradients, after the backward)"
    if planned.peak_in_loss:
        return "loss (after the module's forward, before its backward)"
    holdings = simulator.holdings_at(options, planned.peak_step)
    if holdings.region:
        return f"recompute/backward of {trace.nodes[holdings.region].key}"
    where = "forward" if planned.peak_step < trace.num_events else "backward"
    return f"{where} (outside checkpointed blocks)"


def _block_table(trace: Trace, simulator: Simulator, options: list[Option], planned: SimResult) -> list[BlockDecision]:
    kept = _kept_by_block(simulator, options)
    naive_kept = _kept_by_block(simulator, [Option.KEEP] * len(options))
    calls_of = Counter(node.path for node in trace.nodes[1:] if node.has_events)
    blocks = []
    for node in trace.nodes[1:]:
        if not node.has_events:
            continue
        level, walk, call = 0, node.index, ""
        while walk > 0:
            level += options[walk] != Option.KEEP
            call = trace.nodes[walk].key if calls_of[trace.nodes[walk].path] > 1 else call
            walk = trace.nodes[walk].parent
        lo, hi = node.first_event, node.last_event
        subtree = [n.index for n in trace.nodes if lo <= n.first_event and n.last_event <= hi]
        blocks.append(
            BlockDecision(
                path=node.key,
                option=options[node.index],
                level=level,
                kept_bytes=sum(kept.get(i, 0) for i in subtree),
                naive_kept_bytes=sum(naive_kept.get(i, 0) for i in subtree),
                forward_flops=sum(trace.event_flops[node.first_event : node.last_event + 1]),
                recomputations=planned.recompute_counts.get(node.index, 0),
                call=call,
            )
        )
    return blocks
