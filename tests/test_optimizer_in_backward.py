"""The optimizer inside the backward (``lightning_tbp.optim``, ``optimizer_in_backward=True``):
weights bitwise equal to the ordinary step's, and everything around it behaves or is refused."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy
from lightning_tbp.memory.breakdown import plain_tensors
from lightning_tbp.optim import PER_PARAMETER, OptimizerInBackward, steps_per_parameter
from lightning_tbp.optim.choice import is_low_bit, make_optimizer
from lightning_tbp.optim.host_state import HostOptimizerState


class Tied(nn.Module):
    """A weight read twice (one gradient, summed by autograd before it is accumulated), a block
    under a non-reentrant checkpoint, and a head that only some steps use."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU())
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.spare = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, spare: bool = False) -> torch.Tensor:
        h = self.embed(x)
        h = checkpoint(self.block, h, use_reentrant=False)
        h = self.shared(torch.tanh(self.shared(h)))
        return (self.spare if spare else self.head)(h).square().mean()


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam_amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2),
    "adafactor": lambda groups: torch.optim.Adafactor(groups, lr=1e-2),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=1e-2),
    "radam": lambda groups: torch.optim.RAdam(groups, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "adamax": lambda groups: torch.optim.Adamax(groups, lr=1e-2),
    "adadelta": lambda groups: torch.optim.Adadelta(groups, lr=0.5),
    "rprop": lambda groups: torch.optim.Rprop(groups, lr=1e-2),
}


def test_every_optimizer_auto_may_take_is_checked_here() -> None:
    """``optimizer_in_backward="auto"`` steps only these inside the backward: each must be in the
    bitwise test below."""
    checked = {type(make(_groups(Tied()))) for make in OPTIMIZERS.values()}
    assert set(PER_PARAMETER) <= checked


def _groups(model: Tied) -> list[dict]:
    return [
        {"params": [*model.embed.parameters(), *model.block.parameters()], "lr_scale": 1},
        {"params": [*model.shared.parameters(), *model.head.parameters(), *model.spare.parameters()]},
    ]


def _pair(name: str) -> tuple[Tied, torch.optim.Optimizer, Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    plain = Tied()
    fused = copy.deepcopy(plain)
    return plain, OPTIMIZERS[name](_groups(plain)), fused, OPTIMIZERS[name](_groups(fused))


@settings(max_examples=24, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    accumulate=st.integers(1, 3),
    spare_at=st.sets(st.integers(0, 8), max_size=3),
    on_host=st.booleans(),
)
def test_weights_equal_the_ordinary_steps_bitwise(
    name: str, accumulate: int, spare_at: set[int], on_host: bool
) -> None:
    """Several steps, micro-batches accumulated before the stepping backward, and parameters that
    only an earlier micro-batch reached (``spare``): stepped as the block ends. ``on_host``: the
    state and step on the host (``optim/host_state.py``), whose masters step with the
    optimizer's own groups and options, and which gives the groups back as it is removed."""
    plain, plain_opt, fused, fused_opt = _pair(name)
    stepper = OptimizerInBackward(fused_opt)
    if on_host:
        stepper.host = HostOptimizerState(fused_opt)
    batches = torch.randn(3 * accumulate, 4, 6, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        plain_opt.zero_grad()
        fused_opt.zero_grad()
        for micro in range(accumulate):
            index = step * accumulate + micro
            x, spare = batches[index], index in spare_at
            plain(x, spare).backward()
            if micro < accumulate - 1:
                fused(x, spare).backward()
            else:
                with stepper.stepping():
                    fused(x, spare).backward()
        plain_opt.step()
        assert all(p.grad is None for p in fused.parameters())  # each freed at its step
    for (path, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(a, b), path
    assert plain_opt.state_dict()["param_groups"] == fused_opt.state_dict()["param_groups"]
    stepper.remove()
    for group, own in zip(fused_opt.param_groups, _groups(fused), strict=True):
        assert all(p is q for p, q in zip(group["params"], own["params"], strict=True))


def test_a_scheduler_and_the_state_dict_see_the_optimizer_as_it_is() -> None:
    plain, plain_opt, fused, fused_opt = _pair("adamw")
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain_opt, fused_opt)]
    stepper = OptimizerInBackward(fused_opt)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        plain(x).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        with stepper.stepping():
            fused(x).backward()
        for schedule in schedules:
            schedule.step()
    assert [g["lr"] for g in fused_opt.param_groups] == [g["lr"] for g in plain_opt.param_groups] == [1.25e-3] * 2
    assert [len(g["params"]) for g in fused_opt.param_groups] == [6, 6]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fused.parameters(), strict=True))
    restored = OPTIMIZERS["adamw"](_groups(fused))
    restored.load_state_dict(fused_opt.state_dict())
    assert torch.equal(restored.state[fused.head.weight]["exp_avg"], fused_opt.state[fused.head.weight]["exp_avg"])


def test_outside_stepping_gradients_accumulate_as_usual_and_the_hooks_go() -> None:
    _, _, fused, fused_opt = _pair("sgd")
    stepper = OptimizerInBackward(fused_opt)
    before = [p.detach().clone() for p in fused.parameters()]
    fused(torch.randn(4, 6)).backward()
    assert all(
        p.grad is not None for p in fused.parameters() if p is not fused.spare.weight and p is not fused.spare.bias
    )
    assert all(torch.equal(a, b) for a, b in zip(before, fused.parameters(), strict=True))
    stepper.remove()
    with stepper.stepping():  # hooks gone: only the leftovers are stepped, at the end
        fused(torch.randn(4, 6)).backward()
    assert stepper.stepped == 10 and all(p.grad is None for p in fused.parameters())


def test_an_optimizer_that_needs_every_gradient_is_refused() -> None:
    model = Tied()
    with pytest.raises(ValueError, match="LBFGS cannot step inside the backward"):
        OptimizerInBackward(torch.optim.LBFGS(model.parameters()))


# -- under Lightning ------------------------------------------------------------------------------


class Regression(L.LightningModule):
    def __init__(self, scheduler: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Tied()
        self.scheduler = scheduler

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        if not self.scheduler:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(32, 6, generator=torch.Generator().manual_seed(2))), batch_size=4)


def _trainer(strategy: TinyBackpropStrategy, tmp_path, **kwargs) -> L.Trainer:  # type: ignore[no-untyped-def]
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


@pytest.mark.parametrize(
    "options",
    [
        {"max_steps": 4},
        {"max_steps": 3, "accumulate_grad_batches": 2},
        {"max_steps": 3, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    ],
)
def test_a_fit_ends_with_the_ordinary_fits_weights(options: dict, tmp_path) -> None:
    modules = []
    for in_backward in (False, True):
        module = Regression()
        strategy = TinyBackpropStrategy(memory_budget=None, optimizer_in_backward=in_backward)
        _trainer(strategy, tmp_path, enable_checkpointing=False, **options).fit(module, _loader())
        modules.append(module)
    plain, fused = modules
    for (path, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(a, b), path


@pytest.mark.parametrize("on_host", [False, True])
def test_a_resumed_fit_continues_as_one_fit(tmp_path, on_host: bool) -> None:
    """The optimizer's state, the schedule and the hooks survive a checkpoint (saved at an epoch's
    end: Lightning restarts an unfinished epoch of a plain loader from its first batch), also
    with the state on the host (``optimizer_state_on_host=True``: saved from the host, restored
    into the masters)."""

    def fit(module: Regression, root, epochs: int, ckpt_path=None) -> L.Trainer:  # type: ignore[no-untyped-def]
        strategy = TinyBackpropStrategy(memory_budget=None, optimizer_in_backward=True, optimizer_state_on_host=on_host)
        trainer = _trainer(strategy, root, max_epochs=epochs)
        trainer.fit(module, _loader(), ckpt_path=ckpt_path)
        return trainer

    straight = Regression()
    fit(straight, tmp_path / "a", epochs=2)
    fit(Regression(), tmp_path / "b", epochs=1).save_checkpoint(tmp_path / "one.ckpt")
    resumed = Regression()
    fit(resumed, tmp_path / "c", epochs=2, ckpt_path=tmp_path / "one.ckpt")
    for (path, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), path


class ReadsGradients(Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        pass


class Manual(Regression):
    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("module", "options", "strategy_options", "named"),
    [
        (Regression, {"gradient_clip_val": 1.0}, {}, "clips by the norm of every gradient"),
        (Regression, {"callbacks": [ReadsGradients()]}, {}, "on_before_optimizer_step of ReadsGradients"),
        (Manual, {}, {}, "optimizes manually"),
    ],
)
def test_what_cannot_compose_is_refused_by_name(module, options, strategy_options, named, tmp_path) -> None:  # type: ignore[no-untyped-def]
    strategy = TinyBackpropStrategy(memory_budget=None, optimizer_in_backward=True, **strategy_options)
    trainer = _trainer(strategy, tmp_path, max_steps=1, enable_checkpointing=False, **options)
    with pytest.raises(ValueError, match=named):
        trainer.fit(module(), _loader())


# -- chosen by the planner ("auto") ----------------------------------------------------------------


class Wide(nn.Module):
    """Weights (2 MiB) smaller than the activations of a batch of 128 (4 MiB), and a batch (32 KiB)
    too small to matter: the ordinary step fits 0.9 of its naive peak by recomputation, and is
    bound by its gradients and the optimizer's step below about 0.6."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class WideRegression(L.LightningModule):
    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Wide()
        self.optimizer = optimizer

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.model.parameters(), lr=1e-3)


def _fit_wide(
    tmp_path, budget, module: WideRegression | None = None, **options
) -> tuple[WideRegression, TinyBackpropStrategy]:  # type: ignore[no-untyped-def]
    module = module or WideRegression()
    strategy = TinyBackpropStrategy(memory_budget=budget)  # optimizer_in_backward="auto", the default
    loader = DataLoader(TensorDataset(torch.randn(384, 64, generator=torch.Generator().manual_seed(1))), batch_size=128)
    _trainer(strategy, tmp_path, max_steps=3, enable_checkpointing=False, **options).fit(module, loader)
    return module, strategy


@pytest.mark.filterwarnings("ignore:.*planning at training step")  # a model this small: its planning peaks higher
def test_auto_steps_inside_the_backward_only_where_the_budget_needs_it(tmp_path) -> None:
    """At 0.9 of the naive step the ordinary loop fits and is kept; at 0.5 only the step inside
    the backward fits: taken from the first step on, said in the plan report, every step within
    the budget and its prediction, and the weights those of the ordinary unplanned fit."""
    reference = WideRegression()
    strategy = TinyBackpropStrategy(memory_budget=None, optimizer_in_backward=False)
    loader = DataLoader(TensorDataset(torch.randn(384, 64, generator=torch.Generator().manual_seed(1))), batch_size=128)
    _trainer(strategy, tmp_path, max_steps=3, enable_checkpointing=False).fit(reference, loader)
    for budget, taken in ((0.9, False), (0.5, True)):
        module, planned = _fit_wide(tmp_path, budget)
        assert planned.plan is not None
        shape_plan = list(planned.plan.shape_plans.values())[-1]
        assert shape_plan.loop.step_in_backward is taken
        assert bool(shape_plan.actions) is taken
        assert ("taken besides recomputation: the optimizer step inside the backward" in planned.plan.report()) is taken
        steps = planned.loop_steps()
        assert [s["step"] for s in steps] == [0, 1, 2]
        for step in steps:
            assert step["peak_bytes"] <= step["budget_bytes"], step
            assert abs(step["peak_bytes"] / step["predicted_bytes"] - 1) <= 0.05, step
        for (path, a), b in zip(reference.named_parameters(), module.parameters(), strict=True):
            assert torch.equal(a, b), (budget, path)


class OwnAdamW(torch.optim.AdamW):
    """A subclass may change ``step``: not known to be per parameter."""


@pytest.mark.parametrize(
    ("module", "options", "blocked"),
    [
        (WideRegression, {"gradient_clip_val": 1.0}, "cannot be taken here: gradient_clip_val clips by the norm"),
        (lambda: WideRegression(OwnAdamW), {}, "OwnAdamW is not known to update each parameter"),
    ],
)
def test_an_infeasible_budget_names_the_step_inside_the_backward_and_what_blocks_it(
    module, options, blocked, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InfeasibleBudgetError) as raised:
        _fit_wide(tmp_path, 0.5, module(), **options)
    notes = "\n".join(raised.value.__notes__)
    assert "the optimizer step inside the backward (optimizer_in_backward='auto') would meet this budget" in notes
    assert blocked in notes


@pytest.mark.filterwarnings("ignore:.*planning at training step")
def test_below_what_even_the_step_inside_the_backward_reaches_the_error_names_both_minimums(tmp_path) -> None:
    with pytest.raises(InfeasibleBudgetError) as raised:
        _fit_wide(tmp_path, 0.3)
    error = raised.value
    assert 0.3 < error.minimum_step_bytes / error.naive_bytes < 0.5  # of the ordinary loop's naive peak
    assert any("that minimum is with the optimizer step inside the backward" in n for n in error.__notes__)


# -- low-bit optimizer state (torchao) ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_low_bit_optimizers_step_inside_the_backward_bitwise(name: str) -> None:
    """torchao's low-bit AdamW quantizes each large parameter's moments on its own, so stepping it
    inside the backward gives the ordinary step's weights and codes, bit for bit (eager here:
    its compiled step is the same per-parameter function, compiled)."""
    pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64))
    fused = copy.deepcopy(plain)
    plain_opt, fused_opt = (make_optimizer(name, m.parameters(), lr=1e-2, weight_decay=0.01) for m in (plain, fused))
    assert steps_per_parameter(fused_opt) and is_low_bit(fused_opt)
    stepper = OptimizerInBackward(fused_opt)
    with torch.compiler.set_stance("force_eager"):
        for step in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            plain(x).square().mean().backward()
            plain_opt.step()
            plain_opt.zero_grad()
            with stepper.stepping():
                fused(x).square().mean().backward()
    for (path, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(a, b), path
    weight = fused[0].weight
    codes = [t for t in plain_tensors(fused_opt.state[weight]) if t.dtype == torch.uint8]
    assert codes and all(t.numel() * t.element_size() <= weight.numel() for t in codes)  # a byte or less each


def test_a_recipe_names_its_optimizer_and_an_unknown_one_is_refused() -> None:
    params = [nn.Parameter(torch.zeros(4))]
    assert isinstance(make_optimizer("adamw", params, 1e-3, 0.0), torch.optim.AdamW)
    assert isinstance(make_optimizer("adafactor", params, 1e-3, 0.0), torch.optim.Adafactor)
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adamw8bit, adamw4bit, adafactor"):
        make_optimizer("lion", params, 1e-3, 0.0)
