"""``TinyBackpropStrategy``: Lightning's single-device strategy plus a rematerialization plan.

Everything Lightning does stays as it is (precision plugin, gradient accumulation, clipping,
hooks): the plan only wraps blocks of the model in checkpoints, so ``loss.backward()`` itself
recomputes what the plan dropped. The plan is made lazily on the first training forward (the
first batch fixes the shapes), re-made for each new input shape, and logged with the predicted
peak; the first step that reuses a plan is metered and the measured peak logged next to it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_tbp.remat import Plan, format_bytes, parse_budget


class TinyBackpropStrategy(SingleDeviceStrategy):
    """Train on one device (CPU or one GPU) with a planned rematerialization of the model.

    Args:
        memory_budget: peak bytes allowed for the model's forward + backward; see
            :mod:`lightning_tbp.remat.budget` ("auto", a fraction, bytes or "6GiB").
        target: attribute path (e.g. ``"unet"``) of the submodule to plan inside the
            LightningModule. Default: the direct child with the most trainable parameters.
        device: normally left to the Trainer's ``accelerator``/``devices`` flags.
    """

    strategy_name = "tiny_backprop"

    def __init__(
        self,
        memory_budget: object = "auto",
        target: str | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        self.memory_budget = parse_budget(memory_budget)  # fail on a bad budget before training
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

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == "fit" and self.plan is None:
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
        """What ``MemoryProfilerCallback`` records about this strategy: the plan in force."""
        if self.plan is None or self.plan.current is None:
            return {"plan": None}
        summary = self.plan.to_dict()
        for detail in ("blocks", "edges", "signature"):
            summary.pop(detail)
        return {"plan": summary}

    def teardown(self) -> None:
        if self.plan is not None:
            self.plan.remove()  # the module is restored; the plan object stays for its reports
        super().teardown()
