"""``strategy="tiny_backprop"`` as a drop-in: the user's code sees exactly the calls Lightning's
default strategy makes, and the strategy costs a model it cannot help almost nothing.

Each test is one class of what Lightning's own suite (``scripts/lightning_suite.py``) checks of a
strategy: a pickled Trainer, class-level mocks of ``Tensor.backward`` and of the optimizer's
``step``/``zero_grad``, a global optimizer hook, a wrapped ``Strategy.backward``; then the loop
on a model with nothing to plan (bounded re-planning, no collection per metered step).
"""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import warnings
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, ManualOptimBoringModel
from lightning.pytorch.strategies import Strategy
from models import Denoiser
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import lightning_tbp
from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.remat.plan import MAX_CORRECTIONS, OverBudgetWarning, Plan

STRATEGIES = ["auto", "tiny_backprop"]


def _trainer(strategy: object, tmp_path, **kwargs) -> pl.Trainer:
    defaults = dict(
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


class _Denoising(pl.LightningDataModule):
    """Random images for :class:`models.Denoiser`, a model the planner does plan."""

    def train_dataloader(self):
        images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=2)


class _ClosureFirst(Denoiser):
    """Runs Lightning's closure itself, so a mocked ``step`` (which would not) still trains the loop."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer_closure()
        optimizer.step()


def _fit_denoiser(strategy: object, tmp_path, steps: int = 3, module: type[Denoiser] = Denoiser) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = _trainer(strategy, tmp_path, max_steps=steps)
    trainer.fit(module(), datamodule=_Denoising())
    return trainer


@pytest.mark.slow
def test_the_trainer_pickles_after_a_planned_fit(tmp_path) -> None:
    trainer = _fit_denoiser(TinyBackpropStrategy(memory_budget=0.5), tmp_path, steps=2)
    assert trainer.strategy.plan is not None and trainer.strategy.plan.shape_plans  # it did plan
    restored = pickle.loads(pickle.dumps(trainer))
    assert type(restored.strategy) is TinyBackpropStrategy


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensor_backward_is_called_once_per_step(strategy: str, tmp_path) -> None:
    """The planner's own backward passes (the stand-in loss, the option timings) never go
    through ``Tensor.backward``, which the user's code, a mock or a hook may watch."""
    with mock.patch("torch.Tensor.backward", autospec=True, side_effect=torch.Tensor.backward) as backward:
        _fit_denoiser(strategy, tmp_path, steps=3)
    assert backward.call_count == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_optimizer_class_sees_only_the_trainers_calls(strategy: str, tmp_path) -> None:
    """The twins that size and time the step are of the user's class, but stepped unseen: a
    class-level mock of ``Adam.step``/``zero_grad`` counts one call each per step."""
    adam_mocked = mock.patch.multiple(torch.optim.Adam, step=mock.DEFAULT, zero_grad=mock.DEFAULT)
    with adam_mocked as adam, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a mocked step cannot be imitated: the strategy says so
        _fit_denoiser(strategy, tmp_path, steps=3, module=_ClosureFirst)
    assert adam["step"].call_count == 3
    assert adam["zero_grad"].call_count == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_global_optimizer_hook_sees_one_step_per_step(strategy: str, tmp_path) -> None:
    seen: list[type] = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(type(opt)))
    try:
        _fit_denoiser(strategy, tmp_path, steps=3)
    finally:
        handle.remove()
    assert seen == [torch.optim.Adam] * 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_wrapped_strategy_backward_counts_each_manual_backward(strategy: str, tmp_path) -> None:
    """The strategy overrides no step of Lightning's backward chain: a test (or a user) that
    wraps ``Strategy.backward`` with the instance's own sees each call once, no recursion."""
    trainer = _trainer(strategy, tmp_path, max_steps=2)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(ManualOptimBoringModel())
    assert backward.call_count == 2


def test_the_strategy_replaces_no_method_of_lightnings_backward_chain() -> None:
    for cls in TinyBackpropStrategy.__mro__:
        if cls.__module__.startswith("lightning_tbp"):
            assert "backward" not in vars(cls), cls


@pytest.mark.slow
def test_a_model_with_nothing_to_plan_is_planned_once_and_warned_once(tmp_path, monkeypatch) -> None:
    """A BoringModel (one Linear) under the default budget: no re-planning step after step, at
    most one warning of ours, and no full garbage collection per metered step."""
    solved: list[object] = []
    solve = Plan._solve_profile

    def counted(self, profile, correction):
        solved.append(correction)
        return solve(self, profile, correction)

    monkeypatch.setattr(Plan, "_solve_profile", counted)
    full_collections: list[int] = []
    collect = gc.collect

    def counted_collect(generation: int = 2) -> int:
        if generation == 2:
            full_collections.append(generation)
        return collect(generation)

    monkeypatch.setattr(gc, "collect", counted_collect)
    trainer = _trainer("tiny_backprop", tmp_path, max_steps=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    ours = [w for w in caught if "lightning_tbp" in str(w.message) or "tiny_backprop" in str(w.message)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    assert 1 <= len(solved) <= 1 + MAX_CORRECTIONS
    assert all(correction < 1e3 for correction in solved)
    assert not full_collections  # the meters collect young garbage only, never a full collection


def test_corrections_are_bounded_and_the_last_plan_is_kept_with_one_warning() -> None:
    blocks = (nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6))
    model = nn.Sequential(*blocks)
    x = torch.randn(512, 64)
    plan = lightning_tbp.rematerialize(model, x, memory_budget=0.6)
    kept = plan.current
    for _ in range(MAX_CORRECTIONS):
        assert kept is not None
        kept = plan.correct(kept, 1.02)
    assert kept is not None
    with pytest.warns(OverBudgetWarning, match=f"after {MAX_CORRECTIONS} corrections"):
        assert plan.correct(kept, 1.02) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.correct(kept, 1.02) is None  # settled: said once
    assert list(plan.shape_plans.values()) == [kept]
    plan.remove()


def test_importing_the_diffusion_package_is_quiet() -> None:
    """torchao, when installed, is imported before diffusers and peft import it: its import-time
    warnings about CUDA extensions a CPU run never loads, and diffusers' about tensor classes a
    newer torchao moved, are not printed."""
    pytest.importorskip("torchao")
    started = subprocess.run(
        [sys.executable, "-c", "import lightning_tbp.diffusion, peft, transformers"],
        capture_output=True,
        text=True,
        check=True,
    )
    noise = [line for line in started.stderr.splitlines() if "torchao" in line or "_pytree" in line]
    assert not noise, noise
