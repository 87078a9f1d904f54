"""The Lightning side of ``optimizer_in_backward=True``: what cannot compose with it is refused by
name at setup, and Lightning's optimizer step runs its closure with the step done inside the
closure's backward (:class:`lightning_tbp.optim.OptimizerInBackward`).

Lightning calls ``Strategy.optimizer_step`` once per optimizer step, with a closure that runs the
last micro-batch's ``training_step``, ``zero_grad`` and backward, then the hooks and gradient
clipping before the step. Here the closure runs inside ``OptimizerInBackward.stepping``, so the
backward steps each parameter and frees its gradient, and the precision plugin's
``optimizer.step`` only runs the closure. Micro-batches that only accumulate run their closures
outside, so their gradients accumulate as usual. What reads every gradient between the backward
and the step would read none, so it is refused: norm clipping, ``on_before_optimizer_step``
hooks, a grad scaler; clipping by value is per element and is done per parameter before its step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from lightning_tbp.optim import OptimizerInBackward


class StepInBackward:
    """One fit's optimizer inside the backward, for a strategy that trains on one device."""

    def __init__(self) -> None:
        self.stepper: OptimizerInBackward | None = None
        self._trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, optimizers: list[Optimizer]) -> None:
        """Refuse what cannot compose (``ValueError`` naming it), then hook the optimizer in."""
        refusals = refusals_of(trainer, module, optimizers)
        if refusals:
            raise ValueError(
                "optimizer_in_backward=True cannot run here: "
                + "; ".join(refusals)
                + ". Change these, or train with optimizer_in_backward=False"
            )
        clip = trainer.gradient_clip_val
        before_step = None
        if clip:
            limit = float(clip)

            def before_step(param: torch.Tensor) -> None:
                assert param.grad is not None
                param.grad.clamp_(min=-limit, max=limit)  # as torch.nn.utils.clip_grad_value_

        self.stepper = OptimizerInBackward(optimizers[0], before_step)
        self._trainer = trainer

    def optimizer_step(self, optimizer: Optimizer, lightning_step: Callable[[Any], Any]) -> Any:
        """Run Lightning's step (closure, hooks) with ``optimizer``'s step inside its backward.

        Clipping by value was done per parameter before its step, so the precision plugin's own
        clipping after the closure, which would find no gradient left, is switched off meanwhile."""
        trainer = self._trainer
        assert self.stepper is not None and trainer is not None and optimizer is self.stepper.optimizer
        clip = trainer.gradient_clip_val
        trainer.gradient_clip_val = None
        try:
            with self.stepper.stepping():
                return lightning_step(_StepDoneInBackward(optimizer))
        finally:
            trainer.gradient_clip_val = clip

    def report_state_to(self, state_made: Callable[[int], None]) -> None:
        """Tell ``state_made`` around each parameter's first step (``OptimizerInBackward.state_made``)."""
        assert self.stepper is not None
        self.stepper.state_made = state_made

    def teardown(self) -> None:
        if self.stepper is not None:
            self.stepper.remove()
            self.stepper = None


def refusals_of(trainer: pl.Trainer, module: pl.LightningModule, optimizers: list[Optimizer]) -> list[str]:
    """What in this fit needs every gradient between the backward and the step, by name."""
    refusals = []
    if not module.automatic_optimization:
        refusals.append(
            "the module optimizes manually (automatic_optimization=False), so its backward runs outside "
            "the optimizer step"
        )
    if len(optimizers) != 1:
        refusals.append(f"the module has {len(optimizers)} optimizers; one is supported")
    if trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") != "value":
        refusals.append(
            "gradient_clip_val clips by the norm of every gradient, which no parameter's step can wait for "
            "(gradient_clip_algorithm='value' clips each gradient alone and is supported)"
        )
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        refusals.append("the module's configure_gradient_clipping reads the gradients after the backward")
    if is_overridden("on_before_optimizer_step", module, pl.LightningModule):
        refusals.append("the module's on_before_optimizer_step would see no gradients (each is freed at its step)")
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    hooked = [type(c).__name__ for c in callbacks if is_overridden("on_before_optimizer_step", c, Callback)]
    if hooked:
        refusals.append(f"on_before_optimizer_step of {', '.join(hooked)} would see no gradients")
    precision = trainer.precision_plugin
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        refusals.append(
            "16-mixed's grad scaler checks every gradient for infinities before any step (bf16-mixed has none)"
        )
    return refusals


class _StepDoneInBackward:
    """The optimizer as the precision plugin steps it: the step already happened in the closure's
    backward, so ``step`` runs the closure only; everything else is the optimizer's."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
