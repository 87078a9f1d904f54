"""The training loop a plan must hold in: what Lightning keeps alive around the planned step.

A plan is made for one forward and backward of the module. Lightning's loop adds to it:

- **The last step's gradients.** Automatic optimisation runs ``training_step`` before
  ``zero_grad``, so the forward runs with the previous step's gradients alive (a whole fit of
  the main job peaked 1.07x its budget on every step but the first). Where Lightning zeroes
  them before this batch's backward anyway and nothing can read them in between (the stock
  ``optimizer_zero_grad``, no ``on_before_zero_grad`` hook, the first micro-batch of an
  accumulation window), the strategy frees them before the forward instead
  (:func:`release_gradients_early`): the same training, less memory. Where it cannot, or where
  they must stay (the later micro-batches of gradient accumulation, manual optimisation that
  keeps them), the plan counts them (:func:`loop_model`, ``PriorGradients``).
- **The optimizer's step**, after the backward: its temporaries on top of the gradients,
  predicted by ``memory.held.optimizer_step_bytes``.

:class:`LoopWatch` meters whole steps of the loop, as the user runs them (the first few and one
in every ``every`` after), so the plan's word is checked where it is promised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer

from lightning_tbp.compat import lightning_skips_backward
from lightning_tbp.memory.held import local_bytes, optimizer_step_bytes, parameter_step_ratio
from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, peak_apart_from
from lightning_tbp.optim.step_cost import in_backward_ns
from lightning_tbp.remat.step import LoopModel, PriorGradients


def lightning_zeroes_before_backward(module: pl.LightningModule, batch_idx: object) -> bool:
    """Whether Lightning's own ``optimizer.zero_grad()`` runs between this batch's
    ``training_step`` and its backward (automatic optimisation, the stock ``optimizer_zero_grad``,
    the first micro-batch of an accumulation window, a batch whose backward runs)."""
    trainer = module.trainer
    if not module.automatic_optimization or is_overridden("optimizer_zero_grad", module, pl.LightningModule):
        return False
    if not isinstance(batch_idx, int) or lightning_skips_backward(trainer):
        return False
    return batch_idx % trainer.accumulate_grad_batches == 0


def gradients_observed_before_zero_grad(module: pl.LightningModule) -> bool:
    """Whether a hook of the module or a callback runs between ``training_step`` and
    ``zero_grad`` (``on_before_zero_grad``), where it may read the last step's gradients."""
    if is_overridden("on_before_zero_grad", module, pl.LightningModule):
        return True
    return any(is_overridden("on_before_zero_grad", callback, Callback) for callback in module.trainer.callbacks)  # type: ignore[attr-defined]  # set by Lightning's callback connector


def release_gradients_early(module: pl.LightningModule, batch_idx: object) -> bool:
    """Free the last step's gradients now, before the forward, when Lightning would free them
    after it (before the backward) and nothing can tell the difference; returns whether it did.

    Lightning's own ``zero_grad`` still runs where it always does (a user's optimizer sees its
    calls unchanged), and finds nothing left to free: so this is done only for optimizers whose
    ``zero_grad`` is torch's, which with ``set_to_none=True`` (the stock hook's) only drops each
    parameter's gradient, as done here."""
    if not lightning_zeroes_before_backward(module, batch_idx) or gradients_observed_before_zero_grad(module):
        return False
    optimizers = module.trainer.optimizers
    if any(type(optimizer).zero_grad is not Optimizer.zero_grad for optimizer in optimizers):
        return False  # the optimizer's own zero_grad: only it knows what it does
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
    return True


def release_gradients_before_validation(module: pl.LightningModule, last_batch_idx: int) -> bool:
    """Free the gradients before a validation inside fit when the next training batch starts a
    window whose ``zero_grad`` frees them anyway and nothing reads them in between (Lightning
    keeps them through the validation); returns whether it did."""
    trainer = module.trainer
    window_ended = (last_batch_idx + 1) % trainer.accumulate_grad_batches == 0
    return window_ended and release_gradients_early(module, last_batch_idx + 1)


def loop_model(module: pl.LightningModule, device: torch.device, step_in_backward: bool = False) -> LoopModel:
    """The cases of the loop the plan must hold in, as its configuration says (a loop seen to
    keep gradients the configuration did not announce widens it: :func:`case_of_step`).
    ``step_in_backward``: the optimizer steps inside the backward, so no step's gradients
    outlive it (only accumulation keeps them)."""
    trainer = module.trainer
    cases = {PriorGradients.RELEASED}
    if module.automatic_optimization:
        if is_overridden("optimizer_zero_grad", module, pl.LightningModule):
            cases.add(PriorGradients.ACCUMULATED)  # the user's zero_grad: nothing known of it
        elif gradients_observed_before_zero_grad(module) and not step_in_backward:
            cases.add(PriorGradients.UNTIL_BACKWARD)
        if trainer.accumulate_grad_batches > 1:
            cases.add(PriorGradients.ACCUMULATED)
    if step_in_backward:
        optimizers = trainer.optimizers
        ratio, optimizer_ns = parameter_step_ratio(optimizers, device), in_backward_ns(optimizers[0], device)
        return LoopModel(frozenset(cases)).with_step_in_backward(ratio, optimizer_ns)
    return LoopModel(frozenset(cases), optimizer_step_bytes(trainer.optimizers, device))


def gradient_bytes(params: Iterable[nn.Parameter]) -> int:
    """Bytes of the gradients these parameters hold now (this process's shards)."""
    return sum(local_bytes(p.grad) for p in params if p.grad is not None)


def case_of_step(module: pl.LightningModule, alive_gradient_bytes: int, batch_idx: object) -> PriorGradients:
    """Which case of the loop this step is, from the gradients alive as its forward starts."""
    if not alive_gradient_bytes:
        return PriorGradients.RELEASED
    if lightning_zeroes_before_backward(module, batch_idx):
        return PriorGradients.UNTIL_BACKWARD
    return PriorGradients.ACCUMULATED


@dataclass(frozen=True)
class LoopStep:
    """One metered step of the loop: from its batch's start to the next batch's start (the
    optimizer step, the callbacks, any validation in between included)."""

    index: int
    case: PriorGradients
    peak_bytes: int
    """Its peak above what training holds outside the step (parameters, EMA copies, optimizer
    state): the gradients and the batch alive at its start count, as the state its first
    optimizer step made does not. Planning, where the step made a plan, is apart:"""
    planning_peak_bytes: int | None = None
    """The peak of the planner's own one-time work (profile, op and block calibration) before the
    step's forward, on the same scale; None when the step made no plan."""
    unseen_bytes: int | None = None
    """Where the meter is known to miss frees (``LoopWatch.frees_unseen``): what the step freed
    out of its sight, read at the next batch's start as the meter's level beyond what training
    holds there. Every level after such a free reads that much too high, so the step's true peak
    lies between :attr:`lowest_bytes` and ``peak_bytes``. None where not known."""

    @property
    def lowest_bytes(self) -> int:
        """The least the step can have peaked at (``peak_bytes`` where no free went unseen)."""
        return self.peak_bytes - (self.unseen_bytes or 0)


@dataclass
class _Open:
    index: int
    case: PriorGradients
    base_level: int  # the meter's level of what training holds outside the step, as the step starts
    state_bytes: int  # the optimizer state held at its start
    start_mark: int  # the mark at its batch's start
    start_level: int  # the meter's level there
    forward_mark: int | None = None  # the mark where its first forward started (after any planning)
    planned: bool = False  # the step made a plan before that forward
    optimizer_mark: int | None = None  # the mark at its optimizer step, when one ran
    # optimizer state made inside the backward (the step in the backward): mark -> bytes made by then
    state_marks: dict[int, int] = field(default_factory=dict)


class LoopWatch:
    """Meters whole steps of the loop: the first ``first``, then one in every ``every``.

    One exact region runs from the backward of the batch before a metered step (so every block
    the step frees was allocated under the meter: the last step's gradients) to the start of the
    batch after it; the first steps' region starts with the first batch. Marks split it at each
    batch start, at the step's forward (planning before it is measured apart) and at the
    optimizer step, which is where the first step's optimizer state appears (held outside the
    step, so not counted). What training holds outside the step is read once per region, at the
    first metered batch's start (its level less the gradients and batch alive then, less the
    optimizer state); a step is measured above that plus the optimizer state at its start, so
    within the first steps' region anything a step leaves behind (a cache the first step's
    planning kept) counts in the steps after it.

    When the optimizer steps inside the backward, the first step's state appears there,
    parameter by parameter: each parameter's first step is marked before and after
    (:meth:`state_made`), and each stretch between marks is measured above the state made by
    its end.

    ``frees_unseen``: the meter may miss frees (:func:`~lightning_tbp.memory.meters.frees_hidden_by_collectives`).
    Then what training holds is read again at every step's start, so a free missed in one step
    does not raise the next, and each step balances its end against what training holds there
    (:attr:`LoopStep.unseen_bytes`); a step left behind by another (a cache) is then no longer
    charged to the steps after it."""

    def __init__(self, device: torch.device, first: int = 3, every: int = 50, frees_unseen: bool = False) -> None:
        self.device, self.first, self.every, self.frees_unseen = device, first, every, frees_unseen
        self._also: set[int] = set()
        self._stack: contextlib.ExitStack | None = None
        self._reading: AllocatorPeak | None = None
        self._step: _Open | None = None
        self._marks = 0
        self._held_level = 0
        self._pre_rolled = False
        self.steps: list[LoopStep] = []

    def watched(self, index: int) -> bool:
        return index < self.first or (self.every > 0 and index % self.every == 0) or index in self._also

    def watch_also(self, index: int) -> None:
        """Meter step ``index`` as well (a plan that only a whole step of the loop can check there)."""
        self._also.add(index)

    def previous_step_ended(self, alive_bytes: int, state_bytes: int) -> LoopStep | None:
        """A batch starts with ``alive_bytes`` held for the step (gradients, the batch) and
        ``state_bytes`` of optimizer state: the metered step before it, if any, ended here (then
        :meth:`batch_started`)."""
        return self._end_step(state_bytes, alive_bytes)

    def batch_started(self, index: int, alive_bytes: int, state_bytes: int, can_meter: bool) -> None:
        """Step ``index`` starts, holding what :meth:`previous_step_ended` was told: metered if watched."""
        opening = self._reading is None and can_meter and self.watched(index)
        if opening:
            self._open()
        if self._reading is None:
            return
        if not self.watched(index):
            self.stop()
            return
        level = self._mark()
        # what training holds outside the step, read once per region (or at every step, see frees_unseen)
        if opening or self._pre_rolled or self.frees_unseen:
            self._held_level = level - alive_bytes - state_bytes
            self._pre_rolled = False
        self._step = _Open(
            index, PriorGradients.RELEASED, self._held_level + state_bytes, state_bytes, self._marks - 1, level
        )

    def training_step_ended(self, index: int, can_meter: bool) -> None:
        """The forward of batch ``index`` is over, its backward to come: if the next batch is
        metered, start here, so the gradients this backward makes are seen when the next step frees
        them (the meter cannot see the free of a block allocated before it started)."""
        if self._reading is None and can_meter and self.watched(index + 1):
            self._open()
            self._pre_rolled = True

    def _open(self) -> None:
        self._stack = contextlib.ExitStack()
        self._reading = self._stack.enter_context(allocator_peak(self.device))
        self._marks = 0

    def validation_started(self, state_bytes: int) -> LoopStep | None:
        """A validation starts inside fit: the step before it ends here (what validation holds is
        not the training step's; the region stays open for the step after it)."""
        ended = self._end_step(state_bytes)
        if self._reading is not None:
            self._mark()
        return ended

    def step_case(self, case: PriorGradients) -> None:
        """The step's forward starts in ``case`` (known once the strategy has freed what it frees)."""
        if self._step is not None:
            self._step.case = case

    def made_since_batch_start(self) -> int | None:
        """Net bytes allocated since the metered step's batch started (what ``training_step`` made
        before calling the module, less what it freed); None when this step is not metered."""
        if self._step is None or self._reading is None:
            return None
        return self._mark() - self._step.start_level

    def forward_starting(self, planned: bool) -> None:
        """The step's module forward starts (the first of the step), after planning if ``planned``."""
        if self._step is not None and self._reading is not None and self._step.forward_mark is None:
            self._mark()
            self._step.forward_mark, self._step.planned = self._marks - 1, planned

    def optimizer_stepping(self) -> None:
        """The optimizer's step is about to run (the backward is over)."""
        if self._step is not None and self._reading is not None:
            self._mark()
            self._step.optimizer_mark = self._marks - 1

    def state_made(self, nbytes: int) -> None:
        """Inside the backward, a parameter's first step is about to make its optimizer state (0),
        or made ``nbytes`` of it: marked, so the stretches around it are measured without it."""
        if self._step is not None and self._reading is not None:
            # a mark only, twice per parameter: reading the level folds the events in and restarts the
            # profiler session, and restarts inside a DP backward lost frees (~7 MiB on the main job's U-Net)
            self._reading.mark()
            self._marks += 1
            made = max(self._step.state_marks.values(), default=0) + nbytes
            self._step.state_marks[self._marks - 1] = made

    def stop(self, state_bytes: int | None = None) -> LoopStep | None:
        """End metering (the fit ends, or the next step is not watched); the step it ended, if any."""
        ended = self._end_step(state_bytes) if state_bytes is not None else None
        if self._stack is not None:
            self._stack.close()
        self._stack = self._reading = self._step = None
        return ended

    def _mark(self) -> int:
        """Mark now; the level there."""
        assert self._reading is not None
        self._reading.mark()
        self._marks += 1
        return self._reading.marks_so_far()[-1].level_bytes

    def _end_step(self, state_bytes: int | None, alive_bytes: int | None = None) -> LoopStep | None:
        step, self._step = self._step, None
        if step is None or self._reading is None or state_bytes is None:
            return None
        end_level = self._mark()
        marks = self._reading.marks
        grown = max(0, state_bytes - step.state_bytes)  # the first optimizer step makes the state
        # windows between the step's marks: before its forward, to the optimizer step, after it
        cuts = [i for i in (step.forward_mark, step.optimizer_mark) if i is not None] + [len(marks) - 1]
        starts = [step.start_mark + 1, *(cut + 1 for cut in cuts[:-1])]
        spans = zip(starts, cuts, strict=True)
        windows = [max(m.peak_before_bytes for m in marks[first : last + 1]) for first, last in spans]
        if step.optimizer_mark is not None:
            windows[-1] -= grown
            if step.state_marks and step.forward_mark is not None:  # state made in the backward
                windows[-2] = peak_apart_from(marks, step.state_marks, step.forward_mark + 1, step.optimizer_mark)
        planning = windows.pop(0) - step.base_level if step.planned else None
        peak = max(windows)
        unseen = None
        if self.frees_unseen and alive_bytes is not None:
            unseen = max(0, end_level - (self._held_level + alive_bytes + state_bytes))
        done = LoopStep(step.index, step.case, peak - step.base_level, planning, unseen)
        self.steps.append(done)
        return done
