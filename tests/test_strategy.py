"""``Trainer(strategy="tiny_backprop")`` trains exactly like Lightning's default strategy, in less memory."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.strategies import StrategyRegistry
from models import Denoiser
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_tbp
from lightning_tbp import NothingToPlanWarning, TinyBackpropStrategy
from lightning_tbp.remat.verify import TIMED_STEPS, WARM_UP_STEPS, describe_step_time


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(outputs["loss"].detach().clone())


def fit(strategy, data: torch.Tensor, net: nn.Module | None = None, **trainer_kwargs):
    torch.manual_seed(0)
    model = Denoiser(net)
    losses = Losses()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=trainer_kwargs.pop("max_steps", 4),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses, *trainer_kwargs.pop("callbacks", [])],
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=2))
    return trainer, model, torch.stack(losses.values)


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))


def test_registered_on_import() -> None:
    assert lightning_tbp.TinyBackpropStrategy.strategy_name in StrategyRegistry
    assert isinstance(L.Trainer(strategy="tiny_backprop", logger=False).strategy, TinyBackpropStrategy)


@pytest.mark.parametrize(
    "trainer_kwargs",
    [{}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "precision": "bf16-mixed"}],
    ids=["fp32", "bf16_accumulate_clip"],
)
def test_fit_gives_the_same_losses_and_weights(data, trainer_kwargs) -> None:
    _, plain_model, plain_losses = fit("auto", data, **dict(trainer_kwargs))
    trainer, planned_model, planned_losses = fit(TinyBackpropStrategy(memory_budget=0.8), data, **trainer_kwargs)
    plan = trainer.strategy.plan
    assert plan is not None and plan.current is not None and plan.current.options
    assert torch.equal(planned_losses, plain_losses)
    for (name, p), q in zip(planned_model.named_parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not any("forward" in m.__dict__ for m in planned_model.modules()), "teardown restores the model"


def test_measured_peak_is_reported_next_to_the_prediction(data) -> None:
    trainer, _, _ = fit("tiny_backprop", data, max_steps=3)
    shape_plan = trainer.strategy.plan.current
    assert shape_plan.measured_peak_bytes is not None
    assert abs(shape_plan.measured_peak_bytes / shape_plan.predicted_peak_bytes - 1) <= 0.10
    assert "measured peak" in trainer.strategy.plan.report()


def test_step_time_is_measured_after_the_metered_step_and_reported(data, caplog) -> None:
    """A plan's time is read from steps after its metered one (the meter slows a step) and a
    warm-up: their median is filed beside the predicted time, logged, in the report and its JSON."""

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.seen: list[float | None] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen.append(trainer.strategy.plan.current.measured_step_ns)

    times = StepTimes()
    with caplog.at_level("INFO"):
        trainer, _, _ = fit("tiny_backprop", data, max_steps=1 + WARM_UP_STEPS + TIMED_STEPS, callbacks=[times])
    # nothing until the last of the timed steps after the metered one and the warm-up
    assert times.seen[:-1] == [None] * (WARM_UP_STEPS + TIMED_STEPS) and times.seen[-1] is not None
    shape_plan = trainer.strategy.plan.current
    # the module's step alone: neither the planning (about a second) nor the metered step is in it
    assert 0.2 < shape_plan.measured_step_ns / shape_plan.planned_step_ns < 5
    assert describe_step_time(shape_plan) in trainer.strategy.plan.report()
    assert trainer.strategy.plan.to_dict()["measured_step_ns"] == shape_plan.measured_step_ns
    assert any("step time" in record.getMessage() for record in caplog.records)


def test_refuses_several_devices() -> None:
    with pytest.raises(ValueError, match="tiny_backprop_ddp"):
        L.Trainer(strategy="tiny_backprop", accelerator="cpu", devices=2, logger=False)


def test_bad_budget_fails_before_training() -> None:
    with pytest.raises(ValueError, match="'6GiB'"):
        TinyBackpropStrategy(memory_budget="half of it")


def test_model_with_nothing_to_plan_trains_with_a_warning(data) -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x, t):
            return self.conv(x)

    with pytest.warns(NothingToPlanWarning):
        _, _, losses = fit("tiny_backprop", data, net=Flat(), max_steps=2)
    assert losses.shape == (2,)


def test_trains_under_lightnings_pytorch_profiler(data, tmp_path) -> None:
    """Planning and metering step aside for a running profiler instead of corrupting it."""
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="trace")
    trainer, _, losses = fit("tiny_backprop", data, max_steps=2, profiler=profiler)
    assert trainer.strategy.plan.current is not None and losses.shape == (2,)
    assert "aten::convolution" in trainer.profiler.summary()
