"""The optimizer's state and step on the host (``optim/host_state.py``): weights equal to the
ordinary step's, bit for bit (for every per-parameter optimizer in
``test_optimizer_in_backward.py``); the state off the exact CPU meter (the emulated device) and out of
what training holds; and whole fits of full fine-tunes under device budgets below what they
reach with the state on the device, the planner taking it by itself."""

from __future__ import annotations

import gc
import warnings
from typing import Any

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
from lightning_tbp.optim import OptimizerInBackward, step_cost
from lightning_tbp.optim.host_state import HostOptimizerState, fewest_to_host, host_bytes_with_masters, hostings
from lightning_tbp.optim.step_cost import NO_COST, host_step_cost, in_backward_step_cost
from lightning_tbp.remat.host_tier import host_use
from lightning_tbp.strategies import state_on_host
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


def test_steps_queued_on_the_worker_overlapping_the_backward_step_as_the_device_does() -> None:
    """The CUDA order on this CPU: each host step queued on the worker thread while the backward
    goes on (``overlapped``), waited for as the block ends. A DiT with dropout (its RNG seeded
    alike for both runs) over three Adam steps ends at the device step's weights, bit for bit."""
    import copy

    from lightning_tbp.testing.zoo_models import ZOO, sample

    case = ZOO["dit"].case(batch=2)
    hosted = copy.deepcopy(case.model)
    for model in (case.model, hosted):
        torch.manual_seed(1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        stepper = OptimizerInBackward(optimizer)
        if model is hosted:
            stepper.host = HostOptimizerState(optimizer)
            stepper.host.overlapped = True
        for _ in range(3):
            with stepper.stepping():
                sample(model(*case.args, **case.kwargs)).float().square().mean().backward()
        stepper.remove()
    for (name, a), b in zip(case.model.named_parameters(), hosted.parameters(), strict=True):
        assert torch.equal(a, b), name


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


def _three_steps(
    module: L.LightningModule,
    loader: DataLoader,
    strategy: TinyBackpropStrategy | None = None,
    ckpt_path: str | None = None,
    **trainer_options: Any,
) -> L.Trainer:
    """A fit of three steps (or ``max_steps``) on one CPU, seeded, with no logs or checkpoints
    unless ``trainer_options`` ask for them; returns its trainer."""
    torch.manual_seed(0)
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    trainer = L.Trainer(strategy=strategy or "auto", **{**options, **trainer_options})
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


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
    # all of the state, or the part the budget needs where that is predicted faster (timed here)
    hosted = plan.loop.hosted_parameters
    assert plan.loop.host_state_bytes >= (state if hosted is None else 1) and plan.loop.step_in_backward
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


# -- float32 masters of a bf16 model ---------------------------------------------------------------


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)).to(torch.bfloat16)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)


def _reference_with_masters(steps: int, lr: float) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The classic recipe, by hand: float32 masters, AdamW on them over the bf16 gradients
    widened, the bf16 weights the masters rounded after each step."""
    model = _bf16_model()
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=lr)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(_batch(step)).square().mean().backward()
        for param, master in zip(model.parameters(), masters, strict=True):
            master.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters, strict=True):
                param.copy_(master)
    return model, masters


def _hosted_with_masters(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, OptimizerInBackward]:
    model = _bf16_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    stepper = OptimizerInBackward(optimizer)
    stepper.host = HostOptimizerState(optimizer, master_dtype=torch.float32)
    return model, optimizer, stepper


def _hosted_steps(model: torch.nn.Module, stepper: OptimizerInBackward, steps: range) -> None:
    for step in steps:
        with stepper.stepping():
            model(_batch(step)).square().mean().backward()


def test_fp32_masters_step_a_bf16_model_as_a_float32_optimizer_over_its_widened_weights() -> None:
    """Bit for bit the hand-written recipe; the state and the masters float32 on the host; and an
    update the bf16 weights alone would lose is kept (the plain bf16 step ends elsewhere)."""
    lr, steps = 1e-4, 6
    reference, reference_masters = _reference_with_masters(steps, lr)
    model, optimizer, stepper = _hosted_with_masters(lr)
    _hosted_steps(model, stepper, range(steps))
    for (path, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b), path
    assert stepper.host is not None and len(stepper.host.widened) == 4
    for master, expected in zip(optimizer.param_groups[0]["params"], reference_masters, strict=True):
        assert master.dtype == torch.float32 and torch.equal(master, expected)
        assert optimizer.state[master]["exp_avg"].dtype == torch.float32
    plain = _bf16_model()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=lr)
    for step in range(steps):
        plain_optimizer.zero_grad()
        plain(_batch(step)).square().mean().backward()
        plain_optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    # the masters hold what bf16 cannot: some differ from their weights widened
    assert any(not torch.equal(m, p.float()) for m, p in zip(reference_masters, model.parameters(), strict=True))
    stepper.remove()
    # the masters stay with the state, so a checkpoint saved after training carries them
    kept = [optimizer.state[p]["lightning_tbp_master"] for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(kept, reference_masters, strict=True))


def test_masters_that_no_longer_round_to_the_weights_are_dropped_with_a_warning() -> None:
    """Masters left in the state by an earlier run go on in the next run over the same optimizer;
    once the weights moved without them, they are stale: dropped, said, and the run goes on from
    the weights."""
    lr = 1e-4
    model, optimizer, stepper = _hosted_with_masters(lr)
    _hosted_steps(model, stepper, range(2))
    stepper.remove()
    again = OptimizerInBackward(optimizer)
    again.host = HostOptimizerState(optimizer, master_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fresh masters: nothing dropped
        _hosted_steps(model, again, range(2, 3))
    again.remove()
    with torch.no_grad():  # the weights move without the masters (say, other weights loaded)
        for param in model.parameters():
            param.mul_(1.5)
    stale = OptimizerInBackward(optimizer)
    stale.host = HostOptimizerState(optimizer, master_dtype=torch.float32)
    with pytest.warns(UserWarning, match="masters are dropped: they do not round to the weights"):
        _hosted_steps(model, stale, range(3, 4))
    assert stale.host is not None
    for param, master in zip(model.parameters(), optimizer.param_groups[0]["params"], strict=True):
        assert torch.equal(master.to(param.dtype), param)  # stepped from the weights, not the stale masters


def test_a_checkpoint_carries_the_fp32_masters_and_a_resumed_run_goes_on_bitwise() -> None:
    """Saved after 3 steps and loaded into a fresh optimizer over the bf16 weights (as Lightning
    restores one), the run goes on from the float32 masters, not from their rounding."""
    lr = 1e-4
    straight, _, straight_stepper = _hosted_with_masters(lr)
    _hosted_steps(straight, straight_stepper, range(6))
    first, first_optimizer, first_stepper = _hosted_with_masters(lr)
    _hosted_steps(first, first_stepper, range(3))
    saved = first_optimizer.state_dict()
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    resumed = _bf16_model()
    resumed.load_state_dict(weights)
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=lr)
    stepper = OptimizerInBackward(optimizer)
    stepper.host = HostOptimizerState(optimizer, master_dtype=torch.float32)  # set up before the restore
    optimizer.load_state_dict(saved)
    _hosted_steps(resumed, stepper, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    # without the masters in the checkpoint the run would go on from the rounded weights
    rounded = _bf16_model()
    rounded.load_state_dict(weights)
    rounded_optimizer = torch.optim.AdamW(rounded.parameters(), lr=lr)
    rounded_stepper = OptimizerInBackward(rounded_optimizer)
    rounded_stepper.host = HostOptimizerState(rounded_optimizer, master_dtype=torch.float32)
    without = {
        **saved,
        "state": {k: {n: v for n, v in s.items() if n != "lightning_tbp_master"} for k, s in saved["state"].items()},
    }
    rounded_optimizer.load_state_dict(without)
    _hosted_steps(rounded, rounded_stepper, range(3, 6))
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), rounded.parameters(), strict=True))


def test_the_host_bytes_with_fp32_masters_are_predicted_before_the_first_step() -> None:
    """Four bytes of master and eight of AdamW state per bf16 weight, as the host ledger counts
    them (less AdamW's step counters, scalars the prediction leaves out)."""
    model, _, stepper = _hosted_with_masters(1e-4)
    numel = sum(p.numel() for p in model.parameters())
    fresh = torch.optim.AdamW(_bf16_model().parameters(), lr=1e-4)
    predicted = host_bytes_with_masters(fresh, torch.float32)
    assert predicted == 12 * numel
    _hosted_steps(model, stepper, range(1))
    assert stepper.host is not None and stepper.host.host_bytes == predicted + 4 * len(list(model.parameters()))


class _WidenedAdamW(torch.optim.Optimizer):
    """The recipe by hand as a Lightning module's optimizer: float32 masters of its bf16
    parameters, AdamW on them, the parameters the masters rounded."""

    def __init__(self, params: list[torch.nn.Parameter], **options: float) -> None:
        super().__init__(params, {})
        self.masters = [p.detach().float().clone().requires_grad_() for p in params]
        self.inner = torch.optim.AdamW(self.masters, **options)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        params = self.param_groups[0]["params"]
        for param, master in zip(params, self.masters, strict=True):
            master.grad = param.grad.float()
        self.inner.step()
        for param, master in zip(params, self.masters, strict=True):
            param.copy_(master)
        return loss


class _RecipeByHand(ZooModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _WidenedAdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


@pytest.mark.filterwarnings("ignore:.*planning at training step")
@pytest.mark.parametrize("budget", [None, 0.5])
def test_a_bf16_fit_with_fp32_masters_ends_as_the_recipe_by_hand(budget: float | None) -> None:
    """``precision="bf16-true"`` with ``fp32_master_weights=True``: the weights after three steps
    those of float32 masters stepped by hand, bit for bit; with a plan, every metered step within
    the budget and the prediction, the masters and their float32 state counted on the host."""
    module = ZooModule("dit", batch=2, lr=1e-3)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    strategy = TinyBackpropStrategy(memory_budget=budget, fp32_master_weights=True)
    assert strategy.optimizer_state_on_host is True
    _three_steps(module, loader, strategy, precision="bf16-true")
    reference = _RecipeByHand("dit", batch=2, lr=1e-3)
    _three_steps(reference, loader, precision="bf16-true")
    for (path, a), b in zip(reference.named_parameters(), module.parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b), path
    if budget is None:  # the plain bf16 fit ends elsewhere
        plain = ZooModule("dit", batch=2, lr=1e-3)
        _three_steps(plain, loader, precision="bf16-true")
        assert not all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters(), strict=True))
    else:
        assert strategy.plan is not None
        shape_plan = list(strategy.plan.shape_plans.values())[-1]
        weights = sum(p.numel() for p in module.parameters() if p.requires_grad)
        assert shape_plan.loop.host_state_bytes >= 12 * weights  # a float32 master and two moments
        _assert_every_step_keeps_its_word(strategy.loop_steps())


def test_fp32_masters_are_refused_by_name_where_they_cannot_be_kept() -> None:
    with pytest.raises(ValueError, match="optimizer_state_on_host=False keeps on the device"):
        TinyBackpropStrategy(fp32_master_weights=True, optimizer_state_on_host=False)
    with pytest.raises(ValueError, match=r"fp32_master_weights=True steps each parameter on the host.*host_tier='off'"):
        TinyBackpropStrategy(fp32_master_weights=True, host_tier="off")
    with pytest.raises(ValueError, match=r"fp32_master_weights=True.*tiny_backprop_fsdp2"):
        TinyBackpropFSDP2Strategy(fp32_master_weights=True)
    with pytest.raises(ValueError, match="must be True or False"):
        TinyBackpropStrategy(fp32_master_weights="yes")  # type: ignore[arg-type]


def test_fp32_masters_over_a_float32_model_warn_that_they_do_nothing() -> None:
    module = ZooModule("dit", batch=2)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    with pytest.warns(UserWarning, match="fp32_master_weights has nothing to widen"):
        _three_steps(module, loader, TinyBackpropStrategy(memory_budget=None, fp32_master_weights=True))
    _assert_ends_as_the_plain_fit(module, "dit", loader)


class _Mlp(L.LightningModule):
    """A bf16-trainable module whose steps draw no random numbers (a resumed run's must match)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x).float() - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_bf16_fit_resumed_from_its_checkpoint_goes_on_from_the_fp32_masters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Saved by ``ModelCheckpoint`` after two steps, or by ``trainer.save_checkpoint`` once a
    two-step fit ended, and resumed to six: the weights of six steps straight, bit for bit.
    Resumed without the option, the masters are dropped with a warning (not loaded onto the
    device as state) and the run goes on from the rounded weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = TensorDataset(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 1))
    loader = DataLoader(data, batch_size=4)

    def fit(steps: int, masters: bool, ckpt_path: str | None = None, save: bool = False) -> _Mlp:
        module = _Mlp()
        saving = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)] if save else []
        strategy = TinyBackpropStrategy(memory_budget=None, fp32_master_weights=masters)
        options = {"precision": "bf16-true", "max_steps": steps, "enable_checkpointing": save, "callbacks": saving}
        trainer = _three_steps(module, loader, strategy, ckpt_path, **options)
        if save:
            trainer.save_checkpoint(tmp_path / "ended.ckpt")
        return module

    straight = fit(6, masters=True)
    fit(2, masters=True, save=True)
    (saved,) = tmp_path.glob("*step=2.ckpt")
    for checkpoint in (saved, tmp_path / "ended.ckpt"):
        assert "lightning_tbp_master" in torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"][0]
        resumed = fit(6, masters=True, ckpt_path=str(checkpoint))
        assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    with pytest.warns(UserWarning, match="float32 masters of 4 parameters, which this run drops"):
        rounded = fit(6, masters=False, ckpt_path=str(saved))
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), rounded.parameters(), strict=True))


# -- part of the state on the host ------------------------------------------------------------------


def test_part_of_the_state_on_the_host_steps_as_the_plain_optimizer_and_counts_where_it_is() -> None:
    """The largest parameters' state on the host, the rest on the device: weights bit for bit
    the ordinary step's; what training holds counts the device's part only, the host ledger the
    host's."""
    plain, plain_opt, hosted, hosted_opt = _pair("adamw")
    params = list(hosted.parameters())
    chosen = fewest_to_host(hostings(hosted_opt), 1)
    assert chosen is not None and len(chosen) == 1 and chosen[0].param is max(params, key=torch.Tensor.numel)
    stepper = OptimizerInBackward(hosted_opt)
    stepper.host = HostOptimizerState(hosted_opt, hosted=[chosen[0].param])
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        plain_opt.zero_grad()
        plain(x).backward()
        plain_opt.step()
        with stepper.stepping():
            hosted(x).backward()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), hosted.parameters(), strict=True))
    on_device = tensor_bytes(hosted, [hosted_opt], CPU).optimizer_state
    everything = tensor_bytes(plain, [plain_opt], CPU).optimizer_state
    assert on_device > 0 and everything - on_device == chosen[0].device_bytes + 4  # and its step count
    assert stepper.host.host_bytes == chosen[0].host_bytes + 4  # AdamW's step count, a scalar the probe leaves out
    assert [stepper.host.hosts(p) for p in params] == [p is chosen[0].param for p in params]


@pytest.mark.filterwarnings("ignore:.*planning at training step")
def test_a_budget_that_needs_part_of_the_state_off_the_device_hosts_the_largest_only(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a host whose steps are slow (priced a thousand times the measured), a byte budget a
    little below the device's minimum hosts the state of a few parameters, not all: every
    metered step within the budget and 5% of the prediction, the weights the plain fit's."""
    name = "dit"
    on_device, on_host = _minimum(name, "off"), _minimum(name, "auto")
    measured = step_cost.host_step_cost

    def slow_host(*args: Any, **kwargs: Any) -> step_cost.StepCost:
        cost = measured(*args, **kwargs)
        return step_cost.StepCost(cost.per_tensor_ns * 1000, cost.per_byte_ns * 1000)

    monkeypatch.setattr(step_cost, "host_step_cost", slow_host)
    monkeypatch.setattr(state_on_host, "host_step_cost", slow_host)
    module = ZooModule(name, batch=2)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=2)
    budget = on_device - (on_device - on_host) // 8
    run = _fit(module, loader, TinyBackpropStrategy(memory_budget=budget, max_slowdown=None), max_steps=3)
    plan = run["plan"]
    (action,) = [a for a in plan.actions if "the optimizer's state and step on the host" in a]
    hosted, total = (int(n) for n in action.split("for ")[1].split(" parameters")[0].split(" of its "))
    assert 0 < hosted < total // 2, action
    assert plan.loop.hosted_parameters is not None and len(plan.loop.hosted_parameters) == hosted
    everything = 3 * sum(p.numel() * p.element_size() for p in module.parameters())  # masters and two moments
    assert 0 < plan.loop.host_state_bytes < everything
    _assert_every_step_keeps_its_word(run["loop_steps"])
    _assert_ends_as_the_plain_fit(module, name, loader)
