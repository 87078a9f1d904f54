"""``tbp estimate -c CONFIG``: a LightningCLI config's training step, estimated.

The config is parsed by Lightning's own CLI (``run=False``: nothing is fitted) with every object
made under fake tensors: the LightningModule (and its model), the datamodule, the Trainer. The
batch comes from the datamodule's ``example_batch()`` (shapes without data; the recipes'
datamodules have one), the precision from the Trainer, the planned target and the layout
(DDP/FSDP2, world size) from its strategy.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_tbp.estimate.device import DeviceModel
from lightning_tbp.estimate.layout import Layout
from lightning_tbp.estimate.lightning import lightning_step
from lightning_tbp.estimate.step import StepEstimate, TrainingStep, estimate_step


class EstimateConfigError(ValueError):
    """The config cannot be estimated (and why)."""


def layout_of(trainer: pl.Trainer) -> Layout:
    """DDP or FSDP2 and the world size from the Trainer's strategy; one device otherwise."""
    world = trainer.num_devices * trainer.num_nodes
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return Layout("fsdp2", world)
    if isinstance(strategy, FSDPStrategy):
        raise EstimateConfigError("FSDP1 layouts are not estimated; use tiny_backprop_fsdp2 (FSDP2)")
    if isinstance(strategy, DDPStrategy):
        return Layout("ddp", world)
    return Layout()


def estimate_config(
    args: Sequence[str],
    *,
    device: str | DeviceModel = "cuda",
    device_memory: int | None = None,
    minimum: bool = True,
) -> StepEstimate:
    """Estimate the training step of the config in ``args`` (LightningCLI arguments, ``-c`` included)."""
    from lightning_tbp.cli import run_lightning_cli  # the CLI module imports this one

    def build() -> TrainingStep:
        cli = run_lightning_cli(args, run=False)
        trainer, module, data = cli.trainer, cli.model, cli.datamodule
        if data is None or not hasattr(data, "example_batch"):
            raise EstimateConfigError(
                f"the datamodule {type(data).__name__} has no example_batch() method: an estimate needs a training "
                "batch's shapes without reading data (the recipes' datamodules have one)"
            )
        target = getattr(trainer.strategy, "target", None)
        privacy = getattr(trainer.strategy, "privacy", None)
        step = lightning_step(
            module,
            data.example_batch(),
            precision=trainer.precision,
            target=target,
            privacy=None if privacy is None else privacy.config,
        )
        step.layout = layout_of(trainer)
        return step

    return estimate_step(build, device=device, device_memory=device_memory, minimum=minimum)
