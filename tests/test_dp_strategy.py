"""DP through the Trainer: ``TinyBackpropStrategy(dp=...)``.

One Lightning step at noise 0 must move the weights by the vmap reference's clipped sum over the
Poisson-sampled logical batch divided by its expected size; ε must equal Opacus's accountant
stepped independently; a resumed run must keep the privacy it spent.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from dp_reference import clipped_sum, per_sample_grads
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import MemoryProfilerCallback, TinyBackpropStrategy
from lightning_tbp.callbacks.strategy_info import MemoryReportingStrategy
from lightning_tbp.privacy import PerSampleLossError
from lightning_tbp.privacy.accounting import BudgetSpentError
from lightning_tbp.privacy.sampling import PoissonBatchSampler
from lightning_tbp.strategies.privacy import PrivacyBudgetExceededError

N, BATCH = 64, 8


class Regressor(L.LightningModule):
    """A small conv net with GroupNorm; records every batch it trains on."""

    def __init__(self, per_sample: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.Flatten(), nn.Linear(64, 1)
        )
        self.per_sample = per_sample
        self.seen: list[torch.Tensor] = []

    def loss(self, net, x, y):
        return (net(x).squeeze(1) - y).square()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(torch.cat([x.flatten(1), y[:, None]], dim=1))
        per_sample = self.loss(self.net, x, y)
        return per_sample if self.per_sample else per_sample.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(N, 1, 4, 4, generator=generator), torch.randn(N, generator=generator))
        return DataLoader(data, batch_size=BATCH)


def fit(module: L.LightningModule, strategy: TinyBackpropStrategy, tmp_path, ckpt_path=None, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **{"enable_checkpointing": False, **kwargs},
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_one_step_moves_weights_by_the_clipped_mean(mode: str, accumulate: int, tmp_path) -> None:
    module = Regressor()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    strategy = TinyBackpropStrategy(memory_budget=None, dp=mode, max_grad_norm=5.0, noise_multiplier=0.0)
    fit(module, strategy, tmp_path, max_steps=1, accumulate_grad_batches=accumulate)
    seen = torch.cat(module.seen)
    x, y = seen[:, :16].reshape(-1, 1, 4, 4), seen[:, 16]
    assert len(module.seen) == accumulate and len(x) > 0
    reference = Regressor()
    grads = per_sample_grads(reference.net, lambda call, b: reference.loss(call, b["x"], b["y"]), {"x": x, "y": y})
    expected, norms = clipped_sum(grads, 5.0)
    assert (norms > 5.0).any() and (norms < 5.0).any()  # some samples clipped, some not
    for name, param in module.named_parameters():
        step = before[name] - param.detach()  # SGD, lr 1: the gradient itself
        want = expected[name.removeprefix("net.")] / (BATCH * accumulate)
        torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


class ManualRegressor(Regressor):
    """The same step under manual optimisation: the module calls ``manual_backward`` and steps."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_manual_optimisation_steps_by_the_clipped_mean_and_is_accounted(mode: str, tmp_path) -> None:
    """``manual_backward`` goes through the engine, ``optimizer.step()`` adds the noise and divides
    by the expected batch, and each step is one accounted step: as under automatic optimisation."""
    automatic, manual = Regressor(), ManualRegressor()
    trainers = []
    for module in (automatic, manual):
        strategy = TinyBackpropStrategy(memory_budget=None, dp=mode, max_grad_norm=5.0, noise_multiplier=1.0)
        torch.manual_seed(3)  # same Poisson batches, same noise
        trainers.append(fit(module, strategy, tmp_path, max_steps=2))
    assert [len(x) for x in automatic.seen] == [len(x) for x in manual.seen]
    for (name, want), got in zip(automatic.named_parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    epsilons = [trainer.strategy.privacy.epsilon() for trainer in trainers]
    assert epsilons[0] == pytest.approx(epsilons[1]) and epsilons[0] > 0


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_equals_opacus_accountant_stepped_independently(accountant: str, tmp_path) -> None:
    strategy = TinyBackpropStrategy(memory_budget=None, dp="flash", noise_multiplier=1.1, accountant=accountant)
    trainer = fit(Regressor(), strategy, tmp_path, max_steps=5)
    independent = {"prv": PRVAccountant, "rdp": RDPAccountant}[accountant]()
    for _ in range(5):
        independent.step(noise_multiplier=1.1, sample_rate=BATCH / N)
    assert strategy.privacy.accountant.steps == 5
    assert strategy.privacy.epsilon() == pytest.approx(independent.get_epsilon(delta=1e-5), rel=1e-9)
    assert float(trainer.callback_metrics["dp/epsilon"]) == pytest.approx(strategy.privacy.epsilon())


def test_target_epsilon_is_met_at_the_planned_end_and_logged_per_epoch(tmp_path) -> None:
    strategy = TinyBackpropStrategy(memory_budget=None, dp="bookkeeping", target_epsilon=3.0, accountant="rdp")
    trainer = fit(Regressor(), strategy, tmp_path, max_epochs=2)
    epsilon = strategy.privacy.epsilon()
    assert strategy.privacy.accountant.steps == 2 * (N // BATCH)
    assert 0.9 * 3.0 < epsilon <= 3.0
    assert float(trainer.callback_metrics["dp/epsilon"]) == pytest.approx(epsilon)


def test_resume_keeps_the_privacy_already_spent(tmp_path) -> None:
    def strategy():
        return TinyBackpropStrategy(memory_budget=None, dp="bookkeeping", noise_multiplier=0.8, accountant="rdp")

    first = strategy()
    trainer = fit(Regressor(), first, tmp_path, max_steps=4, enable_checkpointing=True)
    checkpoint = trainer.checkpoint_callback.best_model_path
    resumed = strategy()
    fit(Regressor(), resumed, tmp_path, ckpt_path=checkpoint, max_steps=7)
    independent = RDPAccountant()
    for _ in range(7):
        independent.step(noise_multiplier=0.8, sample_rate=BATCH / N)
    assert resumed.privacy.accountant.steps == 7
    assert resumed.privacy.epsilon() == pytest.approx(independent.get_epsilon(delta=1e-5), rel=1e-9)
    assert resumed.privacy.epsilon() > first.privacy.epsilon()


class NonEmptyRegressor(Regressor):
    """Fails on a batch of no samples, as many real models do."""

    def training_step(self, batch, batch_idx):
        assert len(batch[0]) > 0, "the strategy passed an empty micro-batch to training_step"
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(super().train_dataloader().dataset, batch_size=1)


def test_empty_poisson_micro_batches_skip_the_forward_and_still_step(tmp_path) -> None:
    """Micro-batches of expected size 1 are often empty: no forward for them, but every logical
    batch is still one optimizer step with its noise and one accountant step."""
    module = NonEmptyRegressor()
    strategy = TinyBackpropStrategy(memory_budget=None, dp="bookkeeping", noise_multiplier=1.0)
    trainer = fit(module, strategy, tmp_path, max_steps=10, accumulate_grad_batches=2)
    assert trainer.global_step == 10 and strategy.privacy.accountant.steps == 10
    assert len(module.seen) < 20  # some of the 20 micro-batches were empty and skipped


def test_poisson_batches_have_the_right_size_distribution() -> None:
    sampler = PoissonBatchSampler(2000, 0.05, micro_batches=2, steps=400, generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 800
    logical = torch.tensor([len(a) + len(b) for a, b in zip(batches[::2], batches[1::2], strict=True)]).float()
    assert abs(float(logical.mean()) - 100) < 4 * (100 * 0.95 / 400) ** 0.5
    assert abs(float(logical.var()) / (100 * 0.95) - 1) < 0.25
    assert all(len(set(a) & set(b)) == 0 for a, b in zip(batches[::2], batches[1::2], strict=True))


def test_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        TinyBackpropStrategy(dp="ghost")
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        TinyBackpropStrategy(dp="ghost", noise_multiplier=1.0, target_epsilon=2.0)
    with pytest.raises(ValueError, match="dp must be one of"):
        TinyBackpropStrategy(dp="opacus", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="accountant must be one of"):
        TinyBackpropStrategy(dp="ghost", noise_multiplier=1.0, accountant="gdp2")
    strategy = TinyBackpropStrategy(memory_budget=None, dp="ghost", noise_multiplier=1.0)
    with pytest.raises(PerSampleLossError, match=r"training_step must return the per-sample loss.*got shape \(\)"):
        fit(Regressor(per_sample=False), strategy, tmp_path, max_steps=1)


def test_resume_with_target_epsilon_recalibrates_for_the_remaining_steps(tmp_path) -> None:
    """Defect 5: a run calibrated for 3 steps within ε=4, resumed with max_steps=6, kept its sigma and
    spent ε=4.81. Resumed, the remaining steps now get the noise that lands the whole run within
    its target (the same target: what little is left; a larger one: up to it); a target below
    what was already spent is refused with the numbers."""

    def strategy(target: float) -> TinyBackpropStrategy:
        return TinyBackpropStrategy(memory_budget=None, dp="bookkeeping", target_epsilon=target, accountant="rdp")

    first = strategy(4.0)
    trainer = fit(Regressor(), first, tmp_path, max_steps=3, enable_checkpointing=True)
    checkpoint = trainer.checkpoint_callback.best_model_path
    spent = first.privacy.epsilon()
    assert 3.9 < spent <= 4.0
    assert torch.load(checkpoint, weights_only=False)["callbacks"]["PrivacyCallback"]["epsilon"] == spent

    with pytest.raises(BudgetSpentError, match=rf"spent epsilon {spent:.3f} .* in 3 steps, which reaches .* 3\.5"):
        fit(Regressor(), strategy(3.5), tmp_path, ckpt_path=checkpoint, max_steps=6)
    same = strategy(4.0)
    fit(Regressor(), same, tmp_path, ckpt_path=checkpoint, max_steps=6)
    assert same.privacy.accountant.steps == 6 and spent < same.privacy.epsilon() <= 4.0
    assert same.privacy.noise_multiplier > 2 * first.privacy.noise_multiplier

    resumed = strategy(6.0)
    fit(Regressor(), resumed, tmp_path, ckpt_path=checkpoint, max_steps=6)
    assert resumed.privacy.accountant.steps == 6
    assert 5.9 < resumed.privacy.epsilon() <= 6.0
    fresh = TinyBackpropStrategy(memory_budget=None, dp="bookkeeping", target_epsilon=6.0, accountant="rdp")
    fit(Regressor(), fresh, tmp_path, max_steps=6)
    assert resumed.privacy.noise_multiplier != pytest.approx(fresh.privacy.noise_multiplier, rel=1e-3)
    assert 5.9 < fresh.privacy.epsilon() <= 6.0


def test_a_step_past_the_calibrated_plan_is_refused(tmp_path) -> None:
    """A second fit on the same strategy with more steps recalibrates; one step more than
    calibrated for (here: planning for 2 but the Trainer asked for 3) stops with an error."""
    strategy = TinyBackpropStrategy(memory_budget=None, dp="ghost", target_epsilon=2.0, accountant="rdp")
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu", strategy=strategy, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, max_steps=3, default_root_dir=tmp_path,
    )  # fmt: skip
    original = strategy.privacy.process_train_loader

    def plan_fewer(*args, **kwargs):
        loader = original(*args, **kwargs)
        strategy.privacy.planned_steps = 2
        strategy.privacy._calibrate()
        return loader

    strategy.privacy.process_train_loader = plan_fewer
    with pytest.raises(PrivacyBudgetExceededError, match=r"step 3 of a run calibrated for 2 steps within epsilon 2\.0"):
        trainer.fit(module)
    assert strategy.privacy.accountant.steps == 2 and strategy.privacy.epsilon() <= 2.0


def test_options_are_checked_when_the_strategy_is_built() -> None:
    """Defect 6: infinite sigma or C left NaN weights; DP options without dp= trained without privacy."""
    for options in ({"max_grad_norm": float("inf")}, {"noise_multiplier": float("inf")}, {"max_grad_norm": 0.0}):
        with pytest.raises(ValueError, match=r"must be .* and finite"):
            TinyBackpropStrategy(dp="ghost", **{"noise_multiplier": 1.0, **options})
    with pytest.raises(ValueError, match="target_epsilon must be positive and finite"):
        TinyBackpropStrategy(dp="ghost", target_epsilon=float("nan"))
    with pytest.raises(ValueError, match="target_delta must be in"):
        TinyBackpropStrategy(dp="ghost", noise_multiplier=1.0, target_delta=1.0)
    for options in ({"noise_multiplier": 1.0}, {"target_epsilon": 8.0}, {"max_grad_norm": 1.0}, {"accountant": "rdp"}):
        with pytest.raises(ValueError, match=r"given without dp=.*would train without privacy"):
            TinyBackpropStrategy(**options)


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_the_memory_report_measures_dp_buffers(mode: str, tmp_path) -> None:
    """Defect 7: the report's DP buffers were always 0 (the callback asked for a method no strategy
    had). The strategies now satisfy the callbacks' declared interface, and the engine's held
    bytes show up: bookkeeping's recorded operands at least the per-layer inputs it keeps."""
    strategy = TinyBackpropStrategy(memory_budget=None, dp=mode, noise_multiplier=1.0)
    assert isinstance(strategy, MemoryReportingStrategy)
    callback = MemoryProfilerCallback(every_n_steps=1, warmup_steps=1, output_dir=tmp_path, log_metrics=False)
    fit(Regressor(), strategy, tmp_path, max_steps=3, callbacks=[callback])
    after_backward = [s for s in callback.record["snapshots"] if s["stage"] == "after_backward"]
    assert after_backward and all(s["dp_peak_mb"] > 0 for s in after_backward)
    norms_mb = 2 * BATCH * 4 / 2**20  # the [B] norms and clip coefficients, float32 (B varies: Poisson)
    top = max(callback.record["snapshots"], key=lambda s: s["peak_mb"])["step"]
    top_peak = max(s["dp_peak_mb"] for s in callback.record["snapshots"] if s["step"] == top)
    assert callback.record["breakdown"]["dp_buffers_mb"] == top_peak
    if mode == "bookkeeping":  # the conv input [B, 1, 4, 4] and the Linear input [B, 64], at least
        assert min(s["dp_peak_mb"] for s in after_backward) > norms_mb + 16 * 4 / 2**20
    assert callback.record["config"]["dp"]["planned_steps"] == 3
