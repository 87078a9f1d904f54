"""The public entry point: ``rematerialize(module, *example_args, memory_budget=...)``.

A :class:`Plan` lives on one module. On each forward that builds a graph it looks at the shape
signature of the inputs; a new signature is profiled (memory-safely, see ``record.py``), solved
(``shape_plan.py``) and cached, and the checkpoint wrappers switch to that signature's options.
``remove()`` takes every wrapper and hook off again.

Plans are checked against what happens: with ``measure=True`` the step that makes a plan is
metered (``verify.py``), and :meth:`Plan.correct` re-solves a signature whose measured peak
passed the budget, with the measured error folded in; :meth:`Plan.verify` does both for a step
function of the user's.

With ``batch_ceiling`` plans ignore the batch size (see ``signature.py``); with ``agree`` each
new plan is passed through a function that makes every process of a distributed run adopt the
same one (the strategies give one built on collectives; see ``strategies/common.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_tbp.compat import tree_flatten
from lightning_tbp.memory.held import HeldMemory, held_memory
from lightning_tbp.memory.homes import loaded_device
from lightning_tbp.memory.libraries import warm_library_workspaces
from lightning_tbp.memory.meters import collect_garbage_made_inside, refuse_foreign_profiler
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.budget import BudgetSpec, MemoryBudget, format_bytes, format_room, parse_budget
from lightning_tbp.remat.calibrate import release_random_tiles
from lightning_tbp.remat.calibrate_blocks import BlockInputs, Calibration, calibrate
from lightning_tbp.remat.fsdp_gathers import is_dtensor_class, root_left_as_found
from lightning_tbp.remat.host_tier import HostTier, default_host_budget
from lightning_tbp.remat.loss import assumed_loss_bytes
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.pricing import price_by_flops, pricing_by_flops
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.report import format_report, shape_plan_dict
from lightning_tbp.remat.shape_plan import NothingToPlanWarning, ShapePlan, solve_shape
from lightning_tbp.remat.signature import (
    Signature,
    batch_free_signature,
    batch_size_of,
    expand_batch,
    input_signature,
)
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import (
    DEFAULT_MAX_SLOWDOWN,
    PLANNING_MARGIN,
    InfeasibleBudgetError,
    Solver,
    StallingPlanError,
    check_max_slowdown,
)
from lightning_tbp.remat.step import (
    NOTHING_ALONGSIDE,
    PART_FACTORS,
    PLAIN_LOOP,
    Alongside,
    LoopAlternative,
    LoopModel,
    step_model_for,
)
from lightning_tbp.remat.trace import Trace
from lightning_tbp.remat.verify import StepMeter, StepReading, Verification

log = logging.getLogger("lightning_tbp")

# Called on every process with its input signature and its own plan (or the error planning
# raised); returns the plan all processes use, or raises on all of them.
Agreement = Callable[[Signature, "ShapePlan | Exception"], "ShapePlan"]

__all__ = [
    "Agreement",
    "BatchAboveCeilingWarning",
    "NothingToPlanWarning",
    "OverBudgetWarning",
    "Plan",
    "ShapePlan",
    "rematerialize",
]


#: How often :meth:`Plan.correct` solves one signature again for a measured step over its budget.
MAX_CORRECTIONS = 2


class OverBudgetWarning(UserWarning):
    """A plan's measured step stays over its budget and no correction is tried any more."""


class BatchAboveCeilingWarning(UserWarning):
    """A batch larger than the plan's batch ceiling ran with the ceiling's plan."""


def weights_layout(module: nn.Module) -> tuple[type, type | None]:
    """What a plan's byte counts depend on that can change under it without a new input
    signature, read in O(1): the module's class (``fully_shard`` swaps it for an FSDP one) and
    its first parameter's (a tensor subclass once quantized). A DTensor counts as a tensor: FSDP2
    swaps a unit's shards for the gathered tensors in its forward and back after it, so plans
    made inside and outside the call see either."""
    first = next(module.parameters(), None)
    if first is None:
        return type(module), None
    kind = type(first.data)
    return type(module), torch.Tensor if is_dtensor_class(kind) else kind


def _layout_change(planned: tuple[type, type | None], now: tuple[type, type | None]) -> str:
    changes = []
    if planned[0] is not now[0]:
        changes.append(f"its class {planned[0].__name__} is now {now[0].__name__}")
    if planned[1] is not now[1]:
        was, became = (getattr(kind, "__name__", "none") for kind in (planned[1], now[1]))
        changes.append(f"its parameters, {was} when planned, are {became} now")
    return " and ".join(changes)


@dataclass
class _Profile:
    """What re-solving one signature needs, kept so a correction does not profile again."""

    trace: Trace
    solver: Solver  # replaced when a measured loss is folded in
    signature: Signature
    batch_size: int | None
    device: torch.device
    held: HeldMemory | None
    loss_measured: bool  # the solver's loss was measured on a step (else assumed, ``loss.py``)
    alongside: Alongside  # what the loop kept beside the step when it was profiled


class Plan:
    """A rematerialization plan installed on a module; see :func:`rematerialize`."""

    def __init__(
        self,
        module: nn.Module,
        memory_budget: BudgetSpec = "auto",
        *,
        measure: bool = False,
        batch_ceiling: int | None = None,
        agree: Agreement | None = None,
        backward_passes: int = 1,
        held: Callable[[], HeldMemory] | None = None,
        loop: LoopModel = PLAIN_LOOP,
        alternatives: Sequence[LoopAlternative] = (),
        alongside: Callable[[tuple, dict], Alongside] | None = None,
        host_tier: HostTier = "off",
        host_budget_bytes: int | None = None,
        max_slowdown: float | None = DEFAULT_MAX_SLOWDOWN,
    ) -> None:
        """``measure=True``: the step that makes a plan is metered from the end of planning to
        :meth:`finish_measurement` (call it after the backward), if it starts without parameter
        gradients, so reports show the predicted against the measured peak.

        ``batch_ceiling``: plan once per batch-free signature, for this many samples, and use
        that plan for every batch size (a larger batch warns: its peak may pass the budget).
        ``agree``: see :data:`Agreement`.
        ``backward_passes``: how often one forward's graph is backpropagated; above 1, plans use
        no selective blocks, whose cache torch hands to the first backward only. A DP engine
        attached to the module declares its own passes (``step.py``), which count too.
        ``held``: what training keeps on the device outside the step (parameters, optimizer
        state), asked at each new plan (None: the module's parameters); a byte budget is the
        device's total, less this (see :meth:`MemoryBudget.resolve`).
        ``loop``: the gradients the training loop holds when a step starts and its optimizer
        step (``step.LoopModel``); plans hold in every case it lists. By default a step starts
        without gradients, as after ``zero_grad(set_to_none=True)``; see :meth:`set_loop`.
        ``alternatives``: changes to the loop that lower its memory, in order, each including
        those before it (the optimizer inside the backward; its state on the host too); the
        first that meets a shape's budget where ``loop`` cannot is taken (and every shape solved
        again in it), those that use the host tier only once plans may; an infeasible budget's
        error names what each would reach and, where it is blocked, why.
        ``alongside``: what the training loop keeps on the device beside the step (the batch,
        what ``training_step`` made before the call), asked with the call's arguments, before
        anything else, whenever a new signature is planned; counted in every prediction (and
        added to what the plan's own meter, which starts at the forward, reads). None: nothing.
        ``host_tier``: ``"on"`` lets plans offload blocks' saved activations to host memory
        (``host_tier.py``) and stream their frozen weights from it (``host_weights.py``), chosen
        per block by predicted time like recomputation; ``"auto"`` only once a budget cannot be
        met on the device alone (the report says so); ``"off"`` keeps every byte on the device.
        A step whose graph is backpropagated more than once (a DP engine's, which also probes its
        first graph) brings an offloaded save back in each pass; its host copy stays until the last.
        ``host_budget_bytes``: the most plans may keep on the host at once (None: a share of the
        host memory available when a plan is made, ``host_tier.default_host_budget``).
        ``max_slowdown``: the most times slower than without a plan a step may be predicted to
        run (recomputation, host copies, the optimizer's step on the host): a plan beyond it
        raises :class:`StallingPlanError` rather than train at a fraction of the speed (as
        hand-set block swap does where the host link is slow). None: no limit."""
        check_max_slowdown(max_slowdown)
        self.max_slowdown = max_slowdown
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        self.host_budget_bytes = host_budget_bytes
        if host_tier not in ("off", "on", "auto"):
            raise ValueError(f"host_tier must be 'off', 'on' or 'auto', got {host_tier!r}")
        self.host_tier = host_tier
        self._host_tier_used = False  # "auto" took it
        self._host_tier_action: tuple[str, ...] = ()  # as the reports describe it
        if batch_ceiling is not None and batch_ceiling < 1:
            raise ValueError(f"batch_ceiling must be a positive number of samples, got {batch_ceiling}")
        if backward_passes < 1:
            raise ValueError(f"backward_passes must be at least 1, got {backward_passes}")
        self.backward_passes = backward_passes
        self.held = held
        self.loop = loop
        self._base_loop = loop  # the loop before any alternative: a fractional budget is of its naive peak
        self.alternatives = list(alternatives)
        self.alongside = alongside
        self.actions: tuple[str, ...] = ()  # the alternatives taken, as the reports describe them
        self.module = module
        self.measure = measure
        self.batch_ceiling = batch_ceiling
        self.agree = agree
        self.budget: MemoryBudget = parse_budget(memory_budget)
        self.shape_plans: dict[Signature, ShapePlan] = {}
        self.current: ShapePlan | None = None
        self._profiles: dict[Signature, _Profile] = {}
        self._calibration: Calibration | None = None
        self._meter = StepMeter()
        self._metered: ShapePlan | None = None  # the plan whose step the meter is on
        self._metered_batch: int | None = None  # and that step's batch
        self._loss_per_output_byte = 0.0  # the loss's measured bytes over its module outputs' (0: not yet)
        self._warned_autocast = False  # a metered backward ran under autocast with its cache (warned once)
        self._meter_next: set[Signature] = set()  # signatures re-planned: meter their next step
        self._corrections: dict[Signature, int] = {}  # how often each signature was corrected
        self._settled: set[Signature] = set()  # signatures kept over their budget (``correct``)
        self._warned_nothing = False  # NothingToPlanWarning, once
        self._active: dict[str, Option] = {}
        self._cache_limits: dict[str, int] = {}
        self._streamed: dict[str, tuple[str, ...]] = {}
        self._wrappers = InstalledWrappers(module, self._active, self._cache_limits, self._streamed)
        self._planning = False
        self._caught_errors: list[BaseException] = []  # planning went on past these (``plan_for`` frees them)
        self._inside_call = False  # planning from the module's own forward pre-hook
        self._planned_layout: tuple[type, type | None] | None = None  # the weights' as the plans were made
        self._hook = module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        # the first of the module's forward hooks and (where the plan is made after the module's
        # other hooks, as the strategies make it) the last: see ``verify.StepMeter``
        self._outputs_hook = module.register_forward_hook(self._outputs_made, prepend=True)
        self._after_hook = module.register_forward_hook(self._after_forward)

    # -- planning ---------------------------------------------------------------------------------
    def plan_for(self, args: tuple, kwargs: dict) -> ShapePlan:
        """Profile, solve and activate the plan for this call's input signature (cached)."""
        batch = batch_size_of(args, kwargs)
        key = self._key(args, kwargs)
        self._check_layout()
        planned = self.shape_plans.get(key)
        fresh = planned is None
        if planned is None:
            alongside = self._alongside(args, kwargs, batch)
            plan_args, plan_kwargs = (
                (args, kwargs) if self.batch_ceiling is None else expand_batch(args, kwargs, self.batch_ceiling)
            )
            signature = input_signature(plan_args, plan_kwargs)
            warm_library_workspaces(_device_of(self.module, args, kwargs))  # held from now on, not a step's
            try:
                planned = self._agreed(
                    signature, lambda: self._solve(key, signature, plan_args, plan_kwargs, alongside)
                )
            finally:
                release_random_tiles()  # the stand-ins' values, no longer needed
                # a solve that went on to an alternative caught errors whose tracebacks hold, in a
                # cycle, the frames they passed through (this call's inputs among them): their frames
                # are cleared now, before the step, rather than left to a collection (which inside a
                # metered region would free old garbage the meter then misreads, and costs ~0.3 s)
                for error in self._caught_errors:
                    release_frames(error)
                self._caught_errors.clear()
                collect_garbage_made_inside()  # planning's own cycles, inside the step's meter
            self.shape_plans[key] = planned
            self._planned_layout = weights_layout(self.module)
            if not planned.blocks and not self._warned_nothing:
                self._warned_nothing = True
                warnings.warn(
                    f"lightning_tbp: nothing to plan in {type(self.module).__name__}: it has no submodule with "
                    "children of its own (leaf layers such as a single Linear are not checkpointed, since that saves "
                    "nothing); training runs unchanged",
                    NothingToPlanWarning,
                    stacklevel=4 if self._inside_call else 3,
                )
            log.info("lightning_tbp plan for %s:\n%s", type(self.module).__name__, self.report(planned))
        elif self.batch_ceiling is not None:
            self._check_ceiling(batch)
        self._activate(planned)  # before a meter starts: streamed weights move to the host here
        if self.measure and (fresh or key in self._meter_next):
            self._meter_next.discard(key)
            self._metered, self._metered_batch = planned, batch  # checked after this step (metered if it can be)
            # a batch below the profiled ceiling (Poisson sampling) is checked against the budget only
            if self._comparable_step():
                self._meter.start(_device_of(self.module, args, kwargs))
        return planned

    def _check_layout(self) -> None:
        """Refuse to run plans made for weights laid out otherwise: sharded by ``fully_shard`` (or
        quantized) after the plans were made, they count the weights whole and the all-gathers
        not at all (the zoo's DiT sharded after its plan peaked 1.10x its prediction, silently)."""
        if self._planned_layout is None:
            return
        now = weights_layout(self.module)
        if now != self._planned_layout:
            raise RuntimeError(
                f"lightning_tbp: the module's weights changed layout after its plan was made "
                f"({_layout_change(self._planned_layout, now)}): the plan counts the weights as they were and "
                "no all-gather of sharded ones, so its budget would not hold. Shard (fully_shard) or quantize the "
                "model first and plan it after: call plan.remove() and rematerialize it again"
            )

    def _alongside(self, args: tuple, kwargs: dict, batch: int | None) -> Alongside:
        """What the loop keeps beside the step of this call, for the batch the plan is made for."""
        if self.alongside is None:
            return NOTHING_ALONGSIDE
        measured = self.alongside(args, kwargs)
        if self.batch_ceiling is not None and batch:
            return measured.scaled(self.batch_ceiling / batch)
        return measured

    def _key(self, args: tuple, kwargs: dict) -> Signature:
        return input_signature(args, kwargs) if self.batch_ceiling is None else batch_free_signature(args, kwargs)

    def _agreed(self, signature: Signature, solve: Callable[[], ShapePlan]) -> ShapePlan:
        """Run ``solve``; in a distributed run every process adopts the agreed plan (or all raise)."""
        if self.agree is None:
            return solve()
        try:
            local: ShapePlan | Exception = solve()
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
        hooked = self._wrappers.hooked
        self._inside_call = True
        try:
            self.plan_for(args, kwargs)
        finally:
            self._inside_call = False
        if not hooked and self._wrappers.hooked:  # installed by this call: their own hook runs from the next
            self._wrappers.begin_step(
                leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)
            )

    def _outputs_made(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._planning:
            self._meter.outputs_made(output)

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._planning:
            self._meter.forward_ended()  # the loss window of a metered step opens here

    def _selective(self, trace: Trace) -> bool:
        """Whether plans may use selective blocks: torch hands their cache to one backward only,
        and its recomputation must run the forward's ops, which autocast's cache breaks (a
        weight's cast the forward took from the cache is made again in the recomputation: torch
        raises "aten._to_copy.default encountered during backward but not found in storage")."""
        one_backward = self.backward_passes == 1 and step_model_for(self.module).backward_passes == 1
        return one_backward and not trace.autocast_cached

    def _solver(self, trace: Trace, loss_bytes: int, alongside: Alongside, loop: LoopModel | None = None) -> Solver:
        loop = self.loop if loop is None else loop
        host = self.host_tier == "on" or self._host_tier_used
        host_budget = float("inf")
        if host or loop.host_state_bytes:  # the optimizer's state there counts against it too
            host_budget = default_host_budget() if self.host_budget_bytes is None else self.host_budget_bytes
        simulator = Simulator(trace, step_model_for(self.module), loss_bytes, loop, alongside, host_budget)
        return Solver(simulator, selective=self._selective(trace), offload=host, stream=host)

    def set_loop(self, loop: LoopModel) -> None:
        """Plan for another training loop from now on: every shape planned so far is solved
        again (no new profile) and its next step metered. Raises :class:`InfeasibleBudgetError`
        if a shape cannot meet its budget in the new loop."""
        if loop == self.loop:
            return
        self.loop = loop
        if not self.actions:
            self._base_loop = loop
        for key, shape_plan in list(self.shape_plans.items()):
            profile = self._profiles[key]
            profile.solver = self._solver(profile.trace, profile.solver.sim.loss_bytes, profile.alongside)
            solved = self._agreed(
                profile.signature, partial(self._solve_profile, profile, correction=shape_plan.correction)
            )
            solved.profile_seconds = shape_plan.profile_seconds
            self.shape_plans[key] = solved
            self._meter_next.add(key)
            if self.current is shape_plan:
                self.current = None
            log.info(
                "lightning_tbp plan for %s, solved again for %s:\n%s",
                type(self.module).__name__,
                loop.describe(),
                self.report(solved),
            )

    def _solve(
        self, key: Signature, signature: Signature, args: tuple, kwargs: dict, alongside: Alongside
    ) -> ShapePlan:
        """Profile this call (the plain module, not the plan in force) and solve it."""
        device = _device_of(self.module, args, kwargs)
        if self._wrappers.weights.moved_bytes and device.type != "cpu":
            raise NotImplementedError(
                f"a new input shape {signature} after this plan moved frozen weights to the host: the profile "
                "runs the plain module, and streamed weights are not on the device. Plan every shape before "
                "the host tier streams weights, give fixed shapes (batch_ceiling= for varying batches), or pass "
                "host_tier='off'"
            )
        self._planning = True
        active = dict(self._active)
        self._active.clear()
        by_flops = pricing_by_flops()
        # once per plan: option costs timed on the model's own blocks, from inputs the profile keeps
        block_inputs = BlockInputs(self.module) if self._calibration is None and not by_flops else None
        try:
            start = time.perf_counter()
            with root_left_as_found(self.module, self._inside_call):
                trace = record_trace(
                    self.module, args, kwargs, inside_call=self._inside_call, block_inputs=block_inputs
                )
                if block_inputs is not None:
                    soft = (Option.SELECTIVE, Option.LAZY) if self._selective(trace) else (Option.LAZY,)
                    self._calibration = calibrate(self.module, trace, block_inputs, (Option.FULL, *soft))
            profile_seconds = time.perf_counter() - start
        finally:
            self._active.update(active)
            self._planning = False
        if by_flops:
            price_by_flops(trace)
        else:
            assert self._calibration is not None
            trace.option_scale = self._calibration.option_scale
        # a loss measured on an earlier signature's step, scaled to these outputs; else the assumed one
        scaled_loss_bytes = round(self._loss_per_output_byte * trace.output_gradient_bytes)
        loss_bytes = scaled_loss_bytes or assumed_loss_bytes(trace.output_specs)
        profile = _Profile(
            trace,
            self._solver(trace, loss_bytes, alongside),
            signature,
            batch_size_of(args, kwargs),
            _device_of(self.module, args, kwargs),
            self.held() if self.held is not None else held_memory(self.module, (), device),
            loss_measured=self._loss_per_output_byte > 0,
            alongside=alongside,
        )
        self._profiles[key] = profile
        shape_plan = self._solve_profile(profile, correction=1.0)
        shape_plan.profile_seconds = profile_seconds
        return shape_plan

    def _solve_profile(self, profile: _Profile, correction: float) -> ShapePlan:
        """Solve on the device alone; where that cannot meet the budget and ``host_tier`` is
        ``"auto"``, with the host tier, which is then used for every shape planned after."""
        try:
            solved = self._solve_in_loop(profile, correction)
        except InfeasibleBudgetError as error:
            self._caught_errors.append(error)
            if not self._may_take_host_tier():
                raise
            solved = self._solve_with_host_tier(profile, correction, error)
        solved.actions = (*self.actions, *self._host_tier_action)
        self._refuse_stalling(solved)
        return solved

    def _refuse_stalling(self, solved: ShapePlan) -> None:
        """Raise :class:`StallingPlanError` where ``solved`` is predicted to run the step more
        than ``max_slowdown`` times slower than the user's unplanned step (with the optimizer's
        steps on the device where they are known: they are the user's anyway)."""
        loop = solved.loop
        unplanned = solved.step_ns - loop.step_inside_ns + loop.optimizer_ns
        slowdown = solved.planned_step_ns / max(unplanned, 1.0)
        if self.max_slowdown is None or slowdown <= self.max_slowdown:
            return
        parts = {
            "recomputation and host copies": solved.planned.recompute_cost,
            "the optimizer's step and copies on the host": max(0.0, loop.step_inside_ns - loop.optimizer_ns),
        }
        raise StallingPlanError(solved.budget_bytes, slowdown, self.max_slowdown, parts, unplanned)

    def _solve_in_loop(self, profile: _Profile, correction: float) -> ShapePlan:
        """Solve in the loop in force; where that cannot meet the budget, in the alternative loop,
        which is then taken for every shape."""
        try:
            return self._solve_with(profile, profile.solver, correction)
        except InfeasibleBudgetError as error:
            self._caught_errors.append(error)
            hosted = self.host_tier == "on" or self._host_tier_used
            for alternative in [a for a in self.alternatives if hosted or not a.host_tier]:
                try:
                    return self._solve_in_alternative(profile, correction, error, alternative)
                except InfeasibleBudgetError as still:
                    error = still  # its notes say what this one would reach
            raise error from None

    def _may_take_host_tier(self) -> bool:
        return self.host_tier == "auto" and not self._host_tier_used

    def _solve_with_host_tier(self, profile: _Profile, correction: float, error: InfeasibleBudgetError) -> ShapePlan:
        device_only, held = profile.solver, profile.held
        self._host_tier_used = True
        profile.solver = self._solver(profile.trace, device_only.sim.loss_bytes, profile.alongside)
        try:
            solved = self._solve_in_loop(profile, correction)
        except InfeasibleBudgetError as lower:
            self._host_tier_used = False
            profile.solver = device_only
            if lower.minimum_step_bytes >= error.minimum_step_bytes:
                raise error from None
            lower.add_note(
                f"that minimum is with the host tier (host_tier='auto'); on the device alone "
                f"{format_bytes(error.minimum_step_bytes)}"
            )
            raise lower from None
        # against what was held outside the step on the device alone (an alternative it took may hold less)
        shift = 0 if held is None or solved.held is None else held.total - solved.held.total
        may = "offload blocks' saved activations to host memory"
        if any(profile.solver.sim.facts.block_weights):  # frozen weights a plan may stream (a LoRA's base)
            may += " and stream their frozen weights from it"
        room = format_room(solved.budget_bytes - shift)
        self._host_tier_action = (
            f"the host tier (host_tier='auto'): what the budget leaves the step, {room}, is below the device-only "
            f"minimum {format_bytes(error.minimum_step_bytes)}, so plans may {may} from now on",
        )
        log.warning("lightning_tbp: taking %s", self._host_tier_action[0])
        return solved

    def _solve_in_alternative(
        self, profile: _Profile, correction: float, error: InfeasibleBudgetError, alternative: LoopAlternative
    ) -> ShapePlan:
        without = format_bytes(error.minimum_step_bytes)
        solver, held, freed = self._taking(profile, alternative)
        try:
            solved = self._solve_with(profile, solver, correction, held)
        except InfeasibleBudgetError as lower:
            within = format_bytes(lower.minimum_step_bytes - freed)
            if alternative.blocked is not None or lower.minimum_step_bytes - freed >= error.minimum_step_bytes:
                blocked = "" if alternative.blocked is None else f", but it cannot be taken here: {alternative.blocked}"
                error.add_note(f"{alternative.action} would lower the minimum to {within}{blocked}")
                raise error from None
            # the fraction it names is of the user's loop's naive peak, as the budget's is
            reached = InfeasibleBudgetError(
                lower.budget_bytes, lower.minimum_peak_bytes, error.naive_bytes, lower.host_bytes
            )
            reached.minimum_device_bytes = lower.minimum_device_bytes
            reached.freeze_message()
            # compared from here on against what the loop holds without it (its message keeps its own)
            reached.budget_bytes -= freed
            reached.minimum_step_bytes -= freed
            for note in getattr(lower, "__notes__", []):
                reached.add_note(note)
            reached.add_note(
                f"that minimum is with {alternative.action}, which this run may take; without it {without}"
            )
            raise reached from None
        if alternative.blocked is not None:
            error.add_note(
                f"{alternative.action} would meet this budget (a plan with it peaks at "
                f"{format_bytes(solved.predicted_peak_bytes)} in the step), but it "
                f"cannot be taken here: {alternative.blocked}"
            )
            raise error from None
        del self.alternatives[: self.alternatives.index(alternative) + 1]  # it includes those before it
        # parts of it, from the least the budget needs, where one is predicted faster than the whole
        short = error.minimum_step_bytes - (solved.budget_bytes - freed)
        parts = self._parts(profile, correction, alternative, short) if freed > 0 else []
        weighed = ""
        if parts:
            part, part_solver, narrow, part_freed = min(parts, key=lambda found: found[2].planned_step_ns)
            whole_ms = f"{solved.planned_step_ns / 1e6:.1f} ms"
            if narrow.planned_step_ns < solved.planned_step_ns:
                weighed = f" (predicted {narrow.planned_step_ns / 1e6:.1f} ms against {whole_ms} for the whole)"
                alternative, solver, solved, freed = part, part_solver, narrow, part_freed
            else:
                each = ", ".join(f"{found[2].planned_step_ns / 1e6:.1f}" for found in parts)
                weighed = f" (its parts that meet the budget were predicted at {each} ms against {whole_ms})"
        corrected = "" if correction <= 1 else f" divided by a measured correction {correction:.3f}"
        off = f", takes {format_bytes(freed)} off the device outside the step" if freed else ""
        left = solved.budget_bytes - freed
        room = (
            f"beside what the loop held outside the step, the budget{corrected} left {format_bytes(left)} for it, "
            f"below the loop's minimum {without}"
            if left >= 0
            else f"the budget{corrected} was {format_bytes(-left)} short of what the loop held outside the step "
            f"(the loop's minimum {without})"
        )
        before, after = profile.solver.naive().peak_bytes, solver.naive().peak_bytes
        lowers = (
            f"it lowers the unplanned step's peak from {format_bytes(before)} to {format_bytes(after)}"
            if after < before
            else f"the unplanned step's peak stays at {format_bytes(before)}, but a plan with it reaches lower"
        )
        self.actions += (f"{alternative.action}{weighed}: {room}; {lowers}{off} and recomputes nothing",)
        profile.solver = solver
        loop = solver.sim.loop
        if alternative.held is not None:  # what it leaves on the device, for every shape from now on
            for known in self._profiles.values():
                known.held = None if known.held is None else alternative.held(known.held)
        self.set_loop(loop)  # the shapes planned so far, solved again in it
        alternative.adopt()
        log.warning("lightning_tbp: taking %s", self.actions[-1])
        return solved

    def _parts(
        self, profile: _Profile, correction: float, alternative: LoopAlternative, short: int
    ) -> list[tuple[LoopAlternative, Solver, ShapePlan, int]]:
        """Parts of ``alternative`` (``LoopAlternative.narrowed``) that meet the budget, solved:
        the least that takes ``short`` bytes off the device, then larger ones (twice, four times
        that), until only the whole would do. A larger part leaves the step a larger budget, so
        it may recompute less for its larger host work (an SDXL-style U-Net halfway down took the
        whole over the least part, and a part twice that over the whole)."""
        found: list[tuple[LoopAlternative, Solver, ShapePlan, int]] = []
        if alternative.narrowed is None:
            return found
        seen: set[str] = set()
        for factor in PART_FACTORS:
            part = alternative.narrowed(short * factor)
            if part is None:
                break  # only the whole covers it
            if part.action in seen:
                continue
            seen.add(part.action)
            part_solver, part_held, part_freed = self._taking(profile, part)
            with contextlib.suppress(InfeasibleBudgetError):  # a larger part may meet it
                found.append(
                    (part, part_solver, self._solve_with(profile, part_solver, correction, part_held), part_freed)
                )
        return found

    def _taking(self, profile: _Profile, alternative: LoopAlternative) -> tuple[Solver, HeldMemory | None, int]:
        """The solver of ``profile`` in the loop with ``alternative``, what training holds outside
        the step then (None: as found), and what that takes off the device as the budget counts
        it (a fraction does not: 0), by which its step budgets are larger."""
        loop = alternative.loop(self.loop)
        solver = self._solver(profile.trace, profile.solver.sim.loss_bytes, profile.alongside, loop)
        held = None if alternative.held is None or profile.held is None else alternative.held(profile.held)
        freed = 0
        if held is not None:
            freed = self.budget.resolve(0, profile.device, held) - self.budget.resolve(0, profile.device, profile.held)
        return solver, held, freed

    def _solve_with(
        self, profile: _Profile, solver: Solver, correction: float, held: HeldMemory | None = None
    ) -> ShapePlan:
        """Solve ``profile`` with ``solver``; ``held``: in place of what the profile found held."""
        fraction_of = None
        if solver.sim.loop != self._base_loop and self.budget.kind == "fraction":
            base = self._solver(profile.trace, solver.sim.loss_bytes, profile.alongside, self._base_loop)
            fraction_of = base.naive().peak_bytes
        return solve_shape(
            profile.trace,
            solver,
            profile.signature,
            profile.batch_size,
            self.budget,
            profile.device,
            profile.held if held is None else held,
            correction=correction,
            loss_measured=profile.loss_measured,
            batch_ceiling=self.batch_ceiling,
            module_name=type(self.module).__name__,
            fraction_of=fraction_of,
        )

    def _activate(self, shape_plan: ShapePlan) -> None:
        if self.current is shape_plan:
            return
        self._wrappers.ensure(shape_plan.options)
        self._active.clear()
        self._active.update(shape_plan.options)
        self._cache_limits.clear()
        self._cache_limits.update(shape_plan.cache_limits)
        self._streamed.clear()
        self._streamed.update(shape_plan.streamed)
        self._wrappers.place_weights()
        self.current = shape_plan

    @property
    def streamed_bytes(self) -> int:
        """Bytes of frozen weights this plan keeps on the host now (``host_weights.py``): off the
        device, against the parameters as loaded, so a meter that started before they left (it
        never saw the frees) or after reads this much above the plan's frame."""
        return self._wrappers.weights.moved_bytes

    # -- checking plans against what happens --------------------------------------------------------
    @property
    def checking(self) -> bool:
        """Whether the step running now is a new or corrected plan's, checked after its backward
        (:meth:`finish_measurement`)."""
        return self._metered is not None

    def finish_measurement(self) -> ShapePlan | None:
        """Stop a running meter (call after the backward). Returns the plan this step was to
        check (a new or corrected one), its ``measured_peak_bytes`` set if the step could be
        metered; None when no check was due. Every process of a run gets a plan at the same step."""
        reading = self._meter.stop()
        shape_plan, self._metered = self._metered, None
        if shape_plan is not None and reading is not None:
            # the meter starts at the forward, where what the loop keeps beside the step is alive
            # and the weights streamed from the host are off the device, against the parameters as loaded
            profile = self._profiles.get(self._key_of(shape_plan))
            beside = 0 if profile is None else profile.alongside.total
            reading = replace(reading, peak_bytes=reading.peak_bytes + beside - self.streamed_bytes)
            self._record(shape_plan, reading, self._metered_batch)
        return shape_plan

    def state_made(self, nbytes: int) -> None:
        """The optimizer, stepping inside the backward, makes a parameter's state (see
        :meth:`StepMeter.state_made`): kept out of a metered step's peak."""
        self._meter.state_made(nbytes)

    def _key_of(self, shape_plan: ShapePlan) -> Signature:
        """The signature ``shape_plan`` was made for (it must be one of this plan's)."""
        key = next((key for key, planned in self.shape_plans.items() if planned is shape_plan), None)
        if key is None:
            raise ValueError("this shape plan was not made by this Plan (or was replaced since)")
        return key

    def _record(self, shape_plan: ShapePlan, reading: StepReading, batch: int | None) -> None:
        """File a metered step's reading on its plan; learn what its loss holds."""
        shape_plan.measured_peak_bytes, shape_plan.measured_batch_size = reading.peak_bytes, batch
        shape_plan.measured_loss_bytes = reading.loss_bytes
        profile = self._profiles.get(self._key_of(shape_plan))
        outputs = profile.trace.output_gradient_bytes if profile is not None else 0
        if reading.loss_bytes is not None and outputs and shape_plan.measured_at_planned_batch:
            self._loss_per_output_byte = reading.loss_bytes / outputs
        cached = profile is not None and profile.trace.autocast_cached
        if reading.backward_under_cached_autocast and cached and not self._warned_autocast:
            self._warned_autocast = True
            log.warning(
                "lightning_tbp: the backward of %s runs inside torch.autocast, whose cache then keeps every "
                "trainable weight's low-precision copy through it; the plan counts them until the backward "
                "starts. Close the autocast context before calling backward (torch's AMP recipe), or pass "
                "cache_enabled=False to torch.autocast",
                type(self.module).__name__,
            )

    @property
    def awaits_measurement(self) -> bool:
        """Whether a corrected plan's next step is to be metered (it must start without gradients)."""
        return self.measure and bool(self._meter_next)

    def correct(self, shape_plan: ShapePlan, ratio: float) -> ShapePlan | None:
        """Solve ``shape_plan``'s signature again with its predictions scaled by ``ratio`` (a
        measured over predicted peak above 1), install it for the next call and meter that call.

        Each signature is corrected at most ``MAX_CORRECTIONS`` times: a step still over its
        budget after that, or one no corrected plan can meet, keeps the plan it has, with one
        warning naming what it measured and the budget that holds it; None is returned then (and
        for every later call on that signature). In a distributed run every process must call it
        with the same ``ratio``."""
        key = self._key_of(shape_plan)
        if key in self._settled:
            return None
        if self._corrections.get(key, 0) >= MAX_CORRECTIONS:
            self._settle(key, shape_plan, f"after {MAX_CORRECTIONS} corrections")
            return None
        self._corrections[key] = self._corrections.get(key, 0) + 1
        profile = self._profiles[key]
        correction = shape_plan.correction * ratio
        loss = shape_plan.measured_loss_bytes
        learned = loss is not None and shape_plan.measured_at_planned_batch and loss != profile.solver.sim.loss_bytes
        if learned:
            assert loss is not None
            # the loss, measured, joins the model; only an error it leaves beyond the planning
            # margin (which is there for the model's own errors) scales the budget
            profile.solver, profile.loss_measured = self._solver(profile.trace, loss, profile.alongside), True
            options = [shape_plan.options.get(node.key, Option.KEEP) for node in profile.trace.nodes]
            unexplained = ratio * shape_plan.predicted_peak_bytes / profile.solver.sim.run(options).peak_bytes
            correction = shape_plan.correction * (unexplained if unexplained > 1 / (1 - PLANNING_MARGIN) else 1.0)
        try:
            corrected = self._agreed(profile.signature, lambda: self._solve_profile(profile, correction=correction))
        except InfeasibleBudgetError as error:
            self._settle(key, shape_plan, f"and no plan meets it with that error folded in ({error})")
            return None
        corrected.profile_seconds = shape_plan.profile_seconds
        self.shape_plans[key] = corrected
        self._meter_next.add(key)
        if self.current is shape_plan:
            self.current = None  # the next call activates the corrected plan
        how = [f"its loss, measured at {format_bytes(loss or 0)}, counted"] if learned else []
        how += [f"predictions scaled by {corrected.correction:.3f}"] if corrected.correction > 1 else []
        log.warning(
            "lightning_tbp: the plan for %s measured %.3fx its predicted peak, above its budget; "
            "re-planned with %s:\n%s",
            type(self.module).__name__,
            ratio,
            " and ".join(how),
            self.report(corrected),
        )
        return corrected

    def _settle(self, key: Signature, shape_plan: ShapePlan, why: str) -> None:
        """Keep ``shape_plan`` for ``key`` from now on, over its budget, and say so once."""
        self._settled.add(key)
        measured = shape_plan.measured_peak_bytes
        peaked = "" if measured is None else f", last measured at {shape_plan.level(measured)},"
        warnings.warn(
            f"lightning_tbp: the plan for {type(self.module).__name__}{peaked} stays over its budget "
            f"{shape_plan.level(shape_plan.budget_bytes)} {why}: it is kept, unchanged, for this input shape and "
            f"no longer corrected. It predicts {shape_plan.level(shape_plan.predicted_peak_bytes)}, of which the "
            f"parameter gradients are {format_bytes(shape_plan.parameter_grad_bytes)}; give a budget above what "
            "its steps measure",
            OverBudgetWarning,
            stacklevel=2,
        )

    def verify(self, step: Callable[[], Any], device: torch.device | str | None = None) -> Verification:
        """Run ``step`` (a forward and backward that starts without gradients) under the exact
        meter and compare it with the plan in force; if its peak passed the budget, re-plan with
        the measured error folded in (``Verification.replanned``): call again to check that one.
        """
        device = torch.device(device) if device is not None else _device_of(self.module, (), {})
        if self._meter.running:
            raise RuntimeError("a metered step of this plan is still running: call finish_measurement() first")
        if not self._meter.start(device):
            refuse_foreign_profiler()  # why on CPU
            raise ValueError(f"no exact allocator meter for device type {device.type!r} (cpu and cuda are supported)")
        try:
            step()
        finally:
            reading = self._meter.stop()
        assert reading is not None
        reading = replace(reading, peak_bytes=reading.peak_bytes - self.streamed_bytes)
        measured = reading.peak_bytes
        shape_plan = self._require(None)  # the plan the step ran (it may have made one for a new shape)
        self._record(shape_plan, reading, shape_plan.batch_size)
        verdict = Verification(
            shape_plan.predicted_peak_bytes, measured, shape_plan.budget_bytes, streamed_bytes=shape_plan.streamed_bytes
        )
        if verdict.within_budget:
            return verdict
        return replace(verdict, replanned=self.correct(shape_plan, verdict.ratio) is not None)

    # -- lifecycle and reports --------------------------------------------------------------------
    def remove(self) -> None:
        """Restore the module exactly: no wrapper, no hook. What is left are the plans and their
        reports: the callables a training loop handed in (its alternatives, meters, agreement)
        are dropped, since no shape is planned again, and they hold the loop's objects (a Trainer
        pickled after fit pickles its strategy, and with it this plan)."""
        self._meter.stop()
        self._metered = None
        self._hook.remove()
        self._after_hook.remove()
        self._outputs_hook.remove()
        self._wrappers.remove()
        self._active.clear()
        self.alternatives, self.alongside, self.held, self.agree = [], None, None, None

    def _require(self, shape_plan: ShapePlan | None) -> ShapePlan:
        shape_plan = shape_plan or self.current
        if shape_plan is None and self.shape_plans:
            shape_plan = list(self.shape_plans.values())[-1]
        if shape_plan is None:
            raise RuntimeError("no plan yet: call the module (or rematerialize with example inputs) first")
        return shape_plan

    def report(self, shape_plan: ShapePlan | None = None) -> str:
        """A readable table: per block the decision, nesting level, bytes and cost."""
        return format_report(self.budget, self._require(shape_plan))

    def to_dict(self, shape_plan: ShapePlan | None = None) -> dict[str, Any]:
        """JSON-able summary of one signature's plan."""
        return shape_plan_dict(type(self.module).__name__, self.budget, self._require(shape_plan))

    def to_json(self, shape_plan: ShapePlan | None = None) -> str:
        return json.dumps(self.to_dict(shape_plan), indent=2)

    def __repr__(self) -> str:
        return f"Plan({type(self.module).__name__}, budget={self.budget.describe()}, shapes={len(self.shape_plans)})"


def release_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames ``error``'s traceback holds (and its context's), so
    the cycle through them (the exception, a frame's local naming it) is freed at once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None
        error = error.__context__


def _device_of(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return next((loaded_device(p) for p in module.parameters()), torch.device("cpu"))


def rematerialize(
    module: nn.Module,
    *example_args: Any,
    memory_budget: BudgetSpec = "auto",
    host_tier: HostTier = "off",
    host_budget_bytes: int | None = None,
    max_slowdown: float | None = DEFAULT_MAX_SLOWDOWN,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    **example_kwargs: Any,
) -> Plan:
    """Install a rematerialization plan on ``module`` in place and return it.

    ``example_args``/``example_kwargs`` are a representative call; the plan for their shapes is
    made now, and a call with other shapes later gets its own plan (cached per signature).
    ``memory_budget``: see :mod:`lightning_tbp.remat.budget`; in bytes it is the device's total,
    from which the module's parameters and the state of ``optimizers`` (the state their first
    step will make included) come off before the step is planned. ``host_tier``,
    ``host_budget_bytes`` and ``max_slowdown``: see :class:`Plan`. Raises
    :class:`~lightning_tbp.remat.solve.InfeasibleBudgetError` (a ``ValueError``) when no plan fits,
    :class:`~lightning_tbp.remat.solve.StallingPlanError` when the one that fits is too slow.
    Check it on a real step with :meth:`Plan.verify`.
    """
    device = _device_of(module, example_args, example_kwargs)
    plan = Plan(
        module,
        memory_budget,
        host_tier=host_tier,
        host_budget_bytes=host_budget_bytes,
        max_slowdown=max_slowdown,
        held=partial(held_memory, module, tuple(optimizers), device) if optimizers else None,
    )
    try:
        with torch.enable_grad():
            plan.plan_for(example_args, example_kwargs)
    except BaseException:
        plan.remove()
        raise
    return plan
