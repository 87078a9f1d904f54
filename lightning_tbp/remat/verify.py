"""Plans checked against what really happens: metering a step and the verdict on it.

:class:`StepMeter` owns the metering session of a plan (one at a time): the exact allocator peak
on CPU (a profiler session) or CUDA's allocator statistics. :class:`Verification` compares the
measured peak with the prediction and the budget; when the budget was passed it carries the
correction a re-plan folds in (see :meth:`lightning_tbp.remat.plan.Plan.verify`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, profiler_active
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.remat.replay import output_tensors


def can_meter(device: torch.device) -> bool:
    """CUDA always; CPU unless a profiler is running (the exact CPU meter is one)."""
    return device.type == "cuda" or (device.type == "cpu" and not profiler_active())


@dataclass(frozen=True)
class StepReading:
    """What a metered step measured."""

    peak_bytes: int
    """The step's allocator peak above what was held when its forward started."""
    loss_bytes: int | None = None
    """Peak of the window from the module's forward end to its outputs' first gradient (the
    loss's forward and backward, that gradient included) above the memory held at its start;
    None when the window was not seen (the outputs got no gradient)."""


class StepMeter:
    """One metering session at a time, opened when a plan's step starts and closed after its backward.

    The planner's trace ends with the module's forward, so the step's loss (computed by the
    caller from the module's outputs) is not in it. The meter measures it apart: told where the
    forward ended (:meth:`forward_ended`), it notes that instant and the arrival of the outputs'
    first gradient, and reports the peak of the window between them (``StepReading.loss_bytes``).
    """

    def __init__(self) -> None:
        self._session: contextlib.ExitStack | None = None
        self._reading: AllocatorPeak | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._window = 0  # marks the loss window has seen: 0 (not started), 1 (open) or 2 (closed)

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self, device: torch.device) -> bool:
        """Open a session on ``device`` if none is open and it can be metered; returns whether it did."""
        if self._session is not None or not can_meter(device):
            return False
        self._session = contextlib.ExitStack()
        self._reading = self._session.enter_context(allocator_peak(device))
        self._window = 0
        return True

    def forward_ended(self, output: object) -> None:
        """The metered module's forward returned ``output``: open the loss window (once a session,
        at the first forward whose outputs will get gradients)."""
        differentiable = [t for t in output_tensors(output) if t.requires_grad]
        if self._reading is None or self._window or not differentiable:
            return
        self._reading.mark()
        self._window = 1
        self._hooks = [t.register_hook(self._gradient_arrived) for t in differentiable]

    def _gradient_arrived(self, grad: torch.Tensor) -> None:
        if self._reading is not None and self._window == 1:
            self._reading.mark()
            self._window = 2

    def stop(self) -> StepReading | None:
        """Close the session; what it measured (None if none was open)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._session is None or self._reading is None:
            return None
        self._session.close()
        reading, self._session, self._reading = self._reading, None, None
        loss = None
        if len(reading.marks) >= 2:
            forward_end, loss_end = reading.marks[0], reading.marks[1]
            loss = loss_end.peak_before_bytes - forward_end.level_bytes
        return StepReading(reading.peak_bytes, loss)


@dataclass(frozen=True)
class Verification:
    """A plan's prediction and budget against one measured step."""

    predicted_bytes: int
    measured_bytes: int
    budget_bytes: int
    replanned: bool = False  # the budget was passed and the plan was solved again

    @property
    def ratio(self) -> float:
        """Measured over predicted peak."""
        return self.measured_bytes / max(self.predicted_bytes, 1)

    @property
    def within_budget(self) -> bool:
        return self.measured_bytes <= self.budget_bytes

    def describe(self) -> str:
        verdict = "within" if self.within_budget else "OVER"
        text = (
            f"measured peak {format_bytes(self.measured_bytes)} vs predicted {format_bytes(self.predicted_bytes)} "
            f"({self.ratio:.3f}x), {verdict} the budget {format_bytes(self.budget_bytes)}"
        )
        if self.replanned:
            text += "; re-planned with the measurement folded in"
        return text
