"""Predict a training step's peak memory and recomputation cost under any plan, without running it.

The simulator is the planner's model of a step: a trace of the module's forward
(``trace.py``), worked out once per trace (``trace_facts.TraceFacts``), then simulated under
each plan the solver tries (``simulated_step.SimulatedStep``: the memory ledger and the rules
of checkpoints and lazy blocks), with what the step model adds around the plain backward
(``step.StepModel.effects_for``) and the training loop's cases (``step.LoopModel``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lightning_tbp.remat.folding import ChainFold
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.shared_prefix import SharedPrefix
from lightning_tbp.remat.simulated_step import Captured, Holdings, OverLimit, SimResult, SimulatedStep
from lightning_tbp.remat.step import NOTHING_ALONGSIDE, PLAIN_LOOP, PLAIN_STEP, Alongside, LoopModel, StepModel
from lightning_tbp.remat.trace import Trace
from lightning_tbp.remat.trace_facts import TraceFacts

__all__ = ["Holdings", "SimResult", "Simulator"]


class Simulator:
    """Simulates one trace under many plans; the per-trace work is done once.

    ``step``: the backward passes of the training step and what it does around them (a DP
    engine's, see ``privacy/step_model.py``); a plain single backward by default. ``loss_bytes``:
    what the step's loss holds at its peak above the state at the module's forward end, its
    outputs' gradients included (measured on a real step, ``verify.StepReading``; 0 until then):
    the loss is computed outside the module, so no trace sees it, and every backward pass runs
    its backward first. ``loop``: the gradients the training loop holds when the step starts and
    its optimizer step (``step.LoopModel``); one simulation follows every case, and a result's
    peak is the highest of them. ``alongside``: what the loop keeps on the device beside the
    step for this trace's inputs (the batch; ``step.Alongside``), counted in every peak.
    ``host_budget_bytes``: the most the host tier may hold (``host_tier.py``); a plan whose
    offloaded blocks would hold more cannot run (``simulated_step.UNREACHABLE``)."""

    def __init__(
        self,
        trace: Trace,
        step: StepModel = PLAIN_STEP,
        loss_bytes: int = 0,
        loop: LoopModel = PLAIN_LOOP,
        alongside: Alongside = NOTHING_ALONGSIDE,
        host_budget_bytes: float = float("inf"),
        fold: ChainFold | None = None,
    ) -> None:
        """``fold``: the trace is a chain folded to four calls (``folding.py``), whose
        simulations add the calls left out."""
        self.trace = trace
        self.fold = fold
        self.host_budget_bytes = host_budget_bytes
        self.step = step
        self.loss_bytes = loss_bytes
        self.loop = loop
        self.alongside = alongside
        self.facts = TraceFacts(trace, noted={note.event for note in trace.step_notes})
        self.effects = step.effects_for(trace)
        self.shared: SharedPrefix | None = None

    @contextmanager
    def sharing_prefix(self, split: int) -> Iterator[SharedPrefix]:
        """Simulations in this context share what plans agreeing on every block that starts
        before event ``split`` have in common (``shared_prefix.py``): for a search that moves
        only blocks after it."""
        self.shared = SharedPrefix(self.facts, split)
        try:
            yield self.shared
        finally:
            self.shared = None

    @property
    def step_ns(self) -> float:
        """Predicted time of the unplanned step: the trace's forward and its backward per pass,
        plus what the step model adds (a DP engine's per-layer norms and clipped sums) and the
        loop (the optimizer's steps inside the backward, on the device or the host)."""
        return (
            self.trace.step_ns(self.step.every_step_passes) + self.step.extra_ns(self.trace) + self.loop.step_inside_ns
        )

    def cache_limit(self, node: int) -> int:
        """Heavy ops a selective checkpoint of ``node`` caches."""
        return self.facts.cache_limit(node)

    def _simulate(
        self, options: list[Option], capture_step: int = -1, limit_bytes: float = float("inf")
    ) -> SimulatedStep:
        return SimulatedStep(
            self.facts,
            options,
            self.step,
            self.effects,
            self.loss_bytes,
            self.loop,
            self.alongside,
            capture_step=capture_step,
            limit_bytes=limit_bytes,
            host_limit_bytes=self.host_budget_bytes,
            shared=self.shared,
            fold=self.fold,
        )

    def run(self, options: list[Option]) -> SimResult:
        return self._simulate(options).result()

    def holdings_at(self, options: list[Option], step: int) -> Holdings:
        """Who holds what at ``step`` of the simulation of ``options`` (it stops there)."""
        try:
            self._simulate(options, capture_step=step)
        except Captured as captured:
            return captured.holdings
        raise ValueError(f"the simulation has no step {step}")

    def run_within(self, options: list[Option], limit_bytes: int) -> SimResult | None:
        """The simulation of ``options``, or None as soon as its memory passes ``limit_bytes``.

        Most plans a search tries are rejected for their peak, and a simulation that stops where
        the memory first passes the bound costs a fraction of a whole one (the solver's pruning
        and move ranking need nothing more about a rejected plan)."""
        try:
            return self._simulate(options, limit_bytes=limit_bytes).result()
        except OverLimit:
            return None
