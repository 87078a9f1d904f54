"""A LightningModule's training step as an estimate runs it: Lightning's hooks, no Trainer.

The step is what automatic optimisation does: the optimizer's closure runs ``training_step``
inside the precision plugin's context and backpropagates its loss, and the LightningModule's
own ``optimizer_step`` runs the optimizer (so an override that updates EMA weights after it
runs too). Nothing here needs a device: the caller builds the module and batch under fake
tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_tbp.estimate.step import TrainingStep
from lightning_tbp.privacy import attach
from lightning_tbp.strategies.common import default_target
from lightning_tbp.strategies.privacy import PrivacyConfig, per_sample_losses


def precision_plugin(precision: str | int) -> Precision:
    """Lightning's precision plugin for a Trainer ``precision`` value, for the CPU the trace runs on."""
    name = str(precision)
    if name in ("bf16-mixed", "16-mixed"):
        return MixedPrecision(name, device="cpu")
    if name in ("bf16-true", "16-true", "bf16", "16"):
        return HalfPrecision({"bf16": "bf16-true", "16": "16-true"}.get(name, name))
    if name in ("64-true", "64"):
        return DoublePrecision()
    if name in ("32-true", "32"):
        return Precision()
    raise ValueError(
        f"precision={precision!r} cannot be estimated; use 32-true, bf16-mixed, 16-mixed, bf16-true or 16-true"
    )


def the_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The one optimizer in what ``configure_optimizers`` returned (an optimizer, a dict with
    ``"optimizer"``, or lists/tuples of those with schedulers)."""
    found: list[torch.optim.Optimizer] = []

    def walk(item: Any) -> None:
        if isinstance(item, torch.optim.Optimizer):
            found.append(item)
        elif isinstance(item, Mapping):
            walk(item.get("optimizer"))
        elif isinstance(item, (list, tuple)):
            for entry in item:
                walk(entry)

    walk(configured)
    if len(found) != 1:
        raise ValueError(
            f"configure_optimizers returned {len(found)} optimizers; an estimate covers automatic optimisation "
            "with exactly one"
        )
    return found[0]


def lightning_step(
    module: pl.LightningModule,
    batch: Any,
    *,
    precision: str | int = "32-true",
    target: str | None = None,
    privacy: PrivacyConfig | None = None,
) -> TrainingStep:
    """The training step of ``module`` on ``batch`` (both built under fake tensors).

    ``privacy``: a DP strategy's options. The engine is attached to the module as the strategy
    attaches it, ``training_step`` returns the per-sample loss, and the engine's backward (its
    passes, book and noise) replaces ``loss.backward()``."""
    plugin = precision_plugin(precision)
    module = plugin.convert_module(module)
    batch = plugin.convert_input(batch)
    optimizer = the_optimizer(module.configure_optimizers())
    planned = module.get_submodule(target) if target else default_target(module)[0]
    # any noise multiplier but 0 draws the noise (its transient counts); its value changes no byte
    engine = attach(module, privacy.mode, privacy.max_grad_norm, 1.0) if privacy is not None else None
    zero_grad_first = [False]

    def zero_grad_before_backward(on: bool) -> None:
        zero_grad_first[0] = on

    def forward_backward() -> torch.Tensor:
        per_sample = per_sample_losses() if engine is not None else contextlib.nullcontext()
        with warnings.catch_warnings(), plugin.train_step_context(), per_sample:
            warnings.filterwarnings("ignore", message=".*self.log.*")  # there is no Trainer to log to
            output = module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if zero_grad_first[0]:  # Lightning's closure: training_step, zero_grad, backward
            module.optimizer_zero_grad(0, 0, optimizer)
        if engine is None:
            loss.backward()
        else:
            engine.backward(loss)
        return loss

    def optimizer_step(closure: Any) -> None:
        module.optimizer_step(0, 0, optimizer, closure)

    modules = dict(module.named_children())
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        modules[type(module).__name__] = module  # its own tensors (children's are counted once already)
    return TrainingStep(
        modules,
        planned,
        batch,
        forward_backward,
        optimizer_step,
        [optimizer],
        zero_grad_before_backward=zero_grad_before_backward,
        sharded_copies=tuple(getattr(module, "sharded_copies", ())),
    )
