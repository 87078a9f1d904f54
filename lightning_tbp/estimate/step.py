"""Estimate one training step's device memory without allocating it, and the plan that fits.

A :class:`TrainingStep` is built by the caller's function *under fake tensors*
(``FakeTensorMode``): parameters, optimizer, batch and loss all have shapes and storages but no
data, so a model of any size costs this machine almost nothing. Then:

1. The first step runs with the plan's profiler (``record_trace``, ``measure=False``) on the
   target module, as the strategies profile it at their first batch; the optimizer creates its
   state, which is then counted as it really is (any optimizer, no table of classes).
2. A second step runs under :class:`~lightning_tbp.estimate.live_bytes.LiveBytes`: the eager
   step's peak, its forward and backward apart from its optimizer step (the optimizer's
   temporaries sit on top of every gradient).
3. The planner's simulator runs the target's trace: the naive peak it predicts and, for a
   device size, the cheapest plan that fits. Everything around the target (noise, loss, the
   batch) is what the metered step peaked at beyond the simulated target, and is added as is.

With ``step_in_backward`` the metered step and the simulator both step the optimizer on each
parameter inside the backward (``lightning_tbp.optim``), as the strategies do: the closure runs
inside the stepper, and the optimizer's own step after it finds no gradient left.

The byte figures are those of the eager step in fake tensors; what fake tensors cannot show
(kernel workspaces, the allocator's rounding and library workspaces on CUDA) comes from the
:class:`~lightning_tbp.estimate.device.DeviceModel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn

from lightning_tbp.compat import FAKE_VALUE_ERRORS, FakeTensorMode, fake_module_support, storage_key, tree_flatten
from lightning_tbp.estimate.autocast_policy import CudaFloat32Ops
from lightning_tbp.estimate.device import DeviceModel, device_model
from lightning_tbp.estimate.layout import Layout, per_rank, planned_sharding
from lightning_tbp.estimate.live_bytes import LiveBytes, rounded
from lightning_tbp.memory.breakdown import plain_tensors
from lightning_tbp.memory.held import parameter_step_ratio
from lightning_tbp.optim import OptimizerInBackward
from lightning_tbp.optim.host_state import master_dtype_of
from lightning_tbp.optim.step_cost import host_optimizer_ns_per_byte
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import DEFAULT_MAX_SLOWDOWN, InfeasibleBudgetError, Solver, budget_for_peak
from lightning_tbp.remat.step import LoopModel, PriorGradients, step_model_for
from lightning_tbp.remat.trace import Gathers, Trace


class StepNeedsValuesError(ValueError):
    """The training step reads tensor values (``.item()``, ``.tolist()``, ``nonzero``), which the
    estimate's fake tensors do not have (Lumina 2 reads each caption's length from its mask)."""


@contextlib.contextmanager
def _values_refused() -> Iterator[None]:
    """Turn fake tensors' value errors into :class:`StepNeedsValuesError`, naming the innermost
    line outside torch that asked for the values (in the model, or in the caller's ``build``)."""
    try:
        yield
    except FAKE_VALUE_ERRORS as error:
        torch_dir = os.path.dirname(torch.__file__)
        where, traceback = "an op", error.__traceback__
        while traceback is not None:
            code = traceback.tb_frame.f_code
            if not code.co_filename.startswith(torch_dir):
                where = f"{code.co_filename}:{traceback.tb_lineno} in {code.co_name}"
            traceback = traceback.tb_next
        raise StepNeedsValuesError(
            f"the training step reads tensor values at {where} ({error}), and the estimate runs it on fake "
            "tensors, which have shapes but no values; this model cannot be estimated without running it. "
            "The strategies profile the real first batch instead (memory-safely) and meter the plan's first step."
        ) from error


ONE_DEVICE_BUDGET_ARGUMENTS = "--trainer.strategy=lightning_tbp.TinyBackpropStrategy --trainer.strategy.memory_budget="


@dataclass
class TrainingStep:
    """What one training step is made of; built under fake tensors by the caller."""

    modules: dict[str, nn.Module]
    """Every module whose parameters and buffers sit on the device, by name (``{"model": ...,
    "ema": ...}``); a storage shared between two is counted once, under the first."""
    target: nn.Module
    """The module the plan covers (its forward and backward are simulated)."""
    batch: Any
    forward_backward: Callable[[], Any]
    """One forward and backward (the optimizer's closure): leaves gradients in ``.grad``."""
    optimizer_step: Callable[[Callable[[], Any]], Any]
    """Runs the optimizer step given the closure (and whatever follows it, an EMA update)."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    zero_grad: Callable[[], None] | None = None
    layout: Layout = field(default_factory=Layout)
    """One rank's figures under DDP or FSDP2 (``layout.py``); one device by default."""
    sharded_copies: tuple[str, ...] = ()
    """Names in ``modules`` of copies of the target's weights kept as shards like them under
    FSDP2 (``DiffusionModule``'s EMA): 1/N per rank there too."""
    gradients_at_forward: frozenset[PriorGradients] = frozenset({PriorGradients.RELEASED})
    """The training loop's cases (``remat.step.PriorGradients``): which gradients are alive as a
    step's forward starts. The estimate is the highest of them."""
    zero_grad_before_backward: Callable[[bool], None] | None = None
    """Switches Lightning's ``zero_grad`` between the loss and the backward on or off in
    ``forward_backward`` (the ``UNTIL_BACKWARD`` case); without it that case is estimated as
    ``ACCUMULATED``, whose gradients stay (an upper bound)."""
    device: str = "cuda"
    """The device modelled when ``estimate_step`` is not told one (a config's accelerator)."""
    budget_arguments: str = ONE_DEVICE_BUDGET_ARGUMENTS
    """The LightningCLI arguments that train the step under a tiny_backprop strategy, a budget in
    bytes to follow (a config's: ``estimate.config.budget_arguments``)."""


@dataclass
class PlanFit:
    """The plan for one device size, or why there is none."""

    device_memory_bytes: int
    fits_without_plan: bool
    fits_with_plan: bool
    budget_bytes: int | None = None  # for the planned target's step, after what is held anyway
    predicted_peak_bytes: int | None = None  # device total under the plan
    recompute_time_ratio: float | None = None
    recompute_flop_ratio: float | None = None
    planned_blocks: int = 0
    host_peak_bytes: int = 0  # what the plan keeps on the host tier at once
    short_bytes: int | None = None  # where no plan fits: what the device lacks for the lowest one
    reason: str = ""


@dataclass
class StepEstimate:
    """Device bytes of one training step, in parts, and the smallest device with and without a plan."""

    device: str
    parameter_bytes: dict[str, int]
    trainable_parameters: int
    gradient_bytes: int
    optimizer_state_bytes: int
    batch_bytes: int
    library_workspace_bytes: int
    kernel_workspace_bytes: int  # the kernels' own temporaries at the step's peak (measured on this CPU)
    unmeasured_workspace_ops: int  # heavy ops too large to measure here: their temporaries are not in
    forward_backward_peak_bytes: int  # above what is held: activations, gradients, the loss
    optimizer_step_peak_bytes: int  # above what is held, gradients included
    target: str
    target_naive_peak_bytes: int  # the simulator's, of the target's forward and backward
    minimum_device_bytes: int | None  # with the lowest plan (None: not computed)
    minimum_plan_recompute_time_ratio: float | None
    estimate_seconds: float
    minimum_plan_host_bytes: int = 0  # what the lowest plan keeps on the host tier at once
    step_model: str = "plain"
    gradients_at_forward: frozenset[PriorGradients] = frozenset({PriorGradients.RELEASED})
    layout: str = "single"
    world_size: int = 1
    communication_bytes: int = 0  # DDP's gradient buckets (held); FSDP2's gathered units (in the step)
    fit: PlanFit | None = None
    step_in_backward: bool = False  # the optimizer steps each parameter inside the backward
    with_step_in_backward: StepEstimate | None = None  # the same step so, where "auto" would take it
    host_tier: bool = False  # plans may offload saved activations to host memory and stream frozen weights
    with_host_tier: StepEstimate | None = None  # the same step so, where host_tier="auto" would take it
    # the optimizer's state, a copy of each trainable weight and the step on the host (then
    # ``optimizer_state_bytes`` is the device's: none), and what that step adds to a step's time
    host_state_bytes: int = 0
    host_step_seconds: float = 0.0
    host_master_dtype: str | None = None  # the masters' dtype where wider than the weights' (``fp32_master_weights``)
    host_parameters: tuple[int, int] | None = None  # (hosted, trainable) where only part of the state is there
    step_seconds: float = 0.0  # the unplanned forward and backward on the device model (its roofline)
    budget_arguments: str = ONE_DEVICE_BUDGET_ARGUMENTS  # ``TrainingStep.budget_arguments``
    max_slowdown: float | None = DEFAULT_MAX_SLOWDOWN  # the strategy's: a slower step that fits is refused
    assumed: dict[str, object] = field(default_factory=dict)  # the options the estimate took as the config's
    # the device's optimizer state per trainable parameter of the target, by name (what hosting
    # a part takes off the device; not in the JSON)
    state_bytes_by_parameter: dict[str, int] = field(default_factory=dict)

    @property
    def total_step_seconds(self) -> float:
        """The step's predicted time on the device model with the plan that fits (its
        recomputation) and the optimizer's step on the host; the unplanned step where none fits."""
        recompute = self.fit.recompute_time_ratio if self.fit is not None and self.fit.recompute_time_ratio else 0.0
        return self.step_seconds * (1 + recompute) + self.host_step_seconds

    @property
    def host_slowdown(self) -> float:
        """How many times its unplanned step the step with the optimizer on the host takes (1: none
        there): what the strategies' ``max_slowdown`` is checked against."""
        return (self.step_seconds + self.host_step_seconds) / max(self.step_seconds, 1e-9)

    @property
    def held_bytes(self) -> int:
        """On the device outside the step: parameters, optimizer state, batch, library workspace."""
        buckets = self.communication_bytes if self.layout == "ddp" else 0
        return (
            sum(self.parameter_bytes.values())
            + self.optimizer_state_bytes
            + self.batch_bytes
            + self.library_workspace_bytes
            + buckets
        )

    @property
    def activation_bytes(self) -> int:
        return max(0, self.forward_backward_peak_bytes - self.gradient_bytes - self.kernel_workspace_bytes)

    @property
    def naive_peak_bytes(self) -> int:
        return self.held_bytes + max(self.forward_backward_peak_bytes, self.optimizer_step_peak_bytes)

    @property
    def around_target_bytes(self) -> int:
        """What the step holds at its peak beyond the target's own (noise, loss, the model's other parts)."""
        return max(0, self.forward_backward_peak_bytes - self.target_naive_peak_bytes)


def _host_state(
    optimizers: Sequence[torch.optim.Optimizer], hosted: Sequence[torch.Tensor], master_dtype: torch.dtype | None
) -> tuple[int, int]:
    """The masters' bytes on the host, and theirs with the optimizer's state: a master per hosted
    weight (of ``master_dtype`` where that is wider), and the state the (fake) step made for it,
    its tensors of a widened weight's dtype widened with it (torch's optimizers make their state
    like the parameter: stepped on the master, it is the master's dtype)."""
    widened = {id(p): master_dtype_of(p, master_dtype) for p in hosted}
    masters = sum(p.numel() * widened[id(p)].itemsize for p in {id(p): p for p in hosted}.values())
    state = 0
    for optimizer in optimizers:
        for param, param_state in optimizer.state.items():
            if id(param) not in widened:
                continue
            dtype = widened[id(param)]
            for tensor in plain_tensors(param_state):
                itemsize = dtype.itemsize if tensor.dtype == param.dtype else tensor.element_size()
                state += tensor.numel() * itemsize
    return masters, masters + state


def estimate_step(
    build: Callable[[], TrainingStep],
    *,
    device: str | DeviceModel | None = None,
    device_memory: int | None = None,
    minimum: bool = True,
    step_in_backward: bool = False,
    host_tier: bool = False,
    state_on_host: bool = False,
    master_dtype: torch.dtype | None = None,
    hosted: Collection[str] | None = None,
) -> StepEstimate:
    """Estimate the training step that ``build`` makes (called under fake tensors).

    ``device_memory``: bytes of the device to fit; the estimate then says whether the step fits
    as is, and otherwise the plan that fits (or why none does). ``minimum``: also find the
    smallest device the lowest plan fits in (a solver run at an infeasible budget; seconds on
    models with hundreds of blocks). ``device``: the device modelled; by default the step's own
    (``TrainingStep.device``). ``step_in_backward``: the optimizer steps each parameter inside
    the backward (``optimizer_in_backward``). ``host_tier``: plans may offload saved activations
    to host memory and stream frozen weights from it (copies priced at the device model's host
    link rate; no host budget). ``state_on_host``: the optimizer's state and its step are on the
    host too (``optim/host_state.py``; with ``step_in_backward`` and ``host_tier``), its time the
    copies at the link rate and the step at this machine's CPU rate; ``master_dtype`` (with
    ``state_on_host``): narrower float weights get masters of that dtype there, their state made
    in it (``fp32_master_weights``); ``hosted`` (with ``state_on_host``): the names (in the
    target) of the only parameters whose state and step are there, the others stepped on the
    device inside the backward (``strategies/state_on_host.py``; None: every trainable one).

    The step is estimated in each case of its loop (``TrainingStep.gradients_at_forward``): from
    no gradients, with the last step's alive until its backward, with accumulated ones kept."""
    started = time.perf_counter()
    traces: list[Trace] = []
    with FakeTensorMode(allow_non_fake_inputs=False), _values_refused(), contextlib.ExitStack() as modelled:
        with fake_module_support():
            step = build()
        chosen = step.device if device is None else device
        model = device_model(chosen) if isinstance(chosen, str) else chosen
        if model.cuda_autocast:
            modelled.enter_context(CudaFloat32Ops())
        if model.foreach_optimizers:
            for optimizer in step.optimizers:
                for group in optimizer.param_groups:
                    if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                        group["foreach"] = True  # what torch picks on CUDA; on CPU it loops per parameter

        workspaces_below = _workspace_cap() if model.measures_workspaces else 0

        sharding = planned_sharding(step.layout, step.target, model.collectives_through_copy)

        def profile(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not traces and torch.is_grad_enabled():
                trace = record_trace(
                    module,
                    args,
                    kwargs,
                    inside_call=True,
                    measure=False,
                    workspaces_below=workspaces_below,
                    planned_sharding=sharding,
                )
                traces.append(trace)

        handle = step.target.register_forward_pre_hook(profile, with_kwargs=True)
        try:
            with torch.compiler.set_stance("force_eager"):  # a compiled optimizer (torchao's) keeps the same state
                step.optimizer_step(step.forward_backward)
        finally:
            handle.remove()
        if not traces:
            raise RuntimeError(
                f"the training step never called its target {type(step.target).__name__} with gradients enabled: "
                "nothing to estimate (is target= the module the loss is computed through?)"
            )
        parameter_bytes, seen = module_state_bytes(step.modules, model.allocation_rounding)
        optimizer_state = storage_bytes(
            (t for opt in step.optimizers for state in opt.state.values() for t in plain_tensors(state)),
            model.allocation_rounding,
            seen,
        )
        batch = (t for t in tree_flatten(step.batch)[0] if isinstance(t, torch.Tensor))
        batch_bytes = storage_bytes(batch, model.allocation_rounding, seen)
        trainable = [p for m in step.modules.values() for p in m.parameters() if p.requires_grad]
        gradient_bytes = storage_bytes(trainable, model.allocation_rounding, set())
        phases = {"forward_backward": 0, "optimizer_step": 0}
        stepper = OptimizerInBackward(step.optimizers[0]) if step_in_backward else None
        loop = LoopModel(step.gradients_at_forward)
        if stepper is not None:  # its per-byte temporaries are measured below, outside the fake tensors
            loop = loop.with_step_in_backward(parameter_step_ratio=0.0)
        try:
            for case in sorted(loop.gradients, key=_CASE_ORDER.index):  # each leaves gradients for the next
                for phase, peak in _metered_step(step, case, trainable, model.allocation_rounding, stepper).items():
                    phases[phase] = max(phases[phase], peak)
        finally:
            if stepper is not None:
                stepper.remove()
        step_model = step_model_for(step.target)
    trainable_names = {id(p): name for name, p in step.target.named_parameters() if p.requires_grad}
    state_by_name = {
        trainable_names[id(param)]: storage_bytes(plain_tensors(state), model.allocation_rounding, set())
        for optimizer in step.optimizers
        for param, state in optimizer.state.items()
        if id(param) in trainable_names
    }
    host_state_bytes, host_step_seconds = 0, 0.0
    on_host: list[nn.Parameter] = []
    if state_on_host:
        if not step_in_backward:
            raise ValueError(
                "state_on_host steps each parameter on the host inside the backward: pass step_in_backward"
            )
        on_host = trainable if hosted is None else [p for p in trainable if trainable_names.get(id(p)) in hosted]
        if hosted is not None and len({trainable_names[id(p)] for p in on_host}) != len(set(hosted)):
            raise ValueError(f"hosted names parameters the target {type(step.target).__name__} does not train")
        hosted_bytes = storage_bytes(on_host, model.allocation_rounding, set())
        master_bytes, host_state_bytes = _host_state(step.optimizers, on_host, master_dtype)
        host_ns = hosted_bytes * 2e9 / model.host_link_bytes_per_second + master_bytes * (
            host_optimizer_ns_per_byte(step.optimizers[0], dtype=master_dtype)
        )
        host_step_seconds = host_ns / 1e9
        part = None
        if hosted is not None:
            part = (frozenset(hosted), parameter_step_ratio(step.optimizers, torch.device("cpu")))
        loop = loop.with_state_on_host(host_state_bytes, host_ns, hosted=part)
        # the device's: the state of the parameters stepped there
        optimizer_state = 0 if hosted is None else optimizer_state - sum(state_by_name.get(n, 0) for n in set(hosted))
    elif stepper is not None:  # per byte, measured on this CPU's allocator
        loop = loop.with_step_in_backward(parameter_step_ratio(step.optimizers, torch.device("cpu")))
    trace = traces[0]
    model.round_storages(trace)
    model.fill_costs(trace)
    # the metered step ran on one device: what FSDP2 changes in the target's forward and backward
    # is the simulation's with the units' spans against the same trace without them
    one_device = dataclasses.replace(trace, fsdp=Gathers()) if trace.fsdp.spans else None
    if one_device is not None:  # the last step's gradients, where alive, are sharded
        trace.parameter_grad_bytes = -(-trace.parameter_grad_bytes // trace.fsdp.world)
    solver = Solver(
        Simulator(trace, step_model, loop=loop),
        selective=step_model.backward_passes == 1,
        offload=host_tier,
        stream=host_tier and step.layout.kind != "fsdp2",  # FSDP2 shards frozen weights: none streams
    )
    target_naive = solver.naive().peak_bytes
    # what the kernels allocate beyond their outputs, where it falls in the step (measured here)
    unworked = dataclasses.replace(
        trace, event_workspace=[0] * trace.num_events, event_forward_workspace=[0] * trace.num_events
    )
    kernel_workspace = max(
        0, target_naive - Simulator(unworked, step_model, loop=loop).run([Option.KEEP] * len(trace.nodes)).peak_bytes
    )
    sharded_minus_one_device = 0
    if one_device is not None:
        plain = Simulator(one_device, step_model, loop=loop).run([Option.KEEP] * len(trace.nodes)).peak_bytes
        sharded_minus_one_device = target_naive - plain
    estimate = StepEstimate(
        device=model.name,
        parameter_bytes=parameter_bytes,
        trainable_parameters=sum(p.numel() for p in {id(p): p for p in trainable}.values()),
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=optimizer_state,
        batch_bytes=batch_bytes,
        library_workspace_bytes=model.library_workspace_bytes,
        forward_backward_peak_bytes=phases["forward_backward"] + kernel_workspace + sharded_minus_one_device,
        kernel_workspace_bytes=kernel_workspace,
        unmeasured_workspace_ops=trace.unmeasured_workspaces,
        optimizer_step_peak_bytes=phases["optimizer_step"],
        target=type(step.target).__name__,
        target_naive_peak_bytes=target_naive,
        minimum_device_bytes=None,
        minimum_plan_recompute_time_ratio=None,
        estimate_seconds=0.0,
        step_model=step_model.name,
        gradients_at_forward=loop.gradients,
        step_in_backward=step_in_backward,
        host_tier=host_tier,
        host_state_bytes=host_state_bytes,
        host_step_seconds=host_step_seconds,
        host_master_dtype=(
            str(master_dtype).removeprefix("torch.")
            if master_dtype is not None and any(master_dtype_of(p, master_dtype) != p.dtype for p in trainable)
            else None
        ),
        step_seconds=(solver.sim.step_ns - loop.step_inside_ns) / 1e9,
        host_parameters=None if hosted is None else (len(on_host), len(trainable_names)),
        state_bytes_by_parameter=state_by_name,
        budget_arguments=step.budget_arguments,
    )
    per_rank(estimate, step.layout, step.target, {name: step.modules[name] for name in step.sharded_copies})
    if minimum:
        _find_minimum(estimate, solver)
    if device_memory is not None:
        estimate.fit = _fit(estimate, solver, device_memory)
    estimate.estimate_seconds = time.perf_counter() - started
    return estimate


_CASE_ORDER = [PriorGradients.RELEASED, PriorGradients.UNTIL_BACKWARD, PriorGradients.ACCUMULATED]


def _metered_step(
    step: TrainingStep,
    case: PriorGradients,
    trainable: list[nn.Parameter],
    rounding: int,
    stepper: OptimizerInBackward | None = None,
) -> dict[str, int]:
    """One step under the live-bytes meter in ``case``: the peaks of its forward and backward and
    of its optimizer step, above what is held (the gradients alive at its start counted); with
    ``stepper``, each parameter stepped inside the backward."""
    if case is PriorGradients.RELEASED:
        clear_grads(step)
    zero_grad = step.zero_grad_before_backward if case is PriorGradients.UNTIL_BACKWARD else None
    gc.collect()
    phases: dict[str, int] = {}
    with LiveBytes(rounding) as meter:
        meter.count([p.grad for p in trainable if p.grad is not None])

        def metered_closure() -> Any:
            with stepping(stepper):
                result = step.forward_backward()
            phases["forward_backward"] = meter.peak
            meter.reset_peak()
            return result

        if zero_grad is not None:
            zero_grad(True)
        try:
            with torch.compiler.set_stance("force_eager"):
                step.optimizer_step(metered_closure)
        finally:
            if zero_grad is not None:
                zero_grad(False)
        phases["optimizer_step"] = meter.peak
    return phases


def stepping(stepper: OptimizerInBackward | None) -> contextlib.AbstractContextManager[None]:
    """``stepper``'s stepping block (nothing without one): run a closure in it, and the optimizer's
    own step after the closure finds no gradient left to step."""
    return contextlib.nullcontext() if stepper is None else stepper.stepping()


def storage_bytes(tensors: Any, rounding: int, seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (which it extends), each rounded (a
    quantized weight's are its inner tensors')."""
    total = 0
    for tensor in plain_tensors(list(tensors)):
        key = storage_key(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            total += rounded(tensor.untyped_storage().nbytes(), rounding)
    return total


def module_state_bytes(modules: dict[str, nn.Module], rounding: int) -> tuple[dict[str, int], set[int]]:
    """Bytes of each module's parameters and buffers (a storage shared by two counts once), and
    the storages counted."""
    seen: set[int] = set()
    sizes = {
        name: storage_bytes([*module.parameters(), *module.buffers()], rounding, seen)
        for name, module in modules.items()
    }
    return sizes, seen


def clear_grads(step: TrainingStep) -> None:
    """Free every gradient the step's module and optimizers hold (estimates start without them)."""
    if step.zero_grad is not None:
        step.zero_grad()
    for optimizer in step.optimizers:
        optimizer.zero_grad(set_to_none=True)


def _plan_ratios(solver: Solver, result: Any) -> tuple[float, float]:
    trace = solver.sim.trace
    time_ratio = result.recompute_cost / max(solver.sim.step_ns, 1.0)
    flop_ratio = result.recompute_flops / max(3 * sum(trace.event_flops), 1)
    return time_ratio, flop_ratio


def _workspace_cap() -> int:
    """The largest op whose workspace a CPU estimate measures on real stand-ins: an eighth of
    the memory available now (a model larger than this machine is estimated without them)."""
    return psutil.virtual_memory().available // 8


def _find_minimum(estimate: StepEstimate, solver: Solver) -> None:
    """The smallest device the lowest plan fits in, and what that plan recomputes.

    The lowest plan is the one ``Solver.lowest`` finds (descents that rank moves by bytes alone):
    the same plan the planner falls back to at that budget, so the device size named here is
    one a plan really reaches. Its recomputation is the cost-blind plan's (an upper bound: the
    planner, given that budget, may find a cheaper plan of the same peak)."""
    lowest = solver.lowest(-(1 << 62))[1]  # no plan fits: the plan of the lowest peak (below zero if it streams)
    step_bytes = estimate.around_target_bytes + min(solver.naive().peak_bytes, budget_for_peak(lowest.peak_bytes))
    # the optimizer steps after the backward, streamed weights back on the host
    optimizer = estimate.optimizer_step_peak_bytes - lowest.streamed_bytes
    estimate.minimum_device_bytes = estimate.held_bytes + max(step_bytes, optimizer)
    estimate.minimum_plan_recompute_time_ratio = _plan_ratios(solver, lowest)[0]
    estimate.minimum_plan_host_bytes = lowest.host_peak_bytes


def _fit(estimate: StepEstimate, solver: Solver, device_memory: int) -> PlanFit:
    fit = PlanFit(device_memory, fits_without_plan=estimate.naive_peak_bytes <= device_memory, fits_with_plan=False)
    optimizer_alone = (
        "the optimizer step alone does not fit (parameters, gradients, optimizer state and its temporaries): "
        "no activation plan helps; shard the model (FSDP2), train fewer parameters (LoRA) or use a "
        "larger device"
    )
    # with the host tier a plan may stream frozen weights, which are off the device at the optimizer step
    if not estimate.host_tier and estimate.held_bytes + estimate.optimizer_step_peak_bytes > device_memory:
        fit.reason = optimizer_alone
        fit.short_bytes = estimate.held_bytes + estimate.optimizer_step_peak_bytes - device_memory
        return fit
    fit.budget_bytes = device_memory - estimate.held_bytes - estimate.around_target_bytes
    try:
        solution = solver.solve(fit.budget_bytes)
    except InfeasibleBudgetError as error:
        fit.reason = f"no plan fits: {error}"
        fit.short_bytes = error.minimum_step_bytes - fit.budget_bytes
        return fit
    planned = solution.result
    optimizer = estimate.optimizer_step_peak_bytes - planned.streamed_bytes
    if estimate.held_bytes + optimizer > device_memory:
        fit.short_bytes = estimate.held_bytes + optimizer - device_memory
        fit.reason = optimizer_alone + (
            ", even with the plan's weights streamed from the host" if planned.streamed_bytes else ""
        )
        return fit
    fit.fits_with_plan = True
    fit.predicted_peak_bytes = estimate.held_bytes + max(estimate.around_target_bytes + planned.peak_bytes, optimizer)
    fit.recompute_time_ratio, fit.recompute_flop_ratio = _plan_ratios(solver, planned)
    fit.planned_blocks = sum(1 for option in solution.options[1:] if option)
    fit.host_peak_bytes = planned.host_peak_bytes
    return fit
