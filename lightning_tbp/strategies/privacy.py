"""DP-SGD inside a Lightning strategy: the part every tiny_backprop strategy shares.

``PrivateTraining`` owns the engine, the Poisson-sampled train loader, the noise schedule and
the accountant. The strategy calls it at four points: ``setup`` (attach the engine),
``process_dataloader`` (re-sample the train loader), ``backward`` (clip per sample, no noise yet)
and ``optimizer_step`` (noise once per logical batch, divide by the expected logical batch size,
one accountant step; with the optimizer inside the backward each parameter is noised and
averaged as its clipped sum completes). The backward goes through Lightning's own chain (precision plugin,
callbacks' and the module's hooks, a user's ``LightningModule.backward``): the strategy hands it
the loss as a :class:`PerSampleLoss`, whose ``backward()`` is the engine's. ``PrivacyCallback``
logs ε every epoch and carries the accountant in Lightning checkpoints, so a resumed run keeps
the privacy it already spent.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_tbp.compat import foreach_div_, tree_flatten
from lightning_tbp.privacy import MODES, DPEngine, PerSampleLossError, attach
from lightning_tbp.privacy.accounting import ACCOUNTANTS, PrivacyAccountant, calibrate_noise, epsilon_of
from lightning_tbp.privacy.sampling import poisson_loader


@dataclass
class PrivacyConfig:
    """The DP options a strategy takes (see ``TinyBackpropStrategy``)."""

    mode: str
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float = 1e-5
    accountant: str = "prv"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"dp must be one of {', '.join(MODES)} (or None), got {self.mode!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("with dp, give exactly one of noise_multiplier and target_epsilon")
        _require(self.max_grad_norm, "max_grad_norm", "positive", lambda v: v > 0)
        if self.noise_multiplier is not None:
            _require(self.noise_multiplier, "noise_multiplier", "non-negative", lambda v: v >= 0)
        if self.target_epsilon is not None:
            _require(self.target_epsilon, "target_epsilon", "positive", lambda v: v > 0)
        _require(self.target_delta, "target_delta", "in (0, 1)", lambda v: 0 < v < 1)


def _require(value: float, name: str, what: str, ok: Callable[[float], bool]) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
        raise ValueError(f"{name} must be {what} and finite, got {value!r}")


class PrivacyBudgetExceededError(RuntimeError):
    """A step would take the run past its target ε (more steps than it was calibrated for)."""


#: The DP backward of the step in progress: set by the strategy while Lightning's backward chain runs.
_STEP_BACKWARD: ContextVar[Callable[[torch.Tensor], None] | None] = ContextVar("dp_step_backward", default=None)


class PerSampleLoss(torch.Tensor):
    """The per-sample loss while Lightning's backward chain runs under DP: ``backward()`` clips.

    Lightning ends its chain in ``LightningModule.backward``, which calls ``loss.backward()``. A
    plain tensor would backpropagate once, unclipped. The strategy's ``pre_backward`` hook gives
    the chain's loss this class (same tensor, same graph; :meth:`PrivateTraining.backward_starting`)
    and its ``backward()`` runs the engine's backward instead, so the precision plugin, every hook
    and a user's ``backward`` override stay in the chain, and the strategy overrides no step of
    it. Arithmetic keeps the type (a ``backward`` override may scale the loss); the loss gets its
    own class back as its backward starts, and outside a DP step ``backward()`` refuses.
    """

    @override
    def backward(  # type: ignore[override]
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: object = None,
    ) -> None:
        self.__class__ = torch.Tensor
        step = _STEP_BACKWARD.get()
        if step is None:
            raise RuntimeError("this per-sample loss belongs to a DP step that has ended; backward() runs only once")
        given = {"gradient": gradient, "retain_graph": retain_graph, "create_graph": create_graph, "inputs": inputs}
        given = {name: value for name, value in given.items() if value not in (None, False)}
        if given:
            raise ValueError(
                f"under DP, loss.backward() takes no arguments (got {', '.join(given)}): the engine runs the "
                "passes per-sample clipping needs. A LightningModule.backward override must call loss.backward()"
            )
        _STEP_BACKWARD.set(None)  # once per step
        step(self)


#: Set while a DP step runs outside a Trainer (``tbp estimate``): ``training_step`` returns per sample.
_PER_SAMPLE_OUTSIDE_TRAINER: ContextVar[bool] = ContextVar("per_sample_loss_outside_trainer", default=False)


def wants_per_sample_loss(trainer: pl.Trainer | None) -> bool:
    """True when the Trainer's strategy trains privately, so ``training_step`` must return a [B] loss
    (or when a DP step runs outside a Trainer, inside :func:`per_sample_losses`)."""
    if _PER_SAMPLE_OUTSIDE_TRAINER.get():
        return True
    return trainer is not None and getattr(trainer.strategy, "privacy", None) is not None


@contextlib.contextmanager
def per_sample_losses() -> Iterator[None]:
    """Ask ``training_step`` for the per-sample loss with no Trainer attached: ``tbp estimate``
    runs a DP config's step through the module's own ``training_step``, without a Trainer."""
    token = _PER_SAMPLE_OUTSIDE_TRAINER.set(True)
    try:
        yield
    finally:
        _PER_SAMPLE_OUTSIDE_TRAINER.reset(token)


class PrivateTraining:
    """Per-sample clipping, Poisson sampling, noise and accounting for one LightningModule."""

    def __init__(self, config: PrivacyConfig) -> None:
        self.config = config
        self.accountant = PrivacyAccountant(config.accountant, config.target_delta)
        self.noise_multiplier = config.noise_multiplier
        self.engine: DPEngine | None = None
        self.sample_rate: float | None = None
        self.expected_batch_size: float | None = None
        self.micro_batch_ceiling: int | None = None
        self.planned_steps = 0
        self.gradient_sum: Callable[[list[torch.Tensor]], None] | None = None
        self.callback = PrivacyCallback(self)
        self._loss: torch.Tensor | None = None  # the loss of the backward chain in progress

    def setup(
        self,
        trainer: pl.Trainer,
        module: torch.nn.Module,
        gradient_sum: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        """``gradient_sum``: sums gradients over the processes in place (None: one process)."""
        self.gradient_sum = gradient_sum
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            raise ValueError(
                "DP clips each sample's gradient, which a loss scaler (precision='16-mixed') would scale "
                "first; use precision='bf16-mixed' or 32"
            )
        if self.engine is None:
            self.engine = attach(module, self.config.mode, self.config.max_grad_norm, self.noise_multiplier or 0.0)

    def process_train_loader(
        self, loader: DataLoader, trainer: pl.Trainer, rank: int = 0, world_size: int = 1
    ) -> DataLoader:
        """Poisson logical batches; with several processes each draws from its own share of the data."""
        micro_batches = trainer.accumulate_grad_batches
        private = poisson_loader(loader, micro_batches, rank, world_size)
        sampler = private.batch_sampler
        self.sample_rate = sampler.sample_rate
        self.expected_batch_size = sampler.sample_rate * sampler.num_samples
        self.micro_batch_ceiling = sampler.micro_batch_ceiling()
        self.planned_steps = trainer.max_steps if trainer.max_steps > 0 else (trainer.max_epochs or 0) * sampler.steps
        if self.config.target_epsilon is not None:
            self._calibrate()
        self.engine.noise_multiplier = self.noise_multiplier
        rank_zero_info(
            f"DP ({self.config.mode}): Poisson sampling, expected logical batch {self.expected_batch_size:g} "
            f"over {world_size} process(es) in {micro_batches} micro-batch(es), clip {self.config.max_grad_norm}, "
            f"noise multiplier {self.noise_multiplier:.4f}"
        )
        return private

    def _calibrate(self) -> None:
        """Noise for the steps still planned, given what the run (a resumed one too) already spent."""
        history = list(self.accountant.history)
        taken = self.accountant.steps
        remaining = self.planned_steps - taken
        self.noise_multiplier = calibrate_noise(
            self.config.target_epsilon,
            self.config.target_delta,
            self.sample_rate,
            remaining,
            self.config.accountant,
            history,
        )
        spent = f", after epsilon {self.epsilon():.3f} spent in {taken} steps" if taken else ""
        rank_zero_info(
            f"DP: noise multiplier {self.noise_multiplier:.4f} keeps {remaining} steps at sampling rate "
            f"{self.sample_rate:.5f} within epsilon {self.config.target_epsilon}{spent} "
            f"(delta {self.config.target_delta}, {self.config.accountant} accountant)"
        )

    def planned_epsilon(self) -> float:
        """ε at the end of the planned steps, if they run at the current noise."""
        remaining = max(0, self.planned_steps - self.accountant.steps)
        future = [(self.noise_multiplier, self.sample_rate, remaining)] if remaining else []
        return epsilon_of([*self.accountant.history, *future], self.config.target_delta, self.config.accountant)

    def backward_starting(self, loss: torch.Tensor, trainer: pl.Trainer) -> None:
        """Lightning's backward chain starts on ``loss``: its ``backward()`` is this step's
        (:class:`PerSampleLoss`) until :meth:`backward_ended`."""
        if type(loss) is not torch.Tensor:
            raise TypeError(
                f"under DP the loss Lightning backpropagates must be a plain tensor, got {type(loss).__name__}: "
                "return the per-sample loss from training_step (or pass it to manual_backward) as a torch.Tensor"
            )
        loss.__class__ = PerSampleLoss
        self._loss = loss
        _STEP_BACKWARD.set(partial(self.backward, trainer=trainer))

    def backward_ended(self) -> None:
        """Lightning's backward chain is over; raises if it never called ``loss.backward()``."""
        unclipped = _STEP_BACKWARD.get() is not None
        self.backward_abandoned()
        if unclipped:
            raise RuntimeError(
                "the backward chain never called loss.backward(), so no sample's gradient was clipped: a "
                "LightningModule.backward override must call loss.backward() under DP"
            )

    def backward_abandoned(self) -> None:
        """No DP backward is in progress any more (the chain ended, or raised): the loss gets its
        own class back (if its backward has not given it already)."""
        _STEP_BACKWARD.set(None)
        loss, self._loss = self._loss, None
        if isinstance(loss, PerSampleLoss):
            loss.__class__ = torch.Tensor

    def backward(self, loss: torch.Tensor, trainer: pl.Trainer) -> None:
        if loss.dim() != 1:
            raise PerSampleLossError(
                f"with dp={self.config.mode!r}, training_step must return the per-sample loss, shape [batch] "
                f"(reduce every dimension but the batch, do not average over it); got shape {tuple(loss.shape)}"
            )
        if self.sample_rate is None:
            raise RuntimeError("DP training needs a train DataLoader (it is re-sampled with Poisson sampling)")
        # Lightning divided the loss by accumulate_grad_batches; clipping needs each sample's own gradient.
        self.engine.backward(loss * trainer.accumulate_grad_batches, add_noise=False)

    @staticmethod
    def is_empty(batch: object) -> bool:
        """Whether a micro-batch holds no sample (Poisson sampling can draw none)."""
        leaves = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
        return bool(leaves) and leaves[0].shape[0] == 0

    def begin_logical_batch(self) -> None:
        """Before the logical batch's last backward: refuse a step past the target ε (before any
        parameter can be stepped), and seed the batch's noise (``DPEngine.draw_noise_seed``)."""
        if self.config.target_epsilon is not None and self.accountant.steps >= self.planned_steps:
            raise PrivacyBudgetExceededError(
                f"this would be step {self.accountant.steps + 1} of a run calibrated for {self.planned_steps} steps "
                f"within epsilon {self.config.target_epsilon}: it would spend more (epsilon now "
                f"{self.epsilon():.3f}). Stop at the planned steps, or resume with a larger target_epsilon or "
                "max_steps/max_epochs so the noise is recalibrated"
            )
        self.engine.draw_noise_seed()

    def finish_logical_batch(self, add_noise: bool = True) -> None:
        """Noise once for the logical batch, the average over its expected size, one accountant step.

        With several processes each holds the clipped sum of its own samples: one process adds
        the noise (``add_noise``), the sums are added up, so the global batch gets noise once."""
        grads = []
        for param in self.engine.parameters:
            if add_noise or self.gradient_sum is None:
                self.engine.add_noise_to(param)
            if param.grad is None:  # no sample on this process reached it (an empty micro-batch)
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        if self.gradient_sum is not None:
            self.gradient_sum(grads)
        foreach_div_(grads, self.expected_batch_size)
        self.accountant.step(self.noise_multiplier, self.sample_rate)

    def finish_parameter(self, param: torch.Tensor) -> None:
        """One parameter's part of :meth:`finish_logical_batch`, in one process, as its clipped sum
        completes (the optimizer steps it inside the backward): its noise and the average."""
        assert self.gradient_sum is None, "several processes sum their clipped gradients after the backward"
        self.engine.add_noise_to(param)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.div_(self.expected_batch_size)

    def finish_stepped_batch(self) -> None:
        """The logical batch's parameters were finished and stepped one by one: its accountant step."""
        self.accountant.step(self.noise_multiplier, self.sample_rate)

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "noise_multiplier": self.noise_multiplier,
            "planned_steps": self.planned_steps,
            "epsilon": self.epsilon(),
            **self.accountant.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the privacy spent; with target_epsilon the noise is recalibrated for the steps
        still planned (``process_train_loader``), so a resumed run lands on its target."""
        self.accountant.load_state_dict(state)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.detach()
            self.engine = None


class PrivacyCallback(Callback):
    """Logs ε after every training epoch and stores the accountant in checkpoints."""

    def __init__(self, training: PrivateTraining) -> None:
        self.training = training

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epsilon, planned = self.training.epsilon(), self.training.planned_epsilon()
        pl_module.log("dp/epsilon", epsilon, on_epoch=True, on_step=False)
        pl_module.log("dp/epsilon_planned", planned, on_epoch=True, on_step=False)
        rank_zero_info(
            f"DP: epsilon {epsilon:.3f} (delta {self.training.config.target_delta}) after "
            f"{self.training.accountant.steps} steps; {planned:.3f} at the end of the {self.training.planned_steps} "
            "planned"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.training.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.training.load_state_dict(state_dict)
