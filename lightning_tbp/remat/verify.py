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


def can_meter(device: torch.device) -> bool:
    """CUDA always; CPU unless a profiler is running (the exact CPU meter is one)."""
    return device.type == "cuda" or (device.type == "cpu" and not profiler_active())


class StepMeter:
    """One metering session at a time, opened when a plan's step starts and closed after its backward."""

    def __init__(self) -> None:
        self._session: contextlib.ExitStack | None = None
        self._reading: AllocatorPeak | None = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self, device: torch.device) -> bool:
        """Open a session on ``device`` if none is open and it can be metered; returns whether it did."""
        if self._session is not None or not can_meter(device):
            return False
        self._session = contextlib.ExitStack()
        self._reading = self._session.enter_context(allocator_peak(device))
        return True

    def stop(self) -> int | None:
        """Close the session; its peak in bytes (None if none was open)."""
        if self._session is None:
            return None
        self._session.close()
        peak = self._reading.peak_bytes if self._reading is not None else None
        self._session = self._reading = None
        return peak


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
            text += f"; re-planned with predictions scaled by {self.ratio:.3f}"
        return text
