"""The same training step run for real, metered exactly: what an estimate is checked against.

``measure_step(build)`` builds the step with real tensors, runs one step (so the optimizer
makes its state), then meters a second one with the exact allocator meter
(``memory.meters``): the device total is what is held when it starts (parameters, buffers,
optimizer state, batch) plus the metered peak. Only for steps that fit on this machine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from lightning_tbp.compat import tree_flatten
from lightning_tbp.estimate.step import TrainingStep, clear_grads, module_state_bytes, stepping, storage_bytes
from lightning_tbp.memory.breakdown import plain_tensors
from lightning_tbp.memory.meters import allocator_peak, garbage_collection_held
from lightning_tbp.optim import OptimizerInBackward
from lightning_tbp.optim.host_state import HostOptimizerState


@dataclass(frozen=True)
class MeasuredStep:
    held_bytes: int  # parameters, buffers, optimizer state and batch when the step starts
    step_peak_bytes: int  # exact allocator peak of the step above that

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.step_peak_bytes


def measure_step(
    build: Callable[[], TrainingStep],
    device: str = "cpu",
    step_in_backward: bool = False,
    state_on_host: bool = False,
    hosted: Collection[str] | None = None,
) -> MeasuredStep:
    """``step_in_backward``: the metered step steps each parameter inside its backward;
    ``state_on_host``: there, on the host, where the optimizer's state then is (with
    ``step_in_backward``; ``optim/host_state.py``), for the target's parameters of these names
    only with ``hosted``."""
    step = build()
    step.optimizer_step(step.forward_backward)
    clear_grads(step)
    parameters, seen = module_state_bytes(step.modules, 1)
    stepper = OptimizerInBackward(step.optimizers[0]) if step_in_backward else None
    chosen = None if hosted is None else [p for n, p in step.target.named_parameters() if n in hosted]
    on_host = {id(p) for o in step.optimizers for p in o.state} if chosen is None else {id(p) for p in chosen}
    state = storage_bytes(
        (
            t
            for o in step.optimizers
            for p, s in o.state.items()
            if not (state_on_host and id(p) in on_host)
            for t in plain_tensors(s)
        ),
        1,
        seen,
    )
    if stepper is not None and state_on_host:
        stepper.host = HostOptimizerState(stepper.optimizer, hosted=chosen)
    batch = storage_bytes((t for t in tree_flatten(step.batch)[0] if isinstance(t, torch.Tensor)), 1, seen)

    def closure() -> Any:
        with stepping(stepper):
            return step.forward_backward()

    gc.collect()
    try:
        with garbage_collection_held(), allocator_peak(device) as meter:
            step.optimizer_step(closure)
    finally:
        if stepper is not None:
            stepper.remove()
    return MeasuredStep(sum(parameters.values()) + state + batch, meter.peak_bytes)
