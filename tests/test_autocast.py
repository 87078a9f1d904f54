"""Plans under torch's autocast, whose cache keeps every trainable weight's low-precision copy
until its context exits.

``torch.autocast`` (cache on, its default) casts a float32 parameter once per context and keeps
the copy; the training loop closes the context after the loss, before the backward (torch's AMP
recipe), and from then on a copy lives only as long as an op saved it. The profile sees the copies
alive when the forward ends: counted through the whole step, a checkpointed block's copies looked
held at the backward's peak whatever the plan, and the lowest plan of a cross-attention U-Net stayed
far above diffusers' own checkpointing. Lightning's precision plugins turn the cache off, so this
is the step of scripts that call ``rematerialize`` under their own autocast (diffusers' examples
through accelerate, this project's benchmarks).
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop_truth import _assert_the_promise_holds, _fit
from test_plan_fidelity import _measured as measured_peak
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy, rematerialize
from lightning_tbp.privacy import attach
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.loss import assumed_loss_bytes
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import Solver
from lightning_tbp.testing.zoo_lightning import ZooModule
from lightning_tbp.testing.zoo_models import ZOO, ZooCase, sample

TOLERANCE = 0.05


def _autocast(cache: bool = True) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)


def _step(case: ZooCase) -> None:
    """Forward and loss under autocast, the backward after it closed (torch's AMP recipe)."""
    with _autocast():
        loss = case.loss()
    loss.backward()


def _measured(case: ZooCase) -> int:
    return measured_peak(case.model, lambda: _step(case))


def _gradients(case: ZooCase) -> dict[str, torch.Tensor]:
    case.model.zero_grad(set_to_none=True)
    _step(case)
    return {name: p.grad.clone() for name, p in case.model.named_parameters() if p.grad is not None}


def test_the_lowest_plan_under_autocast_goes_below_diffusers_checkpointing() -> None:
    """An SDXL-style U-Net under bf16 autocast: the lowest plan the planner names runs within its
    budget and 5% of its prediction, below diffusers' ``enable_gradient_checkpointing()``, with
    the gradients of the plain step (its lowest plan had peaked 1.4x above diffusers')."""
    architecture = ZOO["sdxl_unet"]
    diffusers = architecture.case(batch=4)
    diffusers.model.enable_gradient_checkpointing()
    diffusers_peak = _measured(diffusers)
    case = architecture.case(batch=4)
    reference = _gradients(case)
    with pytest.raises(InfeasibleBudgetError) as error, _autocast():
        rematerialize(case.model, *case.args, memory_budget=1, **case.kwargs)
    with _autocast():
        plan = rematerialize(case.model, *case.args, memory_budget=error.value.minimum_budget_bytes, **case.kwargs)
    try:
        shape_plan = plan.current
        assert shape_plan is not None
        measured = _measured(case)
        assert measured <= shape_plan.budget_bytes
        assert abs(measured / shape_plan.predicted_peak_bytes - 1) <= TOLERANCE
        assert measured < diffusers_peak, (measured, diffusers_peak)
        for name, gradient in _gradients(case).items():
            assert torch.equal(gradient, reference[name]), name
    finally:
        plan.remove()


def test_the_trace_names_the_copies_autocast_caches() -> None:
    """Trainable weights' casts under autocast with its cache, and nothing else: none without
    the cache (Lightning's plugins), none of frozen weights (autocast caches leaves that need a
    gradient only), none without autocast."""
    case = ZOO["sdxl_unet"].case(batch=2)
    call = (case.model, case.args, case.kwargs)
    with _autocast():
        cached = record_trace(*call, measure=False).autocast_cached
    assert cached
    with _autocast(cache=False):
        assert not record_trace(*call, measure=False).autocast_cached
    assert not record_trace(*call, measure=False).autocast_cached
    case.model.requires_grad_(False)
    with _autocast():
        assert not record_trace(*call, measure=False).autocast_cached


@settings(max_examples=4, derandomize=True, deadline=None)
@given(seed=st.integers(0, 2**16), moves=st.integers(4, 40))
def test_any_mix_of_options_under_autocast_is_predicted(seed: int, moves: int) -> None:
    """Random legal plans (full, selective, lazy, offloaded to the host tier, nested) drawn by
    moves from the plain model, each predicted within 5% of its measured peak under autocast (an
    offloaded block's saved weight copies go to the host; the cache keeps the device copies until
    the backward starts)."""
    case = ZOO["sdxl_unet"].case(batch=2)
    with _autocast():
        trace = record_trace(case.model, case.args, case.kwargs)
    simulator = Simulator(trace, loss_bytes=assumed_loss_bytes(trace.output_specs))
    solver = Solver(simulator, offload=True)
    draw = random.Random(seed)
    options = [Option.KEEP] * len(trace.nodes)
    for _ in range(moves):
        legal = solver.legal_moves(options)
        if not legal:
            break
        options = solver.apply(options, *draw.choice(legal))
    predicted = simulator.run(options).peak_bytes
    planned = {trace.nodes[i].key: o for i, o in enumerate(options) if i > 0 and o != Option.KEEP}
    limits = {trace.nodes[i].key: simulator.cache_limit(i) for i, o in enumerate(options) if o == Option.SELECTIVE}
    wrappers = InstalledWrappers(case.model, planned, limits)
    wrappers.ensure(planned)
    try:
        measured = _measured(case)
    finally:
        wrappers.remove()
    assert abs(measured / predicted - 1) <= TOLERANCE, (measured, predicted, planned)


def test_a_backward_inside_autocast_is_named_with_its_fix(caplog: pytest.LogCaptureFixture) -> None:
    """The plan assumes the context closes before the backward; a metered backward inside it
    (the cache keeping every copy through it, past the plan's prediction) is named once, with
    the two ways out."""
    case = ZOO["sdxl_unet"].case(batch=2)
    with _autocast():
        plan = rematerialize(case.model, *case.args, memory_budget=0.95, **case.kwargs)

    def inside() -> None:
        with _autocast():
            case.loss().backward()

    try:
        with caplog.at_level("WARNING", logger="lightning_tbp"):
            plan.verify(lambda: _step(case))
            case.model.zero_grad(set_to_none=True)
            assert "inside torch.autocast" not in caplog.text
            for _ in range(2):  # past its budget it re-plans, or names the minimum a correction would need
                with contextlib.suppress(InfeasibleBudgetError):
                    plan.verify(inside)
                case.model.zero_grad(set_to_none=True)
        assert caplog.text.count("inside torch.autocast") == 1
        assert "Close the autocast context before calling backward" in caplog.text
    finally:
        plan.remove()


@pytest.mark.parametrize(
    ("name", "mode"), [pytest.param("sdxl_unet", "ghost", marks=pytest.mark.slow), ("dit", "bookkeeping")]
)
def test_a_dp_step_under_autocast_keeps_its_lowest_plans_word(name: str, mode: str) -> None:
    """A DP step under autocast: the copies its ops saved stay through every backward pass (and
    bookkeeping's replays), the cache's references go where the first starts; the engine's
    per-layer transients are measured with autocast off, as the backward runs them (measured
    inside the caller's context, they carried its casts: the DiT under bookkeeping measured
    0.887 of its prediction)."""
    case = ZOO[name].case(batch=4)
    model = case.model.eval()  # no dropout: the per-sample loss must not depend on the batch
    engine = attach(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)

    def step() -> None:
        engine.probe_next_step()
        with _autocast():
            loss = (sample(model(*case.args, **case.kwargs)).float() - case.target).square().flatten(1).mean(dim=1)
        engine.backward(loss)

    plan = None
    try:
        with pytest.raises(InfeasibleBudgetError) as error, _autocast():
            rematerialize(model, *case.args, memory_budget=1, **case.kwargs)
        with _autocast():
            plan = rematerialize(model, *case.args, memory_budget=error.value.minimum_budget_bytes, **case.kwargs)
        shape_plan = plan.current
        assert shape_plan is not None
        peak = measured_peak(model, step)
        assert peak <= shape_plan.budget_bytes
        assert abs(peak / shape_plan.predicted_peak_bytes - 1) <= TOLERANCE
    finally:
        if plan is not None:
            plan.remove()
        engine.detach()


@pytest.mark.slow
def test_a_whole_fit_under_the_users_own_autocast_holds_its_lowest_plan() -> None:
    """A LightningModule that runs its step under its own ``torch.autocast`` (cache on; Lightning
    closes it before the backward): the profile's casts are cached, so the real forward takes
    them from the cache and a selective block's recomputation would cast again (torch raised);
    no selective block is planned. Every step of the fit, the first included, within the lowest
    budget named and 5% of the prediction."""

    class AutocastZoo(ZooModule):
        @override
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            with _autocast():
                return super().training_step(batch, batch_idx)

    def run(budget: float) -> dict:
        module = AutocastZoo("sdxl_unet", batch=4)
        loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=4)
        strategy = TinyBackpropStrategy(memory_budget=budget, host_tier="off", optimizer_in_backward=False)
        return _fit(module, loader, strategy, max_steps=4)

    with pytest.raises(InfeasibleBudgetError) as error:
        run(1)
    lowest = math.ceil(1000 * error.value.minimum_step_bytes / error.value.naive_bytes) / 1000
    fit = run(lowest)
    _assert_the_promise_holds(fit)
    assert Option.SELECTIVE not in fit["plan"].options.values()
