"""A DP engine's training step, as the rematerialization planner simulates it.

Every mode probes per-sample independence with extra retained passes on a new graph structure
(their peak is that of one: the simulator runs one). Ghost and flash clipping then backpropagate
the graph twice, the first pass retaining everything it saved and writing no parameter gradients.
Bookkeeping keeps each clipped layer's saved input and output gradient until the backward ends
(except inside full checkpoints, which it runs again: ``remat/replay.py``), then forms the
parameter gradients one layer at a time.

The engine reports each layer it taps during the planner's profiling forward (a :class:`TapNote`):
its saves, its output, and the transient bytes of its per-sample norms and of its clipped sum.
:class:`TapEffects` is what the simulated step does with them (``simulated_step.StepEffects``).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_tbp.remat.options import Option
from lightning_tbp.remat.simulated_step import SimulatedStep, StepEffects
from lightning_tbp.remat.step import BackwardPass, LayerNote, StepModel
from lightning_tbp.remat.trace import Trace


@dataclass
class TapNote(LayerNote):
    """A tapped layer as the profiling forward saw it."""

    norm_bytes: int = 0  # transient of its per-sample norms
    sum_bytes: int = 0  # transient of its clipped sum (the parameter gradients are counted apart)
    parameter_bytes: int = 0  # the gradients its clipped sum writes
    layer: int = 0  # which layer: a layer tapped twice keeps per-sample gradients through the norms pass
    per_sample_bytes: int = 0  # those per-sample gradients (batch x its parameters)
    book_copy_bytes: int = 0
    """What a booked entry allocates before its clipped sum: a tracked use's output gradients
    scaled by the clipping coefficients (a handler scales inside its sum, which its meter counts;
    a replayed block's layers receive them scaled)."""
    norm_ns: float = 0.0  # time of its per-sample norms (measured; 0 when not)
    sum_ns: float = 0.0  # time of its clipped sum
    meter: Callable[[], tuple[int, int, float, float] | None] | None = None
    """Measures (norm bytes, sum bytes, norm ns, sum ns) on stand-in tensors of the same layout,
    when called after the profiling forward (the byte estimates above are only formulas; kernels
    allocate more)."""
    meter_key: tuple = ()
    """Taps with equal keys (same layer kind, same layouts) measure alike: one measurement serves them."""

    @classmethod
    def settle(cls, notes: Sequence[LayerNote], measure: bool) -> None:
        """With ``measure``, replace each tap's estimated norm and sum transients by measured ones
        (one measurement per distinct layer and layout; under a running CPU profiler the
        estimates stay). Either way the trace then keeps numbers only."""
        measured: dict[tuple, tuple[int, int, float, float] | None] = {}
        for note in notes:
            assert isinstance(note, TapNote)
            if note.meter is None or not measure:
                note.meter = None
                continue
            if note.meter_key not in measured:
                measured[note.meter_key] = note.meter()
            if (found := measured[note.meter_key]) is not None:
                note.norm_bytes, note.sum_bytes, note.norm_ns, note.sum_ns = found
            note.meter = None  # the closure holds the module and handler: the trace keeps numbers only


@dataclass(frozen=True)
class DPPass(BackwardPass):
    """A backward pass of a DP step."""

    books_taps: bool = False
    """Tapped layers keep their saved tensors and output gradient until the pass ends; their
    parameter gradients are then formed one layer at a time (bookkeeping)."""
    tap_transient: str = ""
    """Which transient of the taps the pass pays at each tap's backward: "norm", "sum" or both
    ("norm+sum"); empty for none."""
    replays_checkpoints: bool = False
    """With ``books_taps``: a fully checkpointed block (or a streamed one, its weights copied in
    again for the run) that no other planned block encloses books nothing; it keeps its inputs
    and its outputs' gradient until the pass ends, and after the book it runs again, forward and
    backward, one block at a time (``replay.py``)."""


#: The independence probe: retained, no gradients, on a graph's first step only.
PROBE = DPPass(retains_graph=True, parameter_gradients=False, every_step=False)
#: A deferred block run again after the book: its taps form their clipped sums as the backward reaches them.
_RERUN_PASS = DPPass(parameter_gradients=False, tap_transient="sum")


def _taps(trace: Trace) -> list[TapNote]:
    return [note for note in trace.step_notes if isinstance(note, TapNote)]


@dataclass(frozen=True)
class DPStepModel(StepModel):
    """The passes of a DP mode's step; its effects are the taps' (:class:`TapEffects`)."""

    passes: tuple[DPPass, ...] = (PROBE,)

    def effects_for(self, trace: Trace) -> Callable[[SimulatedStep], StepEffects]:
        taps = {tap.event: tap for tap in _taps(trace)}
        calls = Counter(tap.layer for tap in taps.values())
        repeated = frozenset(layer for layer, count in calls.items() if count > 1)
        return functools.partial(TapEffects, taps=taps, repeated_layers=repeated)

    def extra_ns(self, trace: Trace) -> float:
        """The engine's per-layer norms and clipped sums in the passes that compute them
        (bookkeeping forms its sums from the book)."""
        taps = _taps(trace)
        return sum(
            tap.norm_ns * ("norm" in p.tap_transient) + tap.sum_ns * ("sum" in p.tap_transient or p.books_taps)
            for p in self.passes
            for tap in taps
        )


class TapEffects(StepEffects):
    """What a DP step does at its taps, in the simulated step.

    ``taps``: by event; ``repeated_layers``: layers tapped more than once, which keep per-sample
    gradients until the norms are known."""

    def __init__(self, step: SimulatedStep, taps: dict[int, TapNote], repeated_layers: frozenset[int]) -> None:
        super().__init__(step)
        self.taps = taps
        self.repeated_layers = repeated_layers
        self.book: list[tuple[list[int], int, TapNote]] = []  # bookkeeping: (holds, output grad, tap)
        self.pending: dict[int, int] = {}  # layers called more than once: bytes of per-sample gradients
        self.deferred: list[tuple[int, list[int]]] = []  # blocks run again: (block, output grads kept)
        self.deferring = False  # inside such a block's backward: its taps book nothing

    def _pass(self) -> DPPass:
        current = self.step.pass_
        assert isinstance(current, DPPass)
        return current

    def backward_transient(self, event: int) -> int:
        tap = self.taps.get(event)
        if tap is None:
            return 0
        current = self._pass()
        transient = tap.norm_bytes * ("norm" in current.tap_transient)
        transient += tap.sum_bytes * ("sum" in current.tap_transient)
        repeated = tap.layer in self.repeated_layers and tap.layer not in self.pending
        if "norm" in current.tap_transient and repeated:
            # a layer called more than once sums its per-sample gradients until the norms are known
            self.pending[tap.layer] = tap.per_sample_bytes
            self.step.mem += tap.per_sample_bytes
        return transient

    def take_saves(self, event: int, holds: list[int], rebuilt: int) -> bool:
        tap = self.taps.get(event)
        if tap is None:
            return False
        step = self.step
        if step.pass_ is _RERUN_PASS:
            step.wrote_parameter_gradients(tap.parameter_bytes)  # the rerun writes its clipped sum into them
        if not (self._pass().books_taps and not self.deferring and tap.output_sid in step.grads):
            return False
        if rebuilt:  # a saved input rebuilt (lazy) or copied back (offloaded) for this backward stays in the book
            kept = step.new_storage(rebuilt)
            step.alive.add(kept)
            step.mem += rebuilt
            holds = [*holds, *step.hold([kept])]
        self.book.append((holds, tap.output_sid, tap))  # kept, with the output gradient, to the end
        step.kept_grads.add(tap.output_sid)
        return True

    def defer_block(self, block: int, region: int) -> bool:
        """Whether this pass runs ``block`` again after its book instead of booking the taps inside:
        its output gradients then stay, with its inputs."""
        step = self.step
        if not (
            self._pass().replays_checkpoints and region == 0 and step.options[block] in (Option.FULL, Option.STREAM)
        ):
            return False
        if not step.trace.nodes[block].replayable:
            return False
        parent = step.facts.parent[block]
        while parent >= 0:  # the runtime records only blocks no other planned block encloses
            if step.options[parent] != Option.KEEP:
                return False
            parent = step.facts.parent[parent]
        grads = [sid for sid in step.trace.nodes[block].outputs if sid in step.grads]
        step.kept_grads.update(grads)
        self.deferred.append((block, grads))
        self.deferring = True
        return True

    def deferred_block_done(self, block: int) -> None:
        self.deferring = False

    def end_pass(self) -> None:
        """Bookkeeping's clipped sums (one booked layer at a time), then the deferred blocks run again."""
        step = self.step
        step.mem -= sum(self.pending.values())  # the norms are known: summed per-sample gradients go
        self.pending = {}
        for holds, grad, tap in self.book:
            transient = tap.sum_bytes + tap.book_copy_bytes
            step.wrote_parameter_gradients(tap.parameter_bytes)
            step.mem += transient
            step.tick()
            step.mem -= transient
            if step.steps_in_backward and tap.layer not in self.repeated_layers:
                step.step_written_gradients(tap.parameter_bytes)  # its parameters' last contribution
            step.release(holds)
            step.kept_grads.discard(grad)
            step.free_grad(grad)
        self.book = []
        for block, grads in self.deferred:
            self._rerun(block)
            step.release(step.node_inputs.pop(block, []))
            for sid in grads:
                step.kept_grads.discard(sid)
                step.free_grad(sid)
        self.deferred = []

    def _rerun(self, block: int) -> None:
        """A deferred block again: its forward from the kept inputs (inner checkpoints as planned),
        then its backward from the kept output gradients, writing its taps' clipped sums."""
        step = self.step
        facts, trace = step.facts, step.trace
        outer_pass, outer_region = step.pass_, step.region
        step.pass_, step.region = _RERUN_PASS, block
        outputs = step.forward(
            block, facts.first[block], facts.last[block], recompute=True, keep=trace.nodes[block].outputs
        )
        step.backward(block, facts.first[block], facts.last[block])
        step.recompute_cost += sum(trace.event_backward_cost[facts.first[block] : facts.last[block] + 1])
        for sid in outputs:
            step.python_refs.discard(sid)
            step.maybe_free(sid)
        step.pass_, step.region = outer_pass, outer_region


def dp_step_model(two_pass: bool, mode: str) -> DPStepModel:
    """The step of a DP ``mode``: two-pass clipping (ghost, flash) or bookkeeping."""
    if two_pass:
        norms = DPPass(retains_graph=True, parameter_gradients=False, tap_transient="norm")
        return DPStepModel((PROBE, norms, DPPass(tap_transient="sum")), name=f"dp:{mode}")
    book = DPPass(parameter_gradients=False, books_taps=True, tap_transient="norm", replays_checkpoints=True)
    return DPStepModel((PROBE, book), name=f"dp:{mode}")
