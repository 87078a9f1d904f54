"""The Lightning side of ``optimizer_in_backward``: what cannot compose with it is refused by name
at setup (``True``) or keeps the planner from taking it (``"auto"``), and Lightning's optimizer
step runs its closure with the step done inside the closure's backward
(:class:`lightning_tbp.optim.OptimizerInBackward`).

With ``"auto"`` the hooks are set up idle, and the plan enables them when a budget cannot be met
otherwise; that happens in a training forward, inside the closure of the step it plans, so each
step decides after its closure's backward whether the optimizer still has to step.

Lightning calls ``Strategy.optimizer_step`` once per optimizer step, with a closure that runs the
last micro-batch's ``training_step``, ``zero_grad`` and backward, then the hooks and gradient
clipping before the step. Here the closure runs inside ``OptimizerInBackward.stepping``, so the
backward steps each parameter and frees its gradient, and the precision plugin's
``optimizer.step`` only runs the closure. Micro-batches that only accumulate run their closures
outside, so their gradients accumulate as usual. What reads every gradient between the backward
and the step would read none, so it is refused: norm clipping, ``on_before_optimizer_step``
hooks, a grad scaler; clipping by value is per element and is done per parameter before its step.

Under DP the engine writes each parameter's clipped sum itself and says when the last of its
contributions is in (``DPEngine.gradient_complete``); the parameter is then noised and averaged
as the logical batch's end would (``PrivateTraining.finish_parameter``), clipped by value if
asked, and stepped. Its noise is the noise the ordinary step would add (each parameter's from its
own stream), and the accountant takes one step per logical batch as before, so ε is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_tbp.optim import OptimizerInBackward, steps_per_parameter
from lightning_tbp.optim.host_state import HostOptimizerState
from lightning_tbp.optim.in_backward import NEEDS_EVERY_GRADIENT
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.strategies.privacy import PrivateTraining


class StepInBackward:
    """One fit's optimizer inside the backward: the optimizer hooked in (what cannot compose must
    have been refused: :func:`blockers`).

    ``enabled=False``: set up idle, stepping as usual until :meth:`enable`. ``private``: the fit's
    DP, whose engine announces each parameter's completed clipped sum. ``hooks=False``: the
    gradients autograd accumulates are not final (DDP's, before their all-reduce): the strategy
    announces each parameter (``stepper.gradient_done``)."""

    def __init__(
        self,
        trainer: pl.Trainer,
        optimizer: Optimizer,
        enabled: bool = True,
        private: PrivateTraining | None = None,
        hooks: bool = True,
    ) -> None:
        clip = trainer.gradient_clip_val
        limit = float(clip) if clip else None

        def before_step(param: torch.Tensor) -> None:
            if private is not None:
                private.finish_parameter(param)  # its noise and the average, as the batch's end would
            if limit is not None:
                assert param.grad is not None
                param.grad.clamp_(min=-limit, max=limit)  # as torch.nn.utils.clip_grad_value_

        needed = private is not None or limit is not None
        self.stepper = OptimizerInBackward(
            optimizer,
            before_step if needed else None,
            enabled=enabled,
            every_parameter=private is not None,
            hooks=hooks,
        )
        self._private = private
        if private is not None:
            assert private.engine is not None
            private.engine.gradient_complete = self.stepper.gradient_done
        self._trainer = trainer
        self._clip: Any = None

    @property
    def enabled(self) -> bool:
        return self.stepper.enabled

    def enable(self) -> None:
        """Step inside the backward from the next backward on."""
        self.stepper.enabled = True

    def keep_state_on_host(
        self, master_dtype: torch.dtype | None = None, hosted: list[torch.Tensor] | None = None
    ) -> None:
        """From the next step on, the optimizer's state lives on the host and each parameter is
        stepped there (:class:`~lightning_tbp.optim.host_state.HostOptimizerState`, with masters
        of ``master_dtype`` for narrower float parameters); ``hosted``: only these parameters'."""
        if self.stepper.host is None:
            self.stepper.host = HostOptimizerState(self.stepper.optimizer, master_dtype, hosted)
            if master_dtype is not None:
                _announce_masters(self.stepper.host)

    def optimizer_step(self, optimizer: Optimizer, lightning_step: Callable[[Any], Any]) -> Any:
        """Run Lightning's step (closure, hooks) with ``optimizer``'s step inside its backward (or,
        while idle, after the closure as usual). The closure must call :meth:`backward_done`."""
        assert optimizer is self.stepper.optimizer
        self._clip = self._trainer.gradient_clip_val
        try:
            with self.stepper.stepping():
                return lightning_step(_StepDoneInBackward(optimizer, self.stepper))
        finally:
            self._trainer.gradient_clip_val = self._clip

    def backward_done(self) -> None:
        """The closure's backward ended. If it stepped, clipping by value was done per parameter
        before its step, so the precision plugin's own clipping after the closure, which would
        find no gradient left, is switched off until the step ends; under DP the logical batch
        takes its accountant step (its parameters were finished one by one, or are as the step
        ends: those the last micro-batch did not reach)."""
        if self.enabled:
            self._trainer.gradient_clip_val = None
            if self._private is not None:
                self._private.finish_stepped_batch()

    def report_state_to(self, state_made: Callable[[int], None]) -> None:
        """Tell ``state_made`` around each parameter's first step (``OptimizerInBackward.state_made``)."""
        self.stepper.state_made = state_made

    def teardown(self) -> None:
        self.stepper.remove()
        if self._private is not None and self._private.engine is not None:
            self._private.engine.gradient_complete = None


def _announce_masters(host: HostOptimizerState) -> None:
    """Say how many parameters got wider masters on the host (none: the option does nothing)."""
    widened = host.widened
    if not widened:
        rank_zero_warn(
            "tiny_backprop: fp32_master_weights has nothing to widen: every trainable parameter is "
            f"{host.master_dtype} or wider already (it is for models trained in bf16 or fp16, e.g. "
            "precision='bf16-true')"
        )
        return
    nbytes = sum(master.numel() * master.element_size() for _, master in widened)
    rank_zero_info(
        f"tiny_backprop: {len(widened)} trainable parameters have {host.master_dtype} masters on the host "
        f"({format_bytes(nbytes)}), stepped there with their optimizer state"
    )


#: The multi-device strategies that hand each parameter's reduced gradient to its step inside the
#: backward: DDP through a communication hook per bucket, FSDP2 through the hooks it runs on each
#: sharded parameter after its reduce-scatter.
REDUCES_PER_BUCKET = frozenset({"ddp", "fsdp2"})


def blockers(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    optimizers: list[Optimizer],
    *,
    private: bool,
    devices: str | None,
    automatic: bool,
) -> list[str]:
    """What keeps the optimizer from stepping inside the backward in this fit, by name: DP on
    several devices, a multi-device strategy that reduces after the backward (``devices``: None
    for one device, else the strategy's kind; :data:`REDUCES_PER_BUCKET` names those that work),
    what needs every gradient (:func:`refusals_of`) and, for ``"auto"`` (``automatic``), an
    optimizer not known to update each parameter on its own."""
    blocked = []
    if private and devices is not None:
        blocked.append(
            "with dp= it runs on one device for now: each process's clipped sums are added up across the "
            "processes after the backward, and no parameter can be noised and stepped before that"
        )
    elif devices is not None and devices not in REDUCES_PER_BUCKET:
        blocked.append(
            f"{devices} reduces the gradients after the backward, so no parameter's reduced gradient is known "
            "inside it (tiny_backprop_ddp and tiny_backprop_fsdp2 step each bucket once it is reduced)"
        )
    blocked += refusals_of(trainer, module, optimizers)
    unknown = [type(o).__name__ for o in optimizers if not steps_per_parameter(o)]
    if automatic and unknown and len(optimizers) == 1:
        blocked.append(
            f"{', '.join(unknown)} is not known to update each parameter from its own gradient alone, so the "
            "weights could differ from its ordinary step (optimizer_in_backward=True takes it if it does)"
        )
    return blocked


def refusals_of(trainer: pl.Trainer, module: pl.LightningModule, optimizers: list[Optimizer]) -> list[str]:
    """What in this fit needs every gradient between the backward and the step, by name."""
    refusals = []
    if len(optimizers) == 1 and isinstance(optimizers[0], NEEDS_EVERY_GRADIENT):
        refusals.append(f"{type(optimizers[0]).__name__}'s step re-evaluates the loss with every gradient at hand")
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
    """The optimizer as the precision plugin steps it: ``step`` runs the closure, whose backward
    stepped each parameter (or, while the stepper is idle, steps after it as usual); everything
    else is the optimizer's."""

    def __init__(self, optimizer: Optimizer, stepper: OptimizerInBackward) -> None:
        self._optimizer = optimizer
        self._stepper = stepper

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        if not self._stepper.enabled:
            self._optimizer.step(**kwargs)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
