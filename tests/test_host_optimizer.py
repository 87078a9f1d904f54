"""The optimizer's state and step on the host (``optim/host_state.py``): weights equal to the
ordinary step's, bit for bit (for every per-parameter optimizer in
``test_optimizer_in_backward.py``); the state off the exact CPU meter (the emulated device) and out of
what training holds; and whole fits of full fine-tunes under device budgets below what they
reach with the state on the device, the planner taking it by itself."""

from __future__ import annotations

import gc

import lightning as L
import pytest
import torch
from test_loop_truth import _fit
from test_optimizer_in_backward import _pair
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, StallingPlanError, TinyBackpropFSDP2Strategy, TinyBackpropStrategy
from lightning_tbp.memory.breakdown import tensor_bytes
from lightning_tbp.memory.held import held_memory
from lightning_tbp.memory.meters import allocator_peak
from lightning_tbp.optim import OptimizerInBackward
from lightning_tbp.optim.host_state import HostOptimizerState
from lightning_tbp.optim.step_cost import NO_COST, host_step_cost, in_backward_step_cost
from lightning_tbp.remat.host_tier import host_use
from lightning_tbp.testing.zoo_lightning import ZooModule

CPU = torch.device("cpu")


def test_the_state_leaves_the_meter_and_what_training_holds() -> None:
    """The exact CPU meter of the training thread (the emulated device) sees the gradients and
    no state; held memory counts no state, made or to come; the host ledger counts it all."""
    peaks = {}
    for on_host in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stepper = OptimizerInBackward(optimizer)
        if on_host:
            before = host_use.live
            stepper.host = HostOptimizerState(optimizer)
            assert held_memory(model, [optimizer], CPU).optimizer_state == 0  # none to come either
        x = torch.randn(8, 512)
        readings = []
        for _ in range(2):
            gc.collect()
            with allocator_peak(CPU) as reading, stepper.stepping():
                model(x).sum().backward()
            readings.append(reading.peak_bytes)
        peaks[on_host] = readings
        weights = sum(p.numel() * 4 for p in model.parameters())
        state = tensor_bytes(model, [optimizer], CPU).optimizer_state
        assert (state == 0) if on_host else (state >= 2 * weights)  # two moments per weight
        if on_host:
            # the masters and the two moments (and step counts) on the host
            assert host_use.live - before >= 3 * weights
            stepper.remove()
            assert held_memory(model, [optimizer], CPU).optimizer_state >= 2 * weights  # the device's again
    state_made = 2 * sum(p.numel() * 4 for p in model.parameters())
    assert peaks[False][0] - peaks[True][0] >= state_made  # the first step made the state on the device
    assert peaks[True][0] == peaks[True][1]


def test_a_state_made_on_the_device_moves_to_the_host_and_steps_on() -> None:
    """Taken after some ordinary steps (the planner adopts it when a budget needs it): the state
    made so far goes to the host, and the weights go on as the ordinary steps'."""
    plain, plain_opt, hosted, hosted_opt = _pair("adamw")
    stepper = OptimizerInBackward(hosted_opt)
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((plain, plain_opt), (hosted, hosted_opt)):
            optimizer.zero_grad()
            if step == 2 and model is hosted:
                stepper.host = HostOptimizerState(hosted_opt)
            if model is hosted and step >= 2:
                with stepper.stepping():
                    model(x).backward()
            else:
                model(x).backward()
                optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), hosted.parameters(), strict=True))
    saved = hosted_opt.state_dict()
    assert torch.equal(saved["state"][0]["exp_avg"], plain_opt.state_dict()["state"][0]["exp_avg"])


def test_the_steps_are_priced_per_parameter_and_per_byte() -> None:
    """Each parameter stepped alone costs something on its own (a small model's many tensors pay
    mostly that), the more on the host (the copies and the hand-over to its worker thread, timed
    in one process: the median of three, so compared with room for noise); a frozen model's
    step costs nothing."""
    optimizer = torch.optim.AdamW(torch.nn.Linear(64, 64).parameters())
    device = in_backward_step_cost(optimizer, CPU, numel=1 << 16)
    host = host_step_cost(optimizer, CPU, numel=1 << 16)
    assert device.per_tensor_ns > 0 and device.per_byte_ns >= 0.0 and host.per_tensor_ns > 0
    assert host.of(10, 1 << 20) > 0.5 * device.of(10, 1 << 20)
    assert host.of(2, 0) == 2 * host.per_tensor_ns
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    assert host_step_cost(torch.optim.AdamW(frozen.parameters()), CPU) == NO_COST


# -- whole fits, chosen by the planner ------------------------------------------------------------


def _minimum(name: str, host_tier: str) -> int:
    """The smallest device budget a fit of ``name`` can meet, as its refusal names it."""
    module = ZooModule(name, batch=2)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    with pytest.raises(InfeasibleBudgetError) as error:
        _fit(module, loader, TinyBackpropStrategy(memory_budget=1 << 10, host_tier=host_tier), max_steps=1)
    fits = next(n for n in error.value.__notes__ if "or more fits" in n)
    assert int(fits.split("(")[-1].split(" bytes")[0]) == error.value.minimum_device_bytes  # as the note says
    return error.value.minimum_device_bytes


def _three_steps(module: L.LightningModule, loader: DataLoader, strategy: TinyBackpropStrategy | None = None) -> None:
    torch.manual_seed(0)
    L.Trainer(
        strategy=strategy or "auto",
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, loader)


def _assert_ends_as_the_plain_fit(module: L.LightningModule, name: str, loader: DataLoader) -> None:
    reference = ZooModule(name, batch=2)
    _three_steps(reference, loader)
    for (path, a), b in zip(reference.named_parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b), path


def _assert_every_step_keeps_its_word(steps: list[dict]) -> None:
    assert [s["step"] for s in steps][:3] == [0, 1, 2]  # the first steps metered
    for step in steps:
        assert step["peak_bytes"] <= step["budget_bytes"], step
        assert abs(step["ratio"] - 1) <= 0.05, step


def _assert_full_fine_tune_fits_with_the_state_on_the_host(name: str) -> None:
    """Below the lowest device budget reachable with the state on the device (every other action
    taken), a whole fit keeps the budget and the prediction on every metered step and ends with
    the weights of the plain fit."""
    on_device, on_host = _minimum(name, "off"), _minimum(name, "auto")
    module = ZooModule(name, batch=2)
    state = 2 * sum(p.numel() * p.element_size() for p in module.parameters())
    assert on_host <= on_device - state // 2, (on_host, on_device)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    run = _fit(module, loader, TinyBackpropStrategy(memory_budget=(on_host + on_device) // 2), max_steps=3)
    plan = run["plan"]
    assert plan.loop.host_state_bytes >= state and plan.loop.step_in_backward
    assert any("the optimizer's state and step on the host" in action for action in plan.actions)
    _assert_every_step_keeps_its_word(run["loop_steps"])
    _assert_ends_as_the_plain_fit(module, name, loader)


@pytest.mark.filterwarnings("ignore:.*planning at training step")
def test_an_sdxl_style_full_fine_tune_fits_with_its_adam_state_on_the_host() -> None:
    _assert_full_fine_tune_fits_with_the_state_on_the_host("sdxl_unet")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*planning at training step")
@pytest.mark.parametrize("name", ["dit", "sd3", "wan", "auraflow"])
def test_more_full_fine_tunes_fit_with_their_state_on_the_host(name: str) -> None:
    _assert_full_fine_tune_fits_with_the_state_on_the_host(name)


@pytest.mark.filterwarnings("ignore:.*planning at training step")
def test_with_the_step_kept_after_the_backward_the_error_names_the_host_state_and_why_not() -> None:
    module = ZooModule("sdxl_unet", batch=2)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    budget = sum(p.numel() * p.element_size() for p in module.parameters()) * 3 // 2
    with pytest.raises(InfeasibleBudgetError) as raised:
        _fit(module, loader, TinyBackpropStrategy(memory_budget=budget, optimizer_in_backward=False), max_steps=1)
    notes = "\n".join(raised.value.__notes__)
    assert "the optimizer's state and step on the host" in notes
    assert "optimizer_in_backward=False keeps the step after the backward" in notes


@pytest.mark.filterwarnings("ignore:.*planning at training step")
def test_a_fit_whose_host_step_would_stall_it_is_refused_before_its_first_step() -> None:
    """The host's optimizer step counts in the predicted slowdown: under a limit below it, the
    fit stops at its first batch, naming that part, with the weights untouched."""
    module = ZooModule("dit", batch=2)
    before = [p.detach().clone() for p in module.parameters()]
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    strategy = TinyBackpropStrategy(memory_budget=0.5, optimizer_state_on_host=True, max_slowdown=1.0)
    with pytest.raises(StallingPlanError) as refused:
        _three_steps(module, loader, strategy)
    # the host's part is its step's measured time less the device step's: on this CPU both run
    # on the same cores and a busy machine can time it at zero, so only its place is asserted
    host_part = refused.value.parts["the optimizer's step and copies on the host"]
    assert host_part >= 0
    named = [part for part, ns in refused.value.parts.items() if ns > 0]
    assert named and all(part in str(refused.value) for part in named)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    for bad in (0.9, True):
        with pytest.raises(ValueError, match="max_slowdown must be a factor >= 1"):
            TinyBackpropStrategy(max_slowdown=bad)


def test_the_state_on_the_host_from_the_start_is_an_option_refused_by_name_where_it_cannot_run() -> None:
    for options, named in (
        ({"optimizer_in_backward": False}, "optimizer_in_backward=False"),
        ({"host_tier": "off"}, "host_tier='off'"),
    ):
        with pytest.raises(ValueError, match=named):
            TinyBackpropStrategy(optimizer_state_on_host=True, **options)
    with pytest.raises(ValueError, match="tiny_backprop_fsdp2"):
        TinyBackpropFSDP2Strategy(optimizer_state_on_host=True)
    with pytest.raises(ValueError, match="must be True, False or 'auto'"):
        TinyBackpropStrategy(optimizer_state_on_host="yes")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:.*planning at training step")
@pytest.mark.parametrize("budget", [None, 0.5])
def test_the_state_on_the_host_from_the_start_trains_as_the_plain_fit(budget: float | None) -> None:
    """``optimizer_state_on_host=True``: from the first step (with no plan, or a plan that counts
    it), every metered step within the budget and the prediction, the weights the plain fit's."""
    module = ZooModule("dit", batch=2)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    strategy = TinyBackpropStrategy(memory_budget=budget, optimizer_state_on_host=True)
    _three_steps(module, loader, strategy)
    if budget is not None:
        assert strategy.plan is not None
        shape_plan = list(strategy.plan.shape_plans.values())[-1]
        assert shape_plan.loop.host_state_bytes > 0 and not shape_plan.actions
        _assert_every_step_keeps_its_word(strategy.loop_steps())
    _assert_ends_as_the_plain_fit(module, "dit", loader)
