"""The optimizer inside the backward under DP: each parameter is noised, averaged and stepped as
soon as its clipped sum is complete and no op's backward still reads its value.

Against the ordinary DP step (noise after the backward, then the optimizer): the same weights,
bitwise, with noise too (each parameter's noise comes from a stream of its own, so the order
parameters are noised in does not change it), the same ε, and noise of the promised sigma per
coordinate. Each parameter is stepped inside the backward's last pass, not after it.
"""

from __future__ import annotations

import collections

import lightning as L
import pytest
import torch
from test_dp_strategy import Regressor, fit

from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.optim import in_backward
from lightning_tbp.optim.host_state import HostOptimizerState
from lightning_tbp.privacy import MODES
from lightning_tbp.remat.options import Option
from lightning_tbp.strategies.step_in_backward import blockers
from lightning_tbp.testing.zoo_lightning import ZooModule


class AdamRegressor(Regressor):
    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _run(  # type: ignore[no-untyped-def]
    module_class: type, tmp_path, in_backward_: bool, noise: float, mode: str, on_host: bool = False, **kwargs
) -> tuple:
    torch.manual_seed(5)
    module = module_class()
    strategy = TinyBackpropStrategy(
        memory_budget=None,
        dp=mode,
        noise_multiplier=noise,
        optimizer_in_backward=in_backward_,
        optimizer_state_on_host=on_host,
    )
    fit(module, strategy, tmp_path, max_steps=3, **kwargs)
    assert strategy.privacy is not None
    return [p.detach().clone() for p in module.parameters()], strategy.privacy.epsilon()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("accumulate", "noise"), [(1, 0.0), (2, 1.0)])
def test_the_fused_dp_step_leaves_the_ordinary_dp_steps_weights_bitwise(
    mode: str, accumulate: int, noise: float, tmp_path
) -> None:
    ordinary, epsilon = _run(AdamRegressor, tmp_path, False, noise, mode, accumulate_grad_batches=accumulate)
    fused, fused_epsilon = _run(AdamRegressor, tmp_path, True, noise, mode, accumulate_grad_batches=accumulate)
    for a, b in zip(ordinary, fused, strict=True):
        assert torch.equal(a, b)
    assert fused_epsilon == epsilon


@pytest.mark.parametrize("mode", MODES)
def test_with_the_state_on_the_host_the_dp_step_leaves_the_same_weights_bitwise(
    mode: str, tmp_path, monkeypatch
) -> None:
    """The optimizer's state and step on the host (each parameter stepped there as its noised,
    clipped sum completes): the ordinary DP step's weights and epsilon, noise and accumulation
    included, and every parameter of every step stepped on the host."""
    steps = collections.Counter()
    stepping = HostOptimizerState.step

    def counted(self: HostOptimizerState, param: torch.Tensor, group_index: int) -> None:
        steps[id(param)] += 1
        stepping(self, param, group_index)

    monkeypatch.setattr(HostOptimizerState, "step", counted)
    ordinary, epsilon = _run(AdamRegressor, tmp_path, False, 1.0, mode, accumulate_grad_batches=2)
    assert not steps
    hosted, hosted_epsilon = _run(AdamRegressor, tmp_path, True, 1.0, mode, True, accumulate_grad_batches=2)
    assert sorted(steps.values()) == [3] * len(ordinary)  # max_steps=3
    for a, b in zip(ordinary, hosted, strict=True):
        assert torch.equal(a, b)
    assert hosted_epsilon == epsilon


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_each_parameter_is_stepped_inside_the_last_backward_pass(mode: str, tmp_path, monkeypatch) -> None:
    phases: collections.Counter = collections.Counter()
    stepping = in_backward.OptimizerInBackward._step_and_free
    strategy = TinyBackpropStrategy(memory_budget=None, dp=mode, noise_multiplier=1.0, optimizer_in_backward=True)

    def counted(self: in_backward.OptimizerInBackward, param: torch.Tensor) -> None:
        assert strategy.privacy is not None and strategy.privacy.engine is not None
        phases[strategy.privacy.engine._phase] += 1
        stepping(self, param)

    monkeypatch.setattr(in_backward.OptimizerInBackward, "_step_and_free", counted)
    module = Regressor()
    fit(module, strategy, tmp_path, max_steps=2)
    last_pass = "sum" if mode == "ghost" else "book"
    assert phases == {last_pass: 2 * len(list(module.parameters()))}


def test_the_noise_has_the_promised_deviation_per_coordinate(tmp_path) -> None:
    """One SGD step at lr 1: noised weights less noiseless ones are -sigma*C/E[B] times N(0, 1) draws."""
    sigma, clip = 2.0, 0.5

    def one_step(noise: float) -> torch.Tensor:
        torch.manual_seed(5)
        module = Regressor()
        strategy = TinyBackpropStrategy(
            memory_budget=None, dp="ghost", noise_multiplier=noise, max_grad_norm=clip, optimizer_in_backward=True
        )
        fit(module, strategy, tmp_path, max_steps=1)
        assert strategy.privacy is not None and strategy.privacy.expected_batch_size is not None
        scale = sigma * clip / strategy.privacy.expected_batch_size
        return torch.cat([p.detach().flatten() for p in module.parameters()]) / scale

    draws = one_step(0.0) - one_step(sigma)
    assert draws.numel() > 100
    assert abs(draws.std().item() - 1) < 0.25, draws.std()
    assert abs(draws.mean().item()) < 0.3, draws.mean()


@pytest.mark.slow
def test_a_planned_dp_step_whose_blocks_bookkeeping_runs_again_is_stepped_exactly(tmp_path) -> None:
    """Bookkeeping under a plan runs fully checkpointed blocks again after its book: their
    parameters are stepped inside that second run, as its backward completes each. The two
    runs' plans differ (their loops differ), so other layers are booked or run again and sum in
    another order: equal within float rounding, not bitwise."""
    weights, replayed = [], []
    for in_backward_ in (False, True):
        torch.manual_seed(0)
        module = ZooModule("dit", batch=4)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=4
        )
        strategy = TinyBackpropStrategy(
            memory_budget=0.5, dp="bookkeeping", noise_multiplier=1.0, optimizer_in_backward=in_backward_
        )
        trainer = L.Trainer(
            accelerator="cpu",
            strategy=strategy,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, loader)
        assert strategy.plan is not None and strategy.plan.current is not None
        replayed.append([block for block, option in strategy.plan.current.options.items() if option == Option.FULL])
        weights.append([p.detach().clone() for p in module.parameters()])
    assert replayed[1], "the fused run's plan checkpoints no block fully: nothing is run again"
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_dp_on_several_devices_is_refused_by_name() -> None:
    module = Regressor()
    trainer = type("T", (), {"gradient_clip_val": None, "callbacks": [], "precision_plugin": None})()
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    found = blockers(trainer, module, [optimizer], private=True, devices="ddp", automatic=False)  # type: ignore[arg-type]
    assert any("with dp= it runs on one device" in reason for reason in found)
    assert not blockers(trainer, module, [optimizer], private=True, devices=None, automatic=False)  # type: ignore[arg-type]
