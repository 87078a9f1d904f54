"""Plans checked against what really happens: metering a step, timing steps, the verdict.

:class:`StepMeter` owns the metering session of a plan (one at a time): the exact allocator peak
on CPU (a profiler session) or CUDA's allocator statistics. :class:`Verification` compares the
measured peak with the prediction and the budget; when the budget was passed it carries the
correction a re-plan folds in (see :meth:`lightning_tbp.remat.plan.Plan.verify`).
:class:`StepClock` times a plan's steps once its metered one is over.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, foreign_profiler_active, peak_apart_from
from lightning_tbp.remat.budget import device_level_ratio, format_level
from lightning_tbp.remat.replay import output_tensors
from lightning_tbp.remat.signature import batch_size_of

if TYPE_CHECKING:  # a cycle at run time: shape_plan -> simulate -> trace -> loss -> this module
    from lightning_tbp.remat.shape_plan import ShapePlan


def can_meter(device: torch.device) -> bool:
    """CUDA always; CPU unless a profiler is running (the exact CPU meter is one)."""
    return device.type == "cuda" or (device.type == "cpu" and not foreign_profiler_active())


@dataclass(frozen=True)
class StepReading:
    """What a metered step measured."""

    peak_bytes: int
    """The step's allocator peak above what was held when its forward started."""
    loss_bytes: int | None = None
    """Peak of the window from the module's forward end to its outputs' first gradient (the
    loss's forward and backward, that gradient included) above the memory held at its start;
    None when the window was not seen (the outputs got no gradient)."""
    backward_under_cached_autocast: bool = False
    """Whether the backward started inside an autocast context with its cache on: the weights'
    casts the cache keeps are then alive through the backward, where the plan counts them until
    the backward starts (``Trace.autocast_cached``)."""


class StepMeter:
    """One metering session at a time, opened when a plan's step starts and closed after its backward.

    The planner's trace ends with the module's forward, so the step's loss (computed by the
    caller from the module's outputs) is not in it. The meter measures it apart: shown the
    outputs (:meth:`outputs_made`) and told where the forward ended (:meth:`forward_ended`), it
    notes that instant and the arrival of the outputs' first gradient, and reports the peak of the
    window between them (``StepReading.loss_bytes``). The outputs are shown before the module's
    other forward hooks run, so the gradient's arrival is noted before their tensor hooks run:
    FSDP2's root prefetches a unit's weights from its hook on the outputs, the backward's work,
    which a window closed after it read as the loss's.
    """

    def __init__(self) -> None:
        self._session: contextlib.ExitStack | None = None
        self._reading: AllocatorPeak | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._window = 0  # marks the loss window has seen: 0 (not started), 1 (open) or 2 (closed)
        self._state_marks: dict[int, int] = {}  # mark -> optimizer state made in the step by then
        self._backward_autocast = False  # the backward started under autocast with its cache on

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
        self._state_marks = {}
        self._backward_autocast = False
        return True

    def state_made(self, nbytes: int) -> None:
        """The optimizer, stepping inside the backward, is about to make a parameter's state (0)
        or made ``nbytes`` of it: state is held outside the step, so the stretches of the step
        around these marks are measured without what was made by their end."""
        if self._reading is not None:
            self._reading.mark()
            made = max(self._state_marks.values(), default=0) + nbytes
            self._state_marks[self._window + len(self._state_marks)] = made  # after the loss window's marks

    def outputs_made(self, output: object) -> None:
        """The metered module's forward made ``output`` (its first forward hook): watch for their
        first gradient (once a session, at the first forward whose outputs will get gradients)."""
        if self._reading is None or self._window or self._hooks:
            return
        differentiable = [t for t in output_tensors(output) if t.requires_grad]
        self._hooks = [t.register_hook(self._gradient_arrived) for t in differentiable]

    def forward_ended(self) -> None:
        """The metered module's forward returned (its last forward hook): open the loss window
        where :meth:`outputs_made` watches its outputs."""
        if self._reading is None or self._window or not self._hooks:
            return
        self._reading.mark()
        self._window = 1

    def _gradient_arrived(self, grad: torch.Tensor) -> None:
        if self._reading is not None and self._window == 1:
            self._reading.mark()
            self._window = 2
            device = grad.device.type
            self._backward_autocast = torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled()

    def stop(self) -> StepReading | None:
        """Close the session; what it measured (None if none was open)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._session is None or self._reading is None:
            return None
        if self._state_marks:
            self._reading.mark()  # the stretch after the last state mark
        self._session.close()
        reading, self._session, self._reading = self._reading, None, None
        loss = None
        if len(reading.marks) >= 2:
            forward_end, loss_end = reading.marks[0], reading.marks[1]
            loss = loss_end.peak_before_bytes - forward_end.level_bytes
        peak = reading.peak_bytes
        if self._state_marks:
            peak = peak_apart_from(reading.marks, self._state_marks, 0, len(reading.marks) - 1)
        return StepReading(peak, loss, self._backward_autocast)


@dataclass(frozen=True)
class Verification:
    """A plan's prediction and budget against one measured step."""

    predicted_bytes: int
    measured_bytes: int
    budget_bytes: int
    replanned: bool = False  # the budget was passed and the plan was solved again
    streamed_bytes: int = 0  # weights the plan streams from the host (``budget.device_level_ratio``)

    @property
    def ratio(self) -> float:
        """Measured over predicted peak (as device levels, where the plan streams weights)."""
        return device_level_ratio(self.measured_bytes, self.predicted_bytes, self.streamed_bytes)

    @property
    def within_budget(self) -> bool:
        return self.measured_bytes <= self.budget_bytes

    def describe(self) -> str:
        verdict = "within" if self.within_budget else "OVER"
        text = (
            f"measured peak {format_level(self.measured_bytes, self.streamed_bytes)} vs predicted "
            f"{format_level(self.predicted_bytes, self.streamed_bytes)} ({self.ratio:.3f}x), {verdict} the budget "
            f"{format_level(self.budget_bytes, self.streamed_bytes)}"
        )
        if self.replanned:
            text += "; re-planned with the measurement folded in"
        return text


#: Steps of a plan timed after its metered one and a warm-up; their median is filed on it.
TIMED_STEPS = 5
#: Steps after the metered one not timed: the first few ran 10-30% slower than later ones on
#: this project's CPU (a tiny U-Net: 83-98 ms, then 73-78 ms), which the median of five kept.
WARM_UP_STEPS = 5


class StepClock:
    """Times the forward and backward of a plan's module on the steps after its metered one.

    A metered step runs under the allocator meter (on CPU a profiler session, which slows it),
    so a plan's time is read from ``steps`` steps at the batch it was planned for, after
    ``WARM_UP_STEPS`` more: from
    the module's forward to the end of the backward (the loss between them included; data
    loading, the optimizer and whatever the step does before the forward not). Their median is
    filed on the plan (``ShapePlan.measured_step_ns``) to set beside the prediction, the
    unplanned step's time plus the plan's recomputation. CUDA is synchronised at both ends of
    the timed steps only."""

    def __init__(self, steps: int = TIMED_STEPS, warm_up: int = WARM_UP_STEPS) -> None:
        self.steps, self.warm_up = steps, warm_up
        self._running: tuple[ShapePlan, int] | None = None
        self._samples: dict[int, tuple[ShapePlan, list[int]]] = {}  # by id(plan); the plan kept alive

    def forward_started(self, shape_plan: ShapePlan | None, args: tuple, kwargs: dict, device: torch.device) -> None:
        """The module's forward starts under ``shape_plan`` with ``args``, ``kwargs``: time the
        step if the plan still needs timing and the batch is the one it was planned for (every
        forward asks, so a timed plan answers before its inputs are looked at)."""
        if shape_plan is None or shape_plan.measured_step_ns is not None or self._running is not None:
            return
        if batch_size_of(args, kwargs) != shape_plan.batch_size:
            return
        _synchronise(device)
        self._running = (shape_plan, time.perf_counter_ns())

    def backward_ended(self, shape_plan: ShapePlan | None, metered: bool, device: torch.device) -> ShapePlan | None:
        """The step's backward is over. A step that was metered or that changed the plan is not
        counted. Returns the plan whose last timed step this was (its median filed), else None."""
        running, self._running = self._running, None
        if running is None or metered or running[0] is not shape_plan:
            return None
        _synchronise(device)
        elapsed = time.perf_counter_ns() - running[1]
        plan, samples = self._samples.setdefault(id(shape_plan), (shape_plan, []))
        samples.append(elapsed)
        if len(samples) < self.warm_up + self.steps:
            return None
        del self._samples[id(shape_plan)]
        plan.measured_step_ns = float(statistics.median(samples[self.warm_up :]))
        return plan


def describe_step_time(shape_plan: ShapePlan) -> str:
    """A plan's timed steps against its predicted time (empty until they are timed)."""
    measured, predicted = shape_plan.measured_step_ns, shape_plan.planned_step_ns
    if measured is None:
        return ""
    return (
        f"step time {measured / 1e6:.1f} ms measured (forward to the end of the backward, median of {TIMED_STEPS} "
        f"steps after {WARM_UP_STEPS}) = {measured / predicted:.3f} of the {predicted / 1e6:.1f} ms predicted "
        f"(the unplanned step {shape_plan.step_ns / 1e6:.1f} ms + the plan's "
        f"{shape_plan.planned.recompute_cost / 1e6:.1f} ms)"
    )


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
