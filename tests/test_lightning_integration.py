"""The strategies behave the same on every Trainer entry point and in every order of calls.

A second ``fit`` on the same Trainer (after a failed one) plans again; validate/test/predict run
the plain model; fine-tuning from local diffusers weights trains in train mode; a wrong or
frozen ``target`` and an eval-mode model are named; under DP a user's ``LightningModule.backward``
runs inside Lightning's own backward chain.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from diffusers import UNet2DModel
from lightning.pytorch.callbacks import Callback
from models import Denoiser, tiny_unet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.diffusion import DiffusionModule


def _trainer(strategy, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"max_steps": 2, **kwargs},
    )


def _loader() -> DataLoader:
    data = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=2)


class PlanSeen(Callback):
    """Records, at every training batch end, whether a plan was in force on the planned module."""

    def __init__(self) -> None:
        self.installed: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        plan = trainer.strategy.plan
        self.installed.append(plan is not None and plan.current is not None and bool(_wrapped(pl_module)))


class FailsOnce(Denoiser):
    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def training_step(self, batch, batch_idx):
        if self.fail and batch_idx == 1:
            raise RuntimeError("interrupted")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.evaluated_plain = not _wrapped(self)
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self.predicted_plain = not _wrapped(self)
        return self(batch[0], torch.zeros(len(batch[0]), dtype=torch.long))


def _wrapped(module: nn.Module) -> list[str]:
    """Submodules that carry a plan's instance-level forward."""
    return [name for name, m in module.named_modules() if "forward" in vars(m)]


def test_a_second_fit_on_the_same_trainer_plans_again_and_evaluation_runs_the_plain_model() -> None:
    model, seen = FailsOnce(), PlanSeen()
    trainer = _trainer(TinyBackpropStrategy(memory_budget=0.5), max_steps=3, callbacks=[seen])
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.fit(model, _loader())
    assert seen.installed == [True] and not _wrapped(model)  # the failed fit's plan was removed
    first_plan = trainer.strategy.plan
    model.fail = False
    trainer.fit(model, _loader())
    assert trainer.strategy.plan is not first_plan
    assert seen.installed[1:] and all(seen.installed[1:])
    assert not _wrapped(model)
    trainer.validate(model, _loader(), verbose=False)
    trainer.predict(model, _loader(), return_predictions=False)
    assert model.evaluated_plain and model.predicted_plain


def test_a_target_that_does_not_exist_is_named_with_the_modules_that_do() -> None:
    trainer = _trainer(TinyBackpropStrategy(memory_budget=0.5, target="does.not.exist"))
    with pytest.raises(ValueError, match=r"target='does.not.exist'.*Its direct children: net, head"):
        trainer.fit(Denoiser(), _loader())


def test_a_frozen_target_is_refused_before_training() -> None:
    model = Denoiser()
    model.net.requires_grad_(False)
    model.head = nn.Conv2d(3, 3, 1)  # something trains, but not what the plan would cover
    trainer = _trainer(TinyBackpropStrategy(memory_budget=0.5, target="net"))
    with pytest.raises(ValueError, match="none of its parameters is trainable"):
        trainer.fit(model, _loader())


def test_an_eval_mode_target_is_named_at_the_start_of_training() -> None:
    model = Denoiser()
    model.net.eval()
    trainer = _trainer(TinyBackpropStrategy(memory_budget=0.5), max_steps=1)
    with pytest.warns(UserWarning, match=r"module\(s\) of net \(UNet2DModel\) are in eval mode.*call \.train\(\)"):
        trainer.fit(model, _loader())


class DropoutProbe(Callback):
    """At the first training batch: every module trains, and the same input gives two outputs."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx:
            return
        self.modes = {name: m.training for name, m in pl_module.model.named_modules()}
        x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        t = torch.tensor([10])
        with torch.no_grad():
            self.differ = not torch.equal(pl_module.model(x, t).sample, pl_module.model(x, t).sample)


def test_fine_tuning_from_local_weights_trains_with_dropout(tmp_path) -> None:
    directory = tmp_path / "tiny-ddpm"
    config = {key: value for key, value in tiny_unet().config.items() if not key.startswith("_")}
    UNet2DModel(**{**config, "dropout": 0.5}).save_pretrained(directory)
    module = DiffusionModule(family="unet2d", pretrained=str(directory), sample_images=0, export=False)
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    loader = DataLoader([{"images": image, "labels": 0} for image in images], batch_size=4)
    probe = DropoutProbe()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*eval mode.*")
        _trainer(TinyBackpropStrategy(memory_budget=0.5), max_steps=1, callbacks=[probe]).fit(module, loader)
    assert all(probe.modes.values()), [name for name, training in probe.modes.items() if not training]
    assert probe.differ


class Regressor(L.LightningModule):
    def __init__(self, backward_calls: str = "default") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.backward_calls = backward_calls
        self.backward_ran = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x).squeeze(1) - y).square()

    def backward(self, loss, *args, **kwargs) -> None:
        self.backward_ran += 1
        if self.backward_calls == "default":
            loss.backward(*args, **kwargs)
        elif self.backward_calls == "with_arguments":
            loss.backward(retain_graph=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(2)
        data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, generator=generator))
        return DataLoader(data, batch_size=8)


class PlainRegressor(Regressor):
    backward = L.LightningModule.backward


def _dp_fit(module: L.LightningModule, tmp_path) -> None:
    torch.manual_seed(0)  # the same Poisson batches
    strategy = TinyBackpropStrategy(memory_budget=None, dp="ghost", max_grad_norm=0.5, noise_multiplier=0.0)
    _trainer(strategy, max_steps=3, default_root_dir=tmp_path).fit(module)


def test_under_dp_a_users_backward_override_runs_in_lightnings_chain(tmp_path) -> None:
    custom, plain = Regressor(), PlainRegressor()
    _dp_fit(custom, tmp_path)
    _dp_fit(plain, tmp_path)
    assert custom.backward_ran == 3
    for (name, a), b in zip(custom.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("calls", "message"),
    [("never", "never called loss.backward"), ("with_arguments", r"takes no arguments \(got retain_graph\)")],
)
def test_under_dp_a_backward_override_that_skips_or_changes_the_call_fails_clearly(calls, message, tmp_path) -> None:
    with pytest.raises((RuntimeError, ValueError), match=message):
        _dp_fit(Regressor(calls), tmp_path)
