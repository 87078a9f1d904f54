"""``tbp estimate -c CONFIG``: a LightningCLI config's training step, estimated.

The config is parsed by Lightning's own CLI (``run=False``: nothing is fitted) with every object
made under fake tensors: the LightningModule (and its model), the datamodule, the Trainer. The
batch comes from the datamodule's ``example_batch()`` (shapes without data; the recipes'
datamodules have one), the precision from the Trainer, the planned target and the layout
(DDP/FSDP2, world size) from its strategy.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_tbp.estimate.device import DeviceModel
from lightning_tbp.estimate.layout import Layout
from lightning_tbp.estimate.lightning import lightning_step
from lightning_tbp.estimate.step import StepEstimate, TrainingStep, estimate_step
from lightning_tbp.lightning_cli import run_lightning_cli
from lightning_tbp.optim.host_state import fewest_covering
from lightning_tbp.remat.solve import DEFAULT_MAX_SLOWDOWN
from lightning_tbp.remat.step import PART_FACTORS, PriorGradients
from lightning_tbp.strategies.common import TinyBackpropMixin
from lightning_tbp.strategies.distributed import TinyBackpropDDPStrategy, TinyBackpropFSDP2Strategy
from lightning_tbp.strategies.tiny_backprop import TinyBackpropStrategy

#: The tiny_backprop strategy of each layout an estimate models.
STRATEGY_OF_LAYOUT: dict[str, type[TinyBackpropMixin]] = {
    "single": TinyBackpropStrategy,
    "ddp": TinyBackpropDDPStrategy,
    "fsdp2": TinyBackpropFSDP2Strategy,
}


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


def loop_cases(trainer: pl.Trainer) -> frozenset[PriorGradients]:
    """The gradients alive at a step's forward in the Trainer's loop: the tiny_backprop strategies
    free the last step's before the forward, Lightning's own loop zeroes them only before the
    backward; accumulation keeps them through its later micro-batches."""
    cases = {PriorGradients.RELEASED}
    if not isinstance(trainer.strategy, TinyBackpropMixin):
        cases.add(PriorGradients.UNTIL_BACKWARD)
    if trainer.accumulate_grad_batches > 1:
        cases.add(PriorGradients.ACCUMULATED)
    return frozenset(cases)


def budget_arguments(configured: object, strategy: object, layout: Layout) -> str:
    """The LightningCLI arguments that train a config under the tiny_backprop strategy of its
    layout, a budget to follow. ``configured``: the config's ``trainer.strategy`` as parsed;
    ``strategy``: the one it made. Where the config already names that class with its options
    (``class_path``), only the budget changes (``init_args``: naming the class again would reset
    its other options to their defaults); a name (``tiny_backprop_fsdp2``, ``ddp``) is replaced
    by the class."""
    kind = STRATEGY_OF_LAYOUT[layout.kind]
    if type(strategy) is kind and getattr(configured, "class_path", None) is not None:
        return "--trainer.strategy.init_args.memory_budget="
    return f"--trainer.strategy=lightning_tbp.{kind.__name__} --trainer.strategy.memory_budget="


def device_of(accelerator: object) -> str:
    """The device an estimate models for a config's ``trainer.accelerator``: ``cpu`` for the CPU,
    else CUDA (``auto`` too: a config run where a GPU is trains on it)."""
    return "cpu" if str(accelerator).lower() == "cpu" else "cuda"


def estimate_config(
    args: Sequence[str],
    *,
    device: str | DeviceModel | None = None,
    device_memory: int | None = None,
    minimum: bool = True,
) -> StepEstimate:
    """Estimate the training step of the config in ``args`` (LightningCLI arguments, ``-c`` included).

    ``device``: the device modelled; by default the config's ``trainer.accelerator`` says
    (:func:`device_of`). The estimate names the options of the config's strategy it assumed
    (``StepEstimate.assumed``), carries its ``max_slowdown`` for the verdict, and times the whole
    of it (every step estimated, every build of the config)."""
    started = time.perf_counter()
    assumed: dict[str, object] = {}
    estimate = _estimate_config(args, device, device_memory, minimum, assumed)
    max_slowdown = assumed.get("max_slowdown", DEFAULT_MAX_SLOWDOWN)
    assert max_slowdown is None or isinstance(max_slowdown, int | float)
    for each in (estimate, estimate.with_step_in_backward, estimate.with_host_tier):
        if each is not None:
            each.max_slowdown, each.assumed = max_slowdown, assumed
    estimate.estimate_seconds = time.perf_counter() - started
    return estimate


def _estimate_config(
    args: Sequence[str],
    device: str | DeviceModel | None,
    device_memory: int | None,
    minimum: bool,
    assumed: dict[str, object],
) -> StepEstimate:
    """:func:`estimate_config`; the first build of the config fills ``assumed``."""

    def build() -> TrainingStep:
        cli, accelerator = _cli_without_the_device(args, device)
        trainer, module, data = cli.trainer, cli.model, cli.datamodule
        if hasattr(data, "use_module"):  # a datamodule that reads its pipeline from the module's (captioned images)
            data.use_module(module)
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
        configured = cli.config.get("trainer", {}).get("strategy")
        step.budget_arguments = budget_arguments(configured, trainer.strategy, step.layout)
        step.gradients_at_forward = loop_cases(trainer)
        step.device = device_of(accelerator)
        mode = getattr(trainer.strategy, "optimizer_in_backward", False)
        strategy = trainer.strategy
        blocked = (  # only the tiny_backprop strategies step inside the backward: others' mode is False
            strategy.fused_step_blockers(trainer, module, step.optimizers, automatic=mode == "auto")
            if isinstance(strategy, TinyBackpropMixin)
            else []
        )
        modes.append((mode, blocked))
        host_mode = getattr(trainer.strategy, "host_tier", "off")
        host_modes.append(host_mode if getattr(trainer.strategy, "host_tier_supported", False) else "off")
        state_on_host = getattr(trainer.strategy, "optimizer_state_on_host", "auto")
        state_modes.append(state_on_host if getattr(trainer.strategy, "state_on_host_supported", False) else False)
        master_dtypes.append(getattr(trainer.strategy, "master_dtype", None))
        if not assumed:
            assumed.update(
                strategy=type(strategy).__name__,
                optimizer=", ".join(type(optimizer).__name__ for optimizer in step.optimizers),
                optimizer_in_backward=mode,
                host_tier=host_modes[-1],
                max_slowdown=getattr(strategy, "max_slowdown", DEFAULT_MAX_SLOWDOWN),
            )
        return step

    modes: list[tuple[bool | str, list[str]]] = []
    host_modes: list[str] = []
    state_modes: list[bool | str] = []
    master_dtypes: list[torch.dtype | None] = []
    estimate = estimate_step(build, device=device, device_memory=device_memory, minimum=minimum)
    mode, blocked = modes[0]
    host_mode, state_mode = host_modes[0], state_modes[0]
    if state_mode is True:  # the strategy refused what cannot run with it; so from the first step
        return estimate_step(
            build,
            device=device,
            device_memory=device_memory,
            minimum=minimum,
            step_in_backward=True,
            host_tier=host_mode == "on",
            state_on_host=True,
            master_dtype=master_dtypes[0],
        )
    if mode is True:
        if blocked:
            raise EstimateConfigError(f"optimizer_in_backward=True cannot run in this config: {'; '.join(blocked)}")
        modes.clear()
        estimate = estimate_step(
            build, device=device, device_memory=device_memory, minimum=minimum, step_in_backward=True
        )
    elif mode == "auto" and not blocked and estimate.fit is not None and not _fits(estimate):
        # what the planner would take: the same step with the optimizer inside the backward
        estimate.with_step_in_backward = estimate_step(
            build, device=device, device_memory=device_memory, minimum=minimum, step_in_backward=True
        )
    fused = estimate.step_in_backward or estimate.with_step_in_backward is not None
    still_out = estimate.fit is not None and not _fits(estimate)
    if estimate.with_step_in_backward is not None:
        still_out = still_out and not _fits(estimate.with_step_in_backward)
    if host_mode == "on" or (host_mode == "auto" and still_out):
        # what the planner would take on top: saved activations offloaded to host memory and
        # frozen weights streamed from it, and after that the optimizer's state and step there
        with_host_tier = functools.partial(
            estimate_step, build, device=device, device_memory=device_memory, minimum=minimum, host_tier=True
        )
        state_on_device: StepEstimate | None = None
        for state_on_host in (False, True) if fused and state_mode == "auto" else (False,):
            estimate.with_host_tier = with_host_tier(step_in_backward=fused, state_on_host=state_on_host)
            if estimate.fit is None or _fits(estimate.with_host_tier):
                break
            state_on_device = estimate.with_host_tier
        whole = estimate.with_host_tier
        if state_on_device is not None and whole is not None and whole.host_state_bytes and _fits(whole):
            estimate.with_host_tier = _part_on_host(with_host_tier, state_on_device, whole)
    return estimate


def _cli_without_the_device(args: Sequence[str], device: str | DeviceModel | None) -> tuple[Any, object]:
    """The config's LightningCLI, built without running, and its ``trainer.accelerator``. A GPU
    config estimated on a machine without one (``--device cuda``, or the config's own
    ``accelerator: gpu``) is built with ``accelerator=cpu``: Lightning refuses a GPU Trainer there,
    and the estimate needs only its objects, never the device (the device modelled stays CUDA)."""
    try:
        cli = run_lightning_cli(args, run=False)
    except MisconfigurationException as error:
        modelled = device.name if isinstance(device, DeviceModel) else device
        no_gpu = not torch.cuda.is_available() and re.search(r"\b(gpu|cuda)\b", str(error), re.IGNORECASE)
        if modelled == "cpu" or not no_gpu:
            raise
        return run_lightning_cli([*args, "--trainer.accelerator=cpu"], run=False), "cuda"
    return cli, cli.config.get("trainer", {}).get("accelerator", "auto")


def _part_on_host(
    with_host_tier: Callable[..., StepEstimate], state_on_device: StepEstimate, whole: StepEstimate
) -> StepEstimate:
    """What the strategy takes where the optimizer's state on the host makes the step fit: the
    state of the fewest parameters (most state first) that covers what the device lacked with it
    all on the device (and of those covering twice and four times that: ``PART_FACTORS``), or
    all of it, whichever fits and is predicted fastest (``strategies/state_on_host.py``).
    ``with_host_tier``: ``estimate_step`` for this config and device, with the host tier."""
    short = state_on_device.fit.short_bytes if state_on_device.fit is not None else None
    if short is None:
        return whole
    sizes = state_on_device.state_bytes_by_parameter
    names = list(sizes)
    best, tried = whole, set()
    for factor in PART_FACTORS:
        chosen = fewest_covering([sizes[name] for name in names], short * factor)
        if chosen is None or len(chosen) == len(names):
            break  # only the whole covers it
        if len(chosen) in tried:
            continue
        tried.add(len(chosen))
        part = with_host_tier(step_in_backward=True, state_on_host=True, hosted=[names[i] for i in chosen])
        if _fits(part) and part.total_step_seconds < best.total_step_seconds:
            best = part
    return best


def _fits(estimate: StepEstimate) -> bool:
    fit = estimate.fit
    return fit is not None and (fit.fits_without_plan or fit.fits_with_plan)
