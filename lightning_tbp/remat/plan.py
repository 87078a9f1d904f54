"""The public entry point: ``rematerialize(module, *example_args, memory_budget=...)``.

A :class:`Plan` lives on one module. On each forward that builds a graph it looks at the shape
signature of the inputs; a new signature is profiled (memory-safely, see ``trace.py``), solved and
cached, and the checkpoint wrappers switch to that signature's options. ``remove()`` takes every
wrapper and hook off again.

With ``batch_ceiling`` plans ignore the batch size (see ``signature.py``); with ``agree`` each
new plan is passed through a function that makes every process of a distributed run adopt the
same one (the strategies give one built on collectives; see ``strategies/distributed.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_tbp.compat import tree_flatten
from lightning_tbp.memory.held import HeldMemory
from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, profiler_active
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.budget import MemoryBudget, format_bytes, parse_budget
from lightning_tbp.remat.signature import (
    Signature,
    batch_free_signature,
    batch_size_of,
    expand_batch,
    input_signature,
)
from lightning_tbp.remat.simulate import Option, SimResult, Simulator
from lightning_tbp.remat.solve import InfeasibleBudgetError, Solver
from lightning_tbp.remat.step import step_model_for
from lightning_tbp.remat.trace import Trace, record_trace

log = logging.getLogger("lightning_tbp")

# Called on every process with its input signature and its own plan (or the error planning
# raised); returns the plan all processes use, or raises on all of them.
Agreement = Callable[[Signature, "ShapePlan | Exception"], "ShapePlan"]


class NothingToPlanWarning(UserWarning):
    """The module has no block that a checkpoint could wrap; it runs unchanged."""


class BatchAboveCeilingWarning(UserWarning):
    """A batch larger than the plan's batch ceiling ran with the ceiling's plan."""


@dataclass
class BlockDecision:
    path: str
    option: Option
    level: int  # number of checkpoints enclosing this block, itself included
    kept_bytes: int  # held after the forward under the plan
    naive_kept_bytes: int  # held after the forward without any checkpoint
    forward_flops: int
    recomputations: int


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
    parameter_grad_bytes: int
    blocks: list[BlockDecision] = field(default_factory=list)
    edges: list[tuple[str, str, int]] = field(default_factory=list)  # (producer, consumer, bytes)
    peak_block: str = ""  # the block whose forward, recompute or backward the predicted peak falls in
    profile_seconds: float = 0.0
    solve_seconds: float = 0.0
    measured_peak_bytes: int | None = None  # filled by Plan.finish_measurement()

    @property
    def predicted_peak_bytes(self) -> int:
        return self.planned.peak_bytes

    @property
    def recompute_time_ratio(self) -> float:
        """Predicted extra time over an estimated training step (forward + 2x forward backward)."""
        return self.planned.recompute_cost / max(3 * self.forward_ns, 1.0)

    @property
    def recompute_flop_ratio(self) -> float:
        """Recomputed FLOPs over an estimated training step (forward + 2x forward backward)."""
        return self.planned.recompute_flops / max(3 * self.forward_flops, 1)


class Plan:
    """A rematerialization plan installed on a module; see :func:`rematerialize`."""

    def __init__(
        self,
        module: nn.Module,
        memory_budget: object = "auto",
        *,
        measure: bool = False,
        batch_ceiling: int | None = None,
        agree: Agreement | None = None,
        backward_passes: int = 1,
        held: Callable[[], HeldMemory] | None = None,
    ) -> None:
        """``measure=True``: the step that makes a plan is metered from the end of planning to
        :meth:`finish_measurement` (call it after the backward), if it starts without parameter
        gradients, so reports show the predicted against the measured peak.

        ``batch_ceiling``: plan once per batch-free signature, for this many samples, and use
        that plan for every batch size (a larger batch warns: its peak may pass the budget).
        ``agree``: see :data:`Agreement`.
        ``backward_passes``: how often one forward's graph is backpropagated (2 under DP's
        ghost and flash modes, which retain it for a second pass); above 1, plans use no selective
        blocks, whose cache torch hands to the first backward only.
        ``held``: what training keeps on the device outside the step (parameters, optimizer
        state), asked at each new plan; a byte budget is then the device's total (see
        :meth:`MemoryBudget.resolve`)."""
        if batch_ceiling is not None and batch_ceiling < 1:
            raise ValueError(f"batch_ceiling must be a positive number of samples, got {batch_ceiling}")
        if backward_passes < 1:
            raise ValueError(f"backward_passes must be at least 1, got {backward_passes}")
        self.backward_passes = backward_passes
        self.held = held
        self.module = module
        self.measure = measure
        self.batch_ceiling = batch_ceiling
        self.agree = agree
        self._meter: contextlib.ExitStack | None = None
        self._meter_result: AllocatorPeak | None = None
        self.budget: MemoryBudget = parse_budget(memory_budget)
        self.shape_plans: dict[Signature, ShapePlan] = {}
        self.current: ShapePlan | None = None
        self._active: dict[str, Option] = {}
        self._cache_limits: dict[str, int] = {}
        self._wrappers = InstalledWrappers(module, self._active, self._cache_limits)
        self._planning = False
        self._inside_call = False  # planning from the module's own forward pre-hook
        self._hook = module.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    # -- planning ---------------------------------------------------------------------------------
    def plan_for(self, args: tuple, kwargs: dict) -> ShapePlan:
        """Profile, solve and activate the plan for this call's input signature (cached)."""
        batch = batch_size_of(args, kwargs)
        key = input_signature(args, kwargs) if self.batch_ceiling is None else batch_free_signature(args, kwargs)
        shape_plan = self.shape_plans.get(key)
        if shape_plan is None:
            plan_args, plan_kwargs = (
                (args, kwargs) if self.batch_ceiling is None else expand_batch(args, kwargs, self.batch_ceiling)
            )
            shape_plan = self._agreed_solve(input_signature(plan_args, plan_kwargs), plan_args, plan_kwargs)
            self.shape_plans[key] = shape_plan
            log.info("lightning_tbp plan for %s:\n%s", type(self.module).__name__, self.report(shape_plan))
            device = _device_of(self.module, args, kwargs)
            # a smaller batch than the profiled one cannot be checked against the prediction
            comparable = batch == shape_plan.batch_size and self._comparable_step()
            if self.measure and self._meter is None and comparable and _can_meter(device):
                self._meter = contextlib.ExitStack()
                self._meter_result = self._meter.enter_context(allocator_peak(device))
        elif self.batch_ceiling is not None:
            self._check_ceiling(batch)
        self._activate(shape_plan)
        return shape_plan

    def _agreed_solve(self, signature: Signature, args: tuple, kwargs: dict) -> ShapePlan:
        if self.agree is None:
            return self._solve(signature, args, kwargs)
        try:
            local: ShapePlan | Exception = self._solve(signature, args, kwargs)
        except Exception as error:  # every process must reach the agreement, so errors go through it
            local = error
        return self.agree(signature, local)

    def _check_ceiling(self, batch: int | None) -> None:
        assert self.batch_ceiling is not None
        if batch is not None and batch > self.batch_ceiling:
            warnings.warn(
                f"lightning_tbp: a batch of {batch} samples is above the plan's batch ceiling "
                f"{self.batch_ceiling}; it runs with the ceiling's plan and its peak may pass the budget",
                BatchAboveCeilingWarning,
                stacklevel=5,
            )

    def _comparable_step(self) -> bool:
        """A step can be checked against the prediction only if it starts without gradients.

        The prediction counts parameter gradients as allocated during the backward. Lightning
        frees the previous step's gradients *between* forward and backward, so only a step that
        starts with none (the first, or after ``zero_grad(set_to_none=True)``) is comparable.
        """
        return all(p.grad is None for p in self.module.parameters())

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._planning or not torch.is_grad_enabled():
            return
        self._inside_call = True
        try:
            self.plan_for(args, kwargs)
        finally:
            self._inside_call = False

    def finish_measurement(self) -> ShapePlan | None:
        """Stop a running meter (call after the backward); returns the plan it measured."""
        if self._meter is None or self.current is None:
            return None
        self._meter.close()
        assert self._meter_result is not None
        self.current.measured_peak_bytes = self._meter_result.peak_bytes
        self._meter = self._meter_result = None
        return self.current

    def _solve(self, signature: Signature, args: tuple, kwargs: dict) -> ShapePlan:
        self._planning = True
        active = dict(self._active)
        self._active.clear()  # profile the plain module, not a previous plan
        try:
            start = time.perf_counter()
            trace = record_trace(self.module, args, kwargs, inside_call=self._inside_call)
            profile_seconds = time.perf_counter() - start
        finally:
            self._active.update(active)
            self._planning = False
        step = step_model_for(self.module)
        simulator = Simulator(trace, step)
        solver = Solver(simulator, selective=self.backward_passes == 1 and step.backward_passes == 1)
        naive = solver.naive()
        device = _device_of(self.module, args, kwargs)
        held = self.held() if self.held is not None else None
        budget_bytes = self.budget.resolve(naive.peak_bytes, device, held)
        plannable = [n for n in trace.nodes[1:] if n.has_events]
        if not plannable:
            warnings.warn(
                f"lightning_tbp: nothing to plan in {type(self.module).__name__}: it has no submodule "
                "with children of its own that runs once per forward (leaf layers such as a single "
                "Linear are not checkpointed, since that saves nothing); training runs unchanged",
                NothingToPlanWarning,
                stacklevel=4,
            )
            options = [Option.KEEP] * len(trace.nodes)
            planned, solve_seconds = naive, 0.0
        else:
            try:
                solution = solver.solve(budget_bytes)
            except InfeasibleBudgetError as error:
                if not self.budget.is_fraction_default(device):
                    if held is not None and self.budget.kind == "bytes":
                        error.add_note(
                            f"the budget {self.budget.describe()} is the device's total, and training holds "
                            f"{_describe_held(held)} outside the step, which leaves {format_bytes(budget_bytes)}; "
                            f"a device budget of {format_bytes(error.minimum_budget_bytes + held.total)} "
                            f"({error.minimum_budget_bytes + held.total} bytes) or more fits"
                        )
                    if self.batch_ceiling is not None:
                        error.add_note(
                            f"the plan is made for the batch ceiling, {self.batch_ceiling} samples per call "
                            "(Poisson batches vary in size), so the budget must hold a batch that large"
                        )
                    raise
                warnings.warn(
                    f"lightning_tbp: memory_budget='auto' means {self.budget.describe_resolved(device)} here, "
                    f"below what {type(self.module).__name__} can reach; planning at its minimum feasible budget "
                    f"{format_bytes(error.minimum_budget_bytes)} "
                    f"({error.minimum_budget_bytes / naive.peak_bytes:.3f} of naive) instead",
                    stacklevel=4,
                )
                budget_bytes = error.minimum_budget_bytes
                solution = solver.solve(budget_bytes)
            options, planned, solve_seconds = solution.options, solution.result, solution.solve_seconds
        shape_plan = ShapePlan(
            signature=signature,
            batch_size=batch_size_of(args, kwargs),
            options={trace.nodes[i].path: o for i, o in enumerate(options) if i > 0 and o != Option.KEEP},
            cache_limits={
                trace.nodes[i].path: simulator.cache_limit(i) for i, o in enumerate(options) if o == Option.SELECTIVE
            },
            budget_bytes=budget_bytes,
            held=held,
            naive=naive,
            planned=planned,
            forward_flops=sum(trace.event_flops),
            forward_ns=sum(trace.event_cost),
            parameter_grad_bytes=trace.parameter_grad_bytes,
            blocks=_block_table(trace, simulator, options, planned),
            edges=trace.block_edges(),
            peak_block=_peak_block(trace, simulator, options, planned),
            profile_seconds=profile_seconds,
            solve_seconds=solve_seconds,
        )
        return shape_plan

    def _activate(self, shape_plan: ShapePlan) -> None:
        if self.current is shape_plan:
            return
        self._wrappers.ensure(shape_plan.options)
        self._active.clear()
        self._active.update(shape_plan.options)
        self._cache_limits.clear()
        self._cache_limits.update(shape_plan.cache_limits)
        self.current = shape_plan

    # -- lifecycle and reports --------------------------------------------------------------------
    def remove(self) -> None:
        """Restore the module exactly: no wrapper, no hook."""
        if self._meter is not None:
            self._meter.close()
            self._meter = self._meter_result = None
        self._hook.remove()
        self._wrappers.remove()
        self._active.clear()

    def _require(self, shape_plan: ShapePlan | None) -> ShapePlan:
        shape_plan = shape_plan or self.current
        if shape_plan is None:
            raise RuntimeError("no plan yet: call the module (or rematerialize with example inputs) first")
        return shape_plan

    def report(self, shape_plan: ShapePlan | None = None) -> str:
        """A readable table: per block the decision, nesting level, bytes and cost."""
        sp = self._require(shape_plan)
        header = (
            f"{'block':<44} {'decision':<10} {'level':>5} {'kept':>11} {'naive kept':>11} {'GFLOP':>8} {'recomp':>6}"
        )
        lines = [header, "-" * len(header)]
        for b in sp.blocks:
            lines.append(
                f"{b.path:<44} {b.option.name.lower():<10} {b.level:>5} {format_bytes(b.kept_bytes):>11} "
                f"{format_bytes(b.naive_kept_bytes):>11} {b.forward_flops / 1e9:>8.3f} {b.recomputations:>6}"
            )
        lines += [
            "-" * len(header),
            (
                f"device budget {self.budget.describe()} less {_describe_held(sp.held)} held outside the step "
                f"leaves {format_bytes(sp.budget_bytes)} for the step; "
                if sp.held is not None and self.budget.kind == "bytes"
                else f"budget {format_bytes(sp.budget_bytes)} ({self.budget.describe()}); "
            )
            + f"predicted peak {format_bytes(sp.predicted_peak_bytes)} = "
            f"{sp.predicted_peak_bytes / sp.naive.peak_bytes:.3f} of naive {format_bytes(sp.naive.peak_bytes)} "
            f"(parameter gradients {format_bytes(sp.parameter_grad_bytes)} included), at the {sp.peak_block}",
            *(
                [
                    f"measured peak {format_bytes(sp.measured_peak_bytes)} = "
                    f"{sp.measured_peak_bytes / sp.predicted_peak_bytes:.3f} of predicted"
                ]
                if sp.measured_peak_bytes is not None
                else []
            ),
            f"recompute {sp.planned.recompute_flops / 1e9:.3f} GFLOP = {sp.recompute_flop_ratio:.3f} of a "
            f"training step's FLOPs, about {sp.recompute_time_ratio:.3f} of its time (est.); "
            f"profiled in {sp.profile_seconds:.2f}s, solved in {sp.solve_seconds:.2f}s",
        ]
        return "\n".join(lines)

    def to_dict(self, shape_plan: ShapePlan | None = None) -> dict[str, Any]:
        """JSON-able summary of one signature's plan."""
        sp = self._require(shape_plan)
        return {
            "module": type(self.module).__name__,
            "signature": [[*t[0], str(t[1]), t[2]] for t in sp.signature[1]],
            "budget": {"spec": self.budget.describe(), "bytes": sp.budget_bytes},
            "held_bytes": None if sp.held is None else dataclasses.asdict(sp.held),
            "naive_peak_bytes": sp.naive.peak_bytes,
            "predicted_peak_bytes": sp.predicted_peak_bytes,
            "predicted_peak_ratio": sp.predicted_peak_bytes / sp.naive.peak_bytes,
            "predicted_peak_at": sp.peak_block,
            "measured_peak_bytes": sp.measured_peak_bytes,
            "parameter_grad_bytes": sp.parameter_grad_bytes,
            "forward_flops": sp.forward_flops,
            "predicted_recompute_flops": sp.planned.recompute_flops,
            "predicted_recompute_ns": sp.planned.recompute_cost,
            "recompute_time_ratio_of_step": sp.recompute_time_ratio,
            "recompute_flop_ratio_of_step": sp.recompute_flop_ratio,
            "profile_seconds": sp.profile_seconds,
            "solve_seconds": sp.solve_seconds,
            "blocks": [
                {
                    "path": b.path,
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

    def to_json(self, shape_plan: ShapePlan | None = None) -> str:
        return json.dumps(self.to_dict(shape_plan), indent=2)

    def __repr__(self) -> str:
        return f"Plan({type(self.module).__name__}, budget={self.budget.describe()}, shapes={len(self.shape_plans)})"


def _describe_held(held: HeldMemory) -> str:
    pending = f", {format_bytes(held.optimizer_state_pending)} of it made at the first step"
    return (
        f"{format_bytes(held.total)} (parameters {format_bytes(held.parameters)}, optimizer state "
        f"{format_bytes(held.optimizer_state)}{pending if held.optimizer_state_pending else ''})"
    )


def _can_meter(device: torch.device) -> bool:
    """CUDA always; CPU unless a profiler is running (the exact CPU meter is one)."""
    return device.type == "cuda" or (device.type == "cpu" and not profiler_active())


def _device_of(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _kept_by_block(simulator: Simulator, options: list[Option]) -> dict[int, int]:
    """Bytes held at the end of the forward, each storage charged to its first holder's block."""
    trace = simulator.trace
    snapshot = simulator.run(options, capture_step=trace.num_events - 1).snapshot
    assert snapshot is not None
    kept: dict[int, int] = {}
    charged: set[int] = set()
    holds = [(trace.event_node[e], sids) for e, sids in snapshot.event_holds.items()]
    holds += list(snapshot.node_holds.items())
    for node, sids in holds:
        for sid in sids:
            if sid not in charged:
                charged.add(sid)
                kept[node] = kept.get(node, 0) + snapshot.sizes.get(sid, 0)
    return kept


def _peak_block(trace: Trace, simulator: Simulator, options: list[Option], planned: SimResult) -> str:
    snapshot = simulator.run(options, capture_step=planned.peak_step).snapshot
    assert snapshot is not None
    if snapshot.region:
        return f"recompute/backward of {trace.nodes[snapshot.region].path}"
    where = "forward" if planned.peak_step < trace.num_events else "backward"
    return f"{where} (outside checkpointed blocks)"


def _block_table(trace: Trace, simulator: Simulator, options: list[Option], planned: SimResult) -> list[BlockDecision]:
    kept = _kept_by_block(simulator, options)
    naive_kept = _kept_by_block(simulator, [Option.KEEP] * len(options))
    blocks = []
    for node in trace.nodes[1:]:
        if not node.has_events:
            continue
        level, walk = 0, node.index
        while walk > 0:
            level += options[walk] != Option.KEEP
            walk = trace.nodes[walk].parent
        lo, hi = node.first_event, node.last_event
        subtree = [n.index for n in trace.nodes if lo <= n.first_event and n.last_event <= hi]
        blocks.append(
            BlockDecision(
                path=node.path,
                option=options[node.index],
                level=level,
                kept_bytes=sum(kept.get(i, 0) for i in subtree),
                naive_kept_bytes=sum(naive_kept.get(i, 0) for i in subtree),
                forward_flops=sum(trace.event_flops[node.first_event : node.last_event + 1]),
                recomputations=planned.recompute_counts.get(node.index, 0),
            )
        )
    return blocks


def rematerialize(module: nn.Module, *example_args: Any, memory_budget: object = "auto", **example_kwargs: Any) -> Plan:
    """Install a rematerialization plan on ``module`` in place and return it.

    ``example_args``/``example_kwargs`` are a representative call; the plan for their shapes is
    made now, and a call with other shapes later gets its own plan (cached per signature).
    ``memory_budget``: see :mod:`lightning_tbp.remat.budget`. Raises
    :class:`~lightning_tbp.remat.solve.InfeasibleBudgetError` (a ``ValueError``) when no plan fits.
    """
    plan = Plan(module, memory_budget)
    try:
        with torch.enable_grad():
            plan.plan_for(example_args, example_kwargs)
    except BaseException:
        plan.remove()
        raise
    return plan
