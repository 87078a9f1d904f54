"""``TinyBackpropStrategy``: Lightning's single-device strategy plus a rematerialization plan.

Everything Lightning does stays as it is (precision plugin, gradient accumulation, clipping,
hooks): the plan only wraps blocks of the model in checkpoints, so ``loss.backward()`` itself
recomputes what the plan dropped. The plan is made lazily on the first training forward (the
first batch fixes the shapes), re-made for each new input shape, and logged with the predicted
peak; the first step that reuses a plan is metered and the measured peak logged next to it.

With ``dp=...`` the backward becomes DP-SGD's (see :mod:`lightning_tbp.strategies.privacy`):
per-sample clipping in the chosen mode, Poisson-sampled logical batches, noise once per
optimizer step, and privacy accounting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from lightning_tbp.remat import Plan, format_bytes, parse_budget
from lightning_tbp.strategies.privacy import PrivacyConfig, PrivateTraining


class TinyBackpropStrategy(SingleDeviceStrategy):
    """Train on one device (CPU or one GPU) with a planned rematerialization of the model.

    Args:
        memory_budget: peak bytes allowed for the model's forward + backward; see
            :mod:`lightning_tbp.remat.budget` ("auto", a fraction, bytes or "6GiB").
        target: attribute path (e.g. ``"unet"``) of the submodule to plan inside the
            LightningModule. Default: the direct child with the most trainable parameters.
        device: normally left to the Trainer's ``accelerator``/``devices`` flags.
        dp: train with differential privacy: ``"ghost"``, ``"flash"``, ``"bookkeeping"`` or
            ``"flash_bookkeeping"`` (None: no DP). ``training_step`` must then return the
            per-sample loss, shape [batch].
        max_grad_norm: the per-sample clipping threshold C.
        noise_multiplier: sigma (noise std sigma·C on the summed gradient); or instead
        target_epsilon: calibrate sigma so the planned steps spend at most this epsilon.
        target_delta: the delta of (epsilon, delta)-DP.
        accountant: ``"prv"`` (default) or ``"rdp"``, Opacus's accountants.
        memory_budget=None: no rematerialization plan (DP alone).
    """

    strategy_name = "tiny_backprop"

    def __init__(
        self,
        memory_budget: object = "auto",
        target: str | None = None,
        device: str | torch.device | None = None,
        dp: str | None = None,
        max_grad_norm: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        accountant: str = "prv",
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        # fail on bad options before training
        self.memory_budget = None if memory_budget is None else parse_budget(memory_budget)
        self.privacy = (
            None
            if dp is None
            else PrivateTraining(
                PrivacyConfig(dp, max_grad_norm, noise_multiplier, target_epsilon, target_delta, accountant)
            )
        )
        self.target = target
        self.plan: Plan | None = None
        self._device_given = device is not None
        self._reported: set[int] = set()

    # Lightning's connector assigns the devices chosen by the Trainer flags through this property,
    # but only while it reads as empty; a plain SingleDeviceStrategy has none and so silently
    # ignores devices=2.
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f"strategy='tiny_backprop' runs on one device, but the Trainer asked for {len(devices)} "
                f"({devices}). Use devices=1, or a multi-device strategy (tiny_backprop_ddp, "
                "tiny_backprop_fsdp2) when they are available, or Lightning's own 'ddp'/'fsdp'."
            )
        if not self._device_given:
            self._root_device = torch.device(devices[0])

    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer
        if self.privacy is not None and self.privacy.callback not in trainer.callbacks:
            # before Lightning restores callback states from a checkpoint: the accountant rides on it
            trainer.callbacks.append(self.privacy.callback)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == "fit" and self.privacy is not None:
            self.privacy.setup(trainer, self.lightning_module)
        if trainer.state.fn == "fit" and self.plan is None and self.memory_budget is not None:
            module, path = self._target_module()
            self.plan = Plan(module, self.memory_budget, measure=True)
            rank_zero_info(
                f"tiny_backprop: planning {path or type(module).__name__} ({type(module).__name__}) "
                f"under budget {self.memory_budget.describe()} at its first training batch"
            )

    def _target_module(self) -> tuple[nn.Module, str]:
        model = self.lightning_module
        assert model is not None
        if self.target is not None:
            module = model.get_submodule(self.target)
            return module, self.target
        children = [
            (sum(p.numel() for p in child.parameters() if p.requires_grad), name, child)
            for name, child in model.named_children()
        ]
        children = [c for c in children if c[0] > 0]
        if not children:
            return model, ""
        _, name, child = max(children, key=lambda c: c[0])
        return child, name

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if self.privacy is not None and trainer.state.stage == RunningStage.TRAINING:
            return self.privacy.process_train_loader(dataloader, trainer)
        return dataloader

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self.privacy is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Lightning's chain with the engine's backward in the middle (see Strategy.backward).
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.privacy.backward(closure_loss, module.trainer)
        self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.privacy is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_noise() -> Any:
            result = closure()  # the last micro-batch's forward and backward
            self.privacy.finish_logical_batch()
            return result

        return super().optimizer_step(optimizer, closure_then_noise, model, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self.plan is None:
            return
        current = self.plan.current
        if current is not None and id(current) not in self._reported:
            self._reported.add(id(current))
            rank_zero_info(f"tiny_backprop plan:\n{self.plan.report(current)}")
        measured = self.plan.finish_measurement()
        if measured is not None and measured.measured_peak_bytes is not None:
            rank_zero_info(
                f"tiny_backprop: measured peak {format_bytes(measured.measured_peak_bytes)} vs predicted "
                f"{format_bytes(measured.predicted_peak_bytes)} "
                f"({measured.measured_peak_bytes / measured.predicted_peak_bytes:.3f}x)"
            )

    def memory_report_config(self) -> dict[str, Any]:
        """What ``MemoryProfilerCallback`` records about this strategy: the plan in force, the DP mode."""
        dp = (
            None if self.privacy is None else {**self.privacy.state_dict()["config"], "epsilon": self.privacy.epsilon()}
        )
        if self.plan is None or self.plan.current is None:
            return {"plan": None, "dp": dp}
        summary = self.plan.to_dict()
        for detail in ("blocks", "edges", "signature"):
            summary.pop(detail)
        return {"plan": summary, "dp": dp}

    def teardown(self) -> None:
        if self.privacy is not None:
            self.privacy.teardown()
        if self.plan is not None:
            self.plan.remove()  # the module is restored; the plan object stays for its reports
        super().teardown()
