"""``TinyBackpropStrategy``: Lightning's single-device strategy plus a rematerialization plan.

Everything Lightning does stays as it is (precision plugin, gradient accumulation, clipping,
hooks); the shared behaviour (plan, DP-SGD) lives in :mod:`lightning_tbp.strategies.common`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_tbp.remat.budget import BudgetSpec
from lightning_tbp.strategies.common import TinyBackpropMixin


class TinyBackpropStrategy(TinyBackpropMixin, SingleDeviceStrategy):
    """Train on one device (CPU or one GPU) with a planned rematerialization of the model.

    Takes the options of :class:`~lightning_tbp.strategies.common.TinyBackpropMixin`
    (``memory_budget``, ``target``, ``dp``, ``max_grad_norm``, ``noise_multiplier``,
    ``target_epsilon``, ``target_delta``, ``accountant``) and ``device`` (normally left to the
    Trainer's ``accelerator``/``devices`` flags).
    """

    strategy_name = "tiny_backprop"
    global_rank = 0
    world_size = 1

    def __init__(
        self,
        memory_budget: BudgetSpec | None = "auto",
        target: str | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(memory_budget=memory_budget, target=target, device=device or "cpu", **kwargs)
        self._device_given = device is not None

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
                f"({devices}). Use devices=1, or a multi-device strategy: tiny_backprop_ddp, "
                "tiny_backprop_ddp_spawn, tiny_backprop_fsdp (CUDA) or tiny_backprop_fsdp2."
            )
        if not self._device_given:
            self._root_device = torch.device(devices[0])
