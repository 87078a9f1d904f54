"""Replay a trace under a plan: predicted peak memory and recomputation cost, without running it.

The replay follows what torch does with non-reentrant ``torch.utils.checkpoint``:

* Outside any checkpoint, each op keeps the tensors autograd saves until its backward runs.
* A checkpointed block keeps only its inputs (saved through the enclosing hooks, so an inner
  checkpoint's inputs are themselves recomputed by an outer one). When the backward first needs
  the block, it is re-run from its inputs up to the last op that saves something ("early stop"),
  with inner checkpointed blocks again keeping only their inputs; recomputed tensors are released
  as their ops' backward runs.
* A selective block (selective activation checkpointing) also caches the outputs of heavy ops
  (matmul, convolution, attention) during the forward, so its recomputation re-runs only the
  cheap ops; the recompute consumes the cache (torch pops each entry it reaches and hands it to
  the recomputed code: it is then held like a tensor that code made, by its saves and references).
* The gradient of a tensor appears when the backward of its last consumer runs and disappears
  after the backward of its producer; parameter gradients stay. Other consumers' backwards add
  a fresh contribution that autograd sums in (a transient), except pass-through ops (add, cat);
  a parameter's are summed into a new buffer (a second transient).
  ``cat`` hands its inputs slice *views* of its output gradient, so a U-Net skip's gradient keeps
  the whole concatenated gradient buffer alive until a second contribution replaces the view, and
  a conv/matmul/norm backward receiving such a view first copies it to a contiguous tensor.
* Heavy ops (conv, matmul, attention) allocate transient workspace in forward (so in every
  recomputation) and backward; the trace measured it per op (``workspace.py``).
* In a lazy block a saved output of a cheap op (and the chain of cheap ops behind it) is kept as
  its recipe's leaves; the op's backward rebuilds the chain (a transient).
* A tensor's Python reference ends where the profiling pass saw its last reference go, which is
  later than its last use wherever a variable holds it (observed, not inferred).

Memory is counted above the state before the forward (parameters and inputs are the baseline).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from lightning_tbp.remat.lazy import MIN_LAZY_BYTES
from lightning_tbp.remat.step import PLAIN_LOOP, PLAIN_STEP, BackwardPass, LoopModel, PriorGradients, StepModel, TapNote
from lightning_tbp.remat.trace import Trace

#: Ops whose backward hands each input a slice *view* of the output gradient: an input's
#: gradient then keeps the whole output-gradient buffer alive (U-Net skips after ``cat``).
_SLICING_BACKWARD = ("cat.",)
#: Besides heavy ops (conv, matmul, attention), ops whose backward copies a non-contiguous
#: output gradient (such as a slice view from ``cat``) to a contiguous one first.
_CONTIGUOUS_GRAD_BACKWARD = ("native_group_norm.", "native_layer_norm.")
#: Ops whose backward hands each input the output gradient itself (an alias, no new memory); a
#: later contribution to such an input's gradient is summed into a new buffer.
_ALIASING_BACKWARD = ("add.Tensor", "clone.", "alias.", "detach.")
#: View ops that can pick a part of their input (their backward builds a whole-input gradient).
_VIEW_PRODUCING = ("split", "chunk", "unbind", "slice.", "select.", "narrow", "as_strided")
#: Views of a whole storage under another shape (a DP tap's ``view_as`` among them): their
#: backward hands the gradient on reshaped. Consumers of the view are consumers of the storage,
#: so the view itself adds no contribution to the storage's gradient (counting it as one made a
#: residual add's aliased gradient look summed into a new buffer at every tapped layer).
_RESHAPING_VIEWS = ("view.", "_unsafe_view.", "reshape.", "transpose.", "permute.", "t.", "unsqueeze.", "squeeze.")
#: Ops whose backward passes the output gradient on without allocating a new tensor.
_PASS_THROUGH_BACKWARD = ("add.", "sub.", "cat.", "clone.", "alias.", "detach.")


class Option(IntEnum):
    """What the plan does with one block."""

    KEEP = 0
    """No checkpoint: autograd keeps what it saves (children may still be checkpointed)."""
    FULL = 1
    """Checkpoint the whole block: keep its inputs, recompute it in the backward."""
    SELECTIVE = 2
    """Keep inputs and heavy-op outputs, recompute the cheap ops (norms, activations, adds)."""
    LAZY = 3
    """No checkpoint: saved outputs of cheap ops become recipes rebuilt on demand (``lazy.py``)."""


_CHECKPOINTS = (Option.FULL, Option.SELECTIVE)
#: A deferred block's replay after the book (``step.BackwardPass.replays_checkpoints``): its
#: taps form their clipped sums as the backward reaches them.
_REPLAY_PASS = BackwardPass(parameter_gradients=False, tap_transient="sum")


@dataclass
class Snapshot:
    """Who holds which storage at one instant of the replay (used to steer the solver)."""

    region: int
    event_holds: dict[int, list[int]]
    node_holds: dict[int, list[int]]
    python_refs: set[int]
    sizes: dict[int, int]


@dataclass
class SimResult:
    peak_bytes: int
    recompute_cost: float
    recompute_flops: int
    forward_end_bytes: int
    peak_step: int
    recompute_counts: dict[int, int] = field(default_factory=dict)
    peak_in_loss: bool = False  # the peak falls in the loss's window (``Simulator`` ``loss_bytes``)
    peak_in_optimizer_step: bool = False  # the peak is the optimizer's step (``LoopModel``)
    case_peaks: dict[PriorGradients, int] = field(default_factory=dict)
    """The peak of the step in each case of the loop (``LoopModel.gradients``)."""


def dead_branches(trace: Trace) -> tuple[list[bool], dict[int, list[int]]]:
    """Events whose results reach no output of the module, and when autograd frees their saves.

    No gradient ever flows into such an op (a Flux whose last joint block's text stream feeds
    nothing), so its backward never runs; its graph node, with what it saved, goes when nothing
    references it any more: when the last Python reference to its outputs, and to the outputs of
    the dead ops that consumed them, is gone. Returns per event whether it is dead, and per event
    the dead events whose saves go right after it. A dead op whose outputs outlive the forward
    (kept on a module, say) is left out of the second: its saves are held as any others.

    Liveness runs backwards from the module's outputs: an op is live if an output it makes is
    read by a live op or returned; an op that makes no storage (a view, an in-place update) is
    live if it reads a live storage, since it may write into it, and its inputs then are live.
    """
    live_storages = set(trace.module_outputs)
    dead = [False] * trace.num_events
    for event in range(trace.num_events - 1, -1, -1):
        outputs, inputs = trace.event_outputs[event], trace.event_inputs[event]
        if any(sid in live_storages for sid in (outputs or inputs)):
            live_storages.update(inputs)
        else:
            dead[event] = True
    consumers: dict[int, list[int]] = {}
    for event, inputs in enumerate(trace.event_inputs):
        if dead[event]:
            for sid in inputs:
                consumers.setdefault(sid, []).append(event)
    freed_after = [-1] * trace.num_events  # -1: not during the forward
    for event in range(trace.num_events - 1, -1, -1):
        if not dead[event]:
            continue
        last = event
        for sid in trace.event_outputs[event]:
            death = trace.storage_death[sid] if trace.storage_is_activation[sid] else -1
            later = [freed_after[c] for c in consumers.get(sid, ()) if c != event]
            if death < 0 or any(t < 0 for t in later):
                last = -1
                break
            last = max(last, death, *later)
        freed_after[event] = last
    release_at: dict[int, list[int]] = {}
    for event, last in enumerate(freed_after):
        if last >= 0:
            release_at.setdefault(last, []).append(event)
    return dead, release_at


class _BackwardFacts(NamedTuple):
    """What the backward of one event reads about it (``Simulator.backward_facts``)."""

    outputs: tuple[int, ...]
    inputs: tuple[int, ...]
    workspace: int
    partial_grads: list[tuple[int, int]]
    is_view_op: bool
    tap: TapNote | None
    slices_grad: bool
    aliases_grad: bool
    needs_contiguous_grad: bool
    passes_grad: bool
    grads_created: list[int]
    grads_accumulated: list[int]
    grads_freed: list[int]


class Simulator:
    """Replays one trace under many plans; the per-trace preprocessing is done once.

    ``step``: the backward passes of the training step (a DP engine's, see ``step.py``); a plain
    single backward by default. ``loss_bytes``: what the step's loss holds at its peak above the
    state at the module's forward end, its outputs' gradients included (measured on a real step,
    ``verify.StepReading``; 0 until then): the loss is computed outside the module, so no trace
    sees it, and every backward pass runs its backward first. ``loop``: the gradients the
    training loop holds when the step starts and its optimizer step (``step.LoopModel``); one
    replay follows every case, and a result's peak is the highest of them."""

    def __init__(
        self, trace: Trace, step: StepModel = PLAIN_STEP, loss_bytes: int = 0, loop: LoopModel = PLAIN_LOOP
    ) -> None:
        self.trace = trace
        self.step = step
        self.loss_bytes = loss_bytes
        self.loop = loop
        self.taps = {tap.event: tap for tap in trace.taps}
        # passes that compute gradients (the probe does not): each unpacks, so rebuilds, again
        self.backward_passes = sum(p.parameter_gradients or bool(p.tap_transient) for p in step.passes)
        calls = Counter(tap.layer for tap in trace.taps)
        self.repeated_layers = {layer for layer, count in calls.items() if count > 1}
        n_storages = len(trace.storage_bytes)
        n_events = trace.num_events
        self.parent = [node.parent for node in trace.nodes]
        self.first = [node.first_event for node in trace.nodes]
        self.last = [node.last_event for node in trace.nodes]
        # An op that reads a storage through a smaller view (a chunk, a slice) gets a gradient of
        # the view's size, kept apart until the view op's backward merges the pieces into one
        # gradient of the whole storage; the storage's gradient proper starts there.
        self.is_view_op = [op.startswith(_VIEW_PRODUCING) for op in trace.event_op]
        # ops no gradient reaches contribute none, and their saves go in the forward
        dead, self.dead_release_at = dead_branches(trace)
        self.partial_grads: list[list[tuple[int, int]]] = [[] for _ in range(n_events)]
        merged = set()
        for event, partial in enumerate(trace.event_partial_inputs):
            if self.is_view_op[event] or dead[event]:
                continue
            for sid, size in partial.items():
                if trace.storage_needs_grad[sid]:
                    self.partial_grads[event].append((sid, size))
                    merged.add(sid)
        last_consumer = [-1] * n_storages
        for event, inputs in enumerate(trace.event_inputs):
            if dead[event]:
                continue
            for sid in inputs:
                if not (sid in merged and sid in trace.event_partial_inputs[event] and not self.is_view_op[event]):
                    last_consumer[sid] = event
        # Python references end where profiling saw them end (-1: alive after the forward)
        self.dies_at: list[list[int]] = [[] for _ in range(n_events)]
        for sid, event in enumerate(trace.storage_death):
            if trace.storage_is_activation[sid] and sid not in trace.module_outputs and event >= 0:
                self.dies_at[max(event, trace.storage_producer[sid])].append(sid)
        self.grads_created: list[list[int]] = [[] for _ in range(n_events)]
        self.grads_accumulated: list[list[int]] = [[] for _ in range(n_events)]
        self.grads_freed: list[list[int]] = [[] for _ in range(n_events)]
        for event, inputs in enumerate(trace.event_inputs):
            if trace.event_op[event].startswith(_RESHAPING_VIEWS) and not trace.event_outputs[event]:
                continue  # whoever uses the view uses the storage: their contributions are counted there
            if dead[event]:
                continue
            for sid in inputs:
                partial_use = sid in merged and sid in trace.event_partial_inputs[event] and not self.is_view_op[event]
                if trace.storage_needs_grad[sid] and last_consumer[sid] != event and not partial_use:
                    self.grads_accumulated[event].append(sid)
        for sid in range(n_storages):
            if not trace.storage_needs_grad[sid]:
                continue
            if last_consumer[sid] >= 0:
                self.grads_created[last_consumer[sid]].append(sid)
            producer = trace.storage_producer[sid]
            if producer >= 0:
                self.grads_freed[producer].append(sid)
        self.slices_grad = [op.startswith(_SLICING_BACKWARD) for op in trace.event_op]
        self.aliases_grad = [op.startswith(_ALIASING_BACKWARD) for op in trace.event_op]
        self.passes_grad = [op.startswith(_PASS_THROUGH_BACKWARD) for op in trace.event_op]
        self.needs_contiguous_grad = [
            heavy or op.startswith(_CONTIGUOUS_GRAD_BACKWARD)
            for heavy, op in zip(trace.event_heavy, trace.event_op, strict=True)
        ]
        # Where a recomputation of a plain block stops: torch ends it at the last saved tensor. A
        # saved input is packed *before* its op runs, so if the last save holds only inputs the op
        # itself is not re-run. A selective block caches heavy outputs up to that point only.
        self.cache_end = [self.stop_after(node.first_event, node.last_event) for node in trace.nodes]
        self.is_activation = trace.storage_is_activation
        self.sizes = trace.storage_bytes
        # what the forward makes that it counts (activations), and what each event's backward
        # reads, bound into one tuple per event: the replay's loops run for every event of every
        # plan the solver tries, and one lookup there replaces a dozen
        self.activation_outputs = [
            tuple(sid for sid in outputs if self.is_activation[sid]) for outputs in trace.event_outputs
        ]
        self.backward_facts = [
            _BackwardFacts(
                outputs=trace.event_outputs[event],
                inputs=trace.event_inputs[event],
                workspace=trace.event_workspace[event],
                partial_grads=self.partial_grads[event],
                is_view_op=self.is_view_op[event],
                tap=self.taps.get(event),
                slices_grad=self.slices_grad[event],
                aliases_grad=self.aliases_grad[event],
                needs_contiguous_grad=self.needs_contiguous_grad[event],
                passes_grad=self.passes_grad[event],
                grads_created=self.grads_created[event],
                grads_accumulated=self.grads_accumulated[event],
                grads_freed=self.grads_freed[event],
            )
            for event in range(n_events)
        ]
        # Events at which a replay does nothing but tick its clock (views and other ops that
        # make, save, free and need nothing): a third to a half of a diffusers model's events,
        # so their handling is skipped. ``forward_idle`` events charge nothing outside a
        # recompute (and outside selective and lazy blocks); ``recompute_idle`` ones cost nothing
        # to recompute either.
        starts = set(self.first)
        self.forward_idle = [
            not (self.activation_outputs[e] or trace.event_saves[e] or trace.event_forward_workspace[e])
            and not self.dies_at[e]
            and e not in starts
            for e in range(n_events)
        ]
        self.recompute_idle = [
            idle and not trace.event_cost[e] and not trace.event_flops[e] for e, idle in enumerate(self.forward_idle)
        ]
        self.backward_idle = [
            not (f.partial_grads or f.is_view_op or f.tap or f.grads_created or f.grads_accumulated or f.grads_freed)
            and not (f.workspace or f.needs_contiguous_grad or trace.event_saves[e])
            for e, f in enumerate(self.backward_facts)
        ]
        # outside any recomputation, a dead op whose saves went in the forward has no backward
        released = {e for events in self.dead_release_at.values() for e in events}
        self.top_backward_idle = [idle or e in released for e, idle in enumerate(self.backward_idle)]

    @property
    def step_ns(self) -> float:
        """Predicted time of the unplanned step: the trace's forward and its backward per pass,
        plus a DP engine's per-layer norms and clipped sums in the passes that compute them
        (bookkeeping forms its sums from the book)."""
        engine = sum(
            tap.norm_ns * ("norm" in p.tap_transient) + tap.sum_ns * ("sum" in p.tap_transient or p.books_taps)
            for p in self.step.passes
            for tap in self.trace.taps
        )
        return self.trace.step_ns(self.backward_passes) + engine

    # -- plan helpers ---------------------------------------------------------------------------
    def context(self, node: int, region: int, options: list[Option]) -> int:
        """Outermost checkpointed block strictly inside ``region`` that encloses ``node``."""
        found = -1
        while node != region and node >= 0:
            if options[node] in _CHECKPOINTS:
                found = node
            node = self.parent[node]
        return found

    def lazy_block(self, node: int, options: list[Option]) -> int:
        """The lazy block enclosing ``node``, or -1."""
        while node > 0:
            if options[node] == Option.LAZY:
                return node
            node = self.parent[node]
        return -1

    def lazy_leaves(self, sid: int, block: int) -> tuple[list[int], int, float]:
        """What a lazy ``block`` keeps for saved storage ``sid``: (leaves, rebuild bytes, rebuild cost).

        Mirrors ``lazy.py``: a storage made by a recomputable op inside the block, and not changed
        in place since, is rebuilt from its inputs, recursively; anything else (and any small
        tensor) is kept as it is. Rebuilding materialises the op's recipe inputs one after
        another, then the op's output, and drops the inputs: the rebuild's peak is that of the
        deepest input plus the inputs built before it, or all inputs and the output together (so
        a long chain costs two tensors, not its length).
        """
        trace = self.trace
        producer = trace.storage_producer[sid]
        lo, hi = self.first[block], self.last[block]
        if producer < lo or producer > hi or not trace.event_recomputable[producer] or trace.storage_written[sid]:
            return [sid], 0, 0.0
        leaves: list[int] = []
        built, peak, cost = 0, 0, trace.event_cost[producer]
        for source in trace.event_inputs[producer]:
            if not trace.storage_is_activation[source]:
                continue
            sub_leaves, sub_peak, sub_cost = self.lazy_leaves(source, block)
            leaves += sub_leaves
            peak, cost = max(peak, built + sub_peak), cost + sub_cost
            if sub_peak:  # rebuilt, so it is new memory until this op has run
                built += self.sizes[source]
        return leaves, max(peak, built + self.sizes[sid]), cost

    def stop_after(self, first: int, last: int, inner_starts: tuple[int, ...] = ()) -> int:
        """Last event a recomputation of events ``first..last`` runs (``first - 1``: none).

        ``inner_starts`` are the first events of inner checkpoints: their inputs are saved
        before they start, so reaching one counts as a save of inputs only.
        """
        trace = self.trace
        for event in range(last, first - 1, -1):
            if event in inner_starts:
                return event - 1
            saves = trace.event_saves[event]
            if saves:
                outputs = set(trace.event_outputs[event])
                return event if any(s in outputs for s in saves) else event - 1
        return first - 1

    def cache_limit(self, node: int) -> int:
        """Heavy ops a selective checkpoint of ``node`` caches (see ``cache_end``)."""
        trace = self.trace
        first = trace.nodes[node].first_event
        return sum(trace.event_heavy[e] for e in range(first, self.cache_end[node] + 1))

    def run(self, options: list[Option]) -> SimResult:
        return _Replay(self, options).result()

    def snapshot(self, options: list[Option], step: int) -> Snapshot:
        """Who holds what at ``step`` of the replay of ``options`` (the replay stops there)."""
        try:
            _Replay(self, options, capture_step=step)
        except _Captured as captured:
            return captured.snapshot
        raise ValueError(f"the replay has no step {step}")

    def run_within(self, options: list[Option], limit_bytes: int) -> SimResult | None:
        """The replay of ``options``, or None as soon as its memory passes ``limit_bytes``.

        Most plans a search tries are rejected for their peak, and a replay that stops where the
        memory first passes the bound costs a fraction of a whole one (the solver's pruning and
        move ranking need nothing more about a rejected plan)."""
        try:
            return _Replay(self, options, limit_bytes=limit_bytes).result()
        except _OverLimit:
            return None


class _OverLimit(Exception):
    """A bounded replay passed its memory bound (``Simulator.run_within``)."""


class _Captured(Exception):
    """A replay reached the step it was to capture (``Simulator.snapshot``): nothing after it matters."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class _Replay:
    """State of one replay; methods mirror the phases of a training step."""

    def __init__(
        self, sim: Simulator, options: list[Option], capture_step: int = -1, limit_bytes: float = math.inf
    ) -> None:
        self.sim = sim
        self.limit_bytes = limit_bytes
        self.trace = sim.trace
        self.options = options
        self.capture_step = capture_step
        self.storage_sizes = list(sim.sizes)  # recomputed copies and stashed states are appended
        self.holders: dict[int, int] = {}
        self.python_refs: set[int] = set()
        self.alive: set[int] = set()
        self.grads: set[int] = set()
        self.grad_view_of: dict[int, int] = {}  # grad of sid is a view into the grad buffer of value
        self.grad_slices: set[int] = set()  # of those, the non-contiguous ones (slices of a cat's)
        self.pieces: dict[int, int] = {}  # storage -> bytes of view-sized gradients not merged yet
        self.grad_views: dict[int, int] = {}  # number of views into a grad buffer
        self.grad_orphans: set[int] = set()  # freed grads whose buffer views keep alive
        self.event_holds: dict[int, list[int]] = {}
        self.node_inputs: dict[int, list[int]] = {}
        self.node_cache: dict[int, list[int]] = {}
        # lazy blocks: (peak while rebuilding, bytes left rebuilt) of an event's backward's unpacks
        self.rebuilds: dict[int, tuple[int, int]] = {}
        self.mem = 0
        self.peak = 0
        self.step = 0
        self.peak_step = 0
        self.region = 0
        self.recompute_cost = 0.0
        self.recompute_flops = 0
        self.recompute_counts: dict[int, int] = {}
        self.contexts: dict[tuple[int, int], int] = {}  # (node, region) -> context, for this plan
        self.lazy_blocks: dict[int, int] = {}  # node -> enclosing lazy block, for this plan
        # A checkpoint inside another stashes the RNG state whenever the enclosing forward or a
        # recompute calls it (a CPU tensor its frame keeps): ``restash``.
        self.nested_starts: dict[int, list[int]] = {}  # event -> nested checkpoints starting there
        self.stale_stashes: set[int] = set()  # nested checkpoints whose last stash is still held
        if self.trace.checkpoint_state_bytes:
            for block in range(1, len(options)):
                if options[block] in _CHECKPOINTS and sim.context(sim.parent[block], 0, options) >= 0:
                    self.nested_starts.setdefault(sim.first[block], []).append(block)

        # the step's backward passes (see ``step.py``)
        self.pass_ = sim.step.passes[0]
        self.recomputed_holds: set[int] = set()  # events whose holds a recomputation made
        self.recomputed_nodes: set[int] = set()  # checkpoints a recomputation entered
        self.book: list[tuple[list[int], int, TapNote]] = []  # bookkeeping: (holds, output grad, tap)
        self.pending: dict[int, int] = {}  # layers called more than once: bytes of per-sample gradients
        self.booked_grads: set[int] = set()
        self.deferred: list[tuple[int, list[int]]] = []  # replayed checkpoints: (block, output grads kept)
        self.deferring = False  # inside such a block's backward: its taps book nothing
        self.timing = True  # costs are charged (not in a first-step-only probe pass)
        self.loss_steps: set[int] = set()
        # the training loop's cases (``LoopModel``): ``mem`` is the level of a step that starts
        # without gradients; the others are offsets of it, followed at every tick
        self.cases = sim.loop.gradients
        self.plain_loop = self.cases == PLAIN_LOOP.gradients
        self.prior_bytes = 0 if self.plain_loop else self.trace.parameter_grad_bytes
        self.case_peaks = dict.fromkeys(self.cases, 0)
        self.in_backward = False
        self.parameter_grads = 0  # parameter gradient bytes the step wrote so far
        self.written_now = 0  # of those, written since the last tick
        self.optimizer_step = -1

        trace = self.trace
        self.forward(0, 0, trace.num_events - 1, recompute=False)
        self.forward_end = self.mem
        for backward_pass in sim.step.passes:
            self.pass_ = backward_pass
            # a DP engine's independence probe runs on a graph's first step only: its memory
            # counts (the plan must hold then too), its recomputation is not a cost of every step
            self.timing = backward_pass.parameter_gradients or bool(backward_pass.tap_transient)
            if sim.loss_bytes:  # the loss's backward (its forward, too, before the first pass)
                self.mem += sim.loss_bytes
                self.loss_steps.add(self.step)
                self.tick()
                self.mem -= sim.loss_bytes
            self.in_backward = True  # Lightning frees the last step's gradients here
            for sid in trace.module_outputs:
                if trace.storage_needs_grad[sid] and sid not in self.grads:
                    self.grads.add(sid)
                    self.mem += sim.sizes[sid]
            self.tick()
            self.backward(0, 0, trace.num_events - 1)
            self.end_pass()
        if sim.loop.optimizer_step_bytes:  # on the gradients, after the backward
            self.mem += sim.loop.optimizer_step_bytes
            self.optimizer_step = self.step
            self.tick()
            self.mem -= sim.loop.optimizer_step_bytes

    def result(self) -> SimResult:
        return SimResult(
            peak_bytes=self.peak,
            recompute_cost=self.recompute_cost,
            recompute_flops=self.recompute_flops,
            forward_end_bytes=self.forward_end,
            peak_step=self.peak_step,
            recompute_counts=self.recompute_counts,
            peak_in_loss=self.peak_step in self.loss_steps,
            peak_in_optimizer_step=self.peak_step == self.optimizer_step,
            case_peaks={PriorGradients.RELEASED: self.peak} if self.plain_loop else dict(self.case_peaks),
        )

    # -- bookkeeping ----------------------------------------------------------------------------
    def new_storage(self, nbytes: int) -> int:
        """A storage the replay makes (a recomputed copy, a checkpoint's stashed state): its id."""
        self.storage_sizes.append(nbytes)
        return len(self.storage_sizes) - 1

    def size(self, sid: int) -> int:
        return self.storage_sizes[sid]

    def tick(self) -> None:
        level = self.mem if self.plain_loop else self.loop_level()
        if level > self.peak:
            if level > self.limit_bytes:
                raise _OverLimit
            self.peak, self.peak_step = level, self.step
        if self.step == self.capture_step:
            raise _Captured(
                Snapshot(
                    region=self.region,
                    event_holds={k: list(v) for k, v in self.event_holds.items()},
                    node_holds={k: list(v) + self.node_cache.get(k, []) for k, v in self.node_inputs.items()},
                    python_refs=set(self.python_refs),
                    sizes={sid: self.size(sid) for sid in self.alive},
                )
            )
        self.step += 1

    def loop_level(self) -> int:
        """The highest level of the loop's cases now (their peaks kept): ``mem`` is the step that
        starts without gradients; the last step's gradients add on until the backward; accumulated
        ones add on throughout, less those the step has written (it adds into them), plus what it
        wrote since the last tick (its new gradient, summed in and freed)."""
        highest = 0
        for case in self.cases:
            if case is PriorGradients.RELEASED:
                level = self.mem
            elif case is PriorGradients.UNTIL_BACKWARD:
                level = self.mem + (0 if self.in_backward else self.prior_bytes)
            else:
                level = self.mem - self.parameter_grads + self.prior_bytes + self.written_now
            if level > self.case_peaks[case]:
                self.case_peaks[case] = level
            highest = max(highest, level)
        self.written_now = 0
        return highest

    def wrote_parameter_gradients(self, nbytes: int) -> None:
        """The step writes ``nbytes`` of parameter gradients (kept to the step's end)."""
        self.mem += nbytes
        self.parameter_grads += nbytes
        self.written_now += nbytes

    def hold(self, sids: list[int]) -> list[int]:
        held = [sid for sid in sids if sid in self.alive]
        for sid in held:
            self.holders[sid] = self.holders.get(sid, 0) + 1
        return held

    def hold_lazily(self, event: int, block: int) -> list[int]:
        """Hold the recipe leaves of ``event``'s saves; note what its backward must rebuild."""
        held: list[int] = []
        for sid in self.trace.event_saves[event]:
            if self.sim.sizes[sid] < MIN_LAZY_BYTES:
                held += self.hold([sid])
                continue
            leaves, rebuild, cost = self.sim.lazy_leaves(sid, block)
            for leaf in leaves:  # the recipe kept it alive since it was made
                if leaf not in self.alive and self.sim.is_activation[leaf]:
                    self.alive.add(leaf)
                    self.mem += self.size(leaf)
            held += self.hold(leaves)
            if rebuild:  # unpacked one after another: earlier ones stay rebuilt while later ones are
                peak, rebuilt = self.rebuilds.get(event, (0, 0))
                self.rebuilds[event] = (max(peak, rebuilt + rebuild), rebuilt + self.sim.sizes[sid])
                self.charge(Option.LAZY, cost * self.sim.backward_passes)
        return held

    def release(self, sids: list[int]) -> None:
        for sid in sids:
            self.holders[sid] -= 1
            self.maybe_free(sid)

    def maybe_free(self, sid: int) -> None:
        if sid in self.alive and not self.holders.get(sid) and sid not in self.python_refs:
            self.alive.discard(sid)
            self.mem -= self.storage_sizes[sid]

    def lazy_block(self, node: int) -> int:
        """``Simulator.lazy_block`` under this replay's plan, memoised per node."""
        found = self.lazy_blocks.get(node)
        if found is None:
            found = self.lazy_blocks[node] = self.sim.lazy_block(node, self.options)
        return found

    def context(self, node: int, region: int) -> int:
        """``Simulator.context`` under this replay's plan, memoised: every event asks it, often more than once."""
        key = (node, region)
        found = self.contexts.get(key)
        if found is None:
            found = self.contexts[key] = self.sim.context(node, region, self.options)
        return found

    # -- phases ---------------------------------------------------------------------------------
    def forward(self, region: int, lo: int, hi: int, recompute: bool, keep: tuple[int, ...] = ()) -> list[int]:
        """Forward over events ``lo..hi`` of ``region``; a recompute uses fresh storage ids.

        ``keep``: storages whose recomputed copies the caller still references when the
        recomputation returns (a replayed block's outputs); returns their new ids."""
        sim, trace, options = self.sim, self.trace, self.options
        selective_recompute = recompute and options[region] == Option.SELECTIVE
        cache_end = sim.cache_end[region]
        remap: dict[int, int] = {}
        handed: list[int] = []  # cached outputs a selective recompute took from its cache

        def mapped(sid: int) -> int:
            return remap.get(sid, sid)

        # the loop runs for every event of every replay: what it reads is bound once here, and
        # what depends only on the event's block (its checkpoint, its lazy block, the costs they
        # charge) once per run of that block's events
        event_node, event_outputs, event_saves = trace.event_node, trace.event_outputs, trace.event_saves
        event_heavy, event_workspace, dies_at = trace.event_heavy, trace.event_forward_workspace, sim.dies_at
        activation_outputs, sizes, first = sim.activation_outputs, sim.sizes, sim.first
        nested_starts = self.nested_starts
        alive, python_refs, storage_sizes, holders = self.alive, self.python_refs, self.storage_sizes, self.holders
        event_cost, event_flops, timing = trace.event_cost, trace.event_flops, self.timing
        scale, overheads = trace.option_scale, trace.overheads
        recompute_scale = scale.get(options[region], 1.0)
        idle = sim.recompute_idle if recompute else sim.forward_idle
        top, dead_release_at = region == 0 and not recompute, sim.dead_release_at
        node = ctx = lazy = -1
        per_op_ns = save_scale = 0.0
        caching = False
        stashes_ending = 0  # RNG stashes that go as this recompute returns (``restash``)
        for event in range(lo, hi + 1):
            if event_node[event] != node:  # a block's events mostly run back to back
                node = event_node[event]
                ctx = self.context(node, region)
                lazy = self.lazy_block(node) if ctx < 0 and not recompute else -1
                caching = ctx >= 0 and options[ctx] == Option.SELECTIVE
                # each op through torch's caching dispatch mode, or recorded (and rebuilt) as a recipe
                per_op_ns = 0.0
                if selective_recompute or caching:
                    per_op_ns += overheads.selective_op_ns * scale.get(Option.SELECTIVE, 1.0)
                if lazy >= 0:
                    per_op_ns += overheads.lazy_op_ns * scale.get(Option.LAZY, 1.0)
                save_scale = scale.get(options[ctx], 1.0) if ctx >= 0 and not recompute else 0.0
            if idle[event] and not per_op_ns:  # only the clock moves (``Simulator.forward_idle``)
                self.tick()
                continue
            if ctx >= 0 and event == first[ctx]:
                self.enter_checkpoint(ctx, mapped)
                if recompute:
                    self.recomputed_nodes.add(ctx)
            if nested_starts and event in nested_starts:
                stashes_ending += self.restash(nested_starts[event], ctx, region, recompute)
            cached = selective_recompute and event_heavy[event] and event <= cache_end
            if cached:
                handed += self.hand_over_cached(region, event_outputs[event])
            else:
                for sid in activation_outputs[event]:
                    if recompute:
                        new = self.new_storage(sizes[sid])
                        remap[sid] = new
                        sid = new
                    alive.add(sid)  # allocated, referenced from Python
                    python_refs.add(sid)
                    self.mem += storage_sizes[sid]
            saves = event_saves[event]
            if timing:
                if per_op_ns:
                    self.recompute_cost += per_op_ns
                if save_scale and saves:  # each save is packed, then unpacked from a recomputation
                    self.recompute_cost += overheads.checkpoint_save_ns * len(saves) * save_scale
                if recompute and not cached:
                    self.recompute_cost += event_cost[event] * recompute_scale
                    self.recompute_flops += event_flops[event]
            if ctx < 0 and saves:
                if lazy >= 0:
                    self.event_holds[event] = self.hold_lazily(event, lazy)
                else:
                    self.event_holds[event] = self.hold([remap.get(s, s) for s in saves] if remap else saves)
                    if recompute:
                        self.recomputed_holds.add(event)
            elif caching and event_heavy[event] and event <= sim.cache_end[ctx]:
                self.node_cache[ctx].extend(self.hold([mapped(s) for s in event_outputs[event]]))
            workspace = 0 if cached else event_workspace[event]
            self.mem += workspace
            self.tick()
            self.mem -= workspace
            for sid in dies_at[event]:
                if remap:
                    sid = remap.get(sid, sid)
                python_refs.discard(sid)
                if sid in alive and not holders.get(sid):  # ``maybe_free``, inlined
                    alive.discard(sid)
                    self.mem -= storage_sizes[sid]
            if top and event in dead_release_at:  # dead branches' graphs go (``dead_branches``)
                for dead in dead_release_at[event]:
                    self.release(self.event_holds.pop(dead, []))
        if recompute and hi < sim.last[region]:
            stashes_ending += self.pack_at_stop(region, hi + 1, mapped)
        kept = [mapped(sid) for sid in keep if mapped(sid) in self.alive]
        if recompute:  # the recomputed function's own results are dropped when it returns
            self.mem -= stashes_ending * self.trace.checkpoint_state_bytes
            for sid in [*remap.values(), *handed]:
                if sid not in kept:
                    self.python_refs.discard(sid)
                    self.maybe_free(sid)
        return kept

    def charge(self, option: Option, nanoseconds: float) -> None:
        """Add a cost of ``option``, scaled by what calibration measured against the model's estimate."""
        if self.timing:
            self.recompute_cost += nanoseconds * self.trace.option_scale.get(option, 1.0)

    def enter_checkpoint(self, ctx: int, mapped: Callable[[int], int]) -> None:
        """A checkpoint starts: it holds its inputs, and the RNG state it stashes, until its backward."""
        self.charge(self.options[ctx], self.trace.overheads.checkpoint_call_ns)
        held = self.hold([mapped(s) for s in self.trace.nodes[ctx].inputs])
        if self.trace.checkpoint_state_bytes:
            state = self.new_storage(self.trace.checkpoint_state_bytes)
            self.alive.add(state)
            self.mem += self.trace.checkpoint_state_bytes
            held += self.hold([state])
        self.node_inputs[ctx] = held
        self.node_cache[ctx] = []

    def hand_over_cached(self, block: int, sids: tuple[int, ...]) -> list[int]:
        """A selective recompute reaches a cached op: torch pops its output from the cache and
        hands it to the recomputed code, which then references it like an output it made; the
        cache no longer holds it (it goes as soon as nothing else does). Returns the outputs."""
        cache = self.node_cache.get(block, [])
        handed = []
        for sid in sids:
            if sid in cache:
                cache.remove(sid)
                self.holders[sid] -= 1
            if sid in self.alive and self.sim.is_activation[sid]:
                self.python_refs.add(sid)
                handed.append(sid)
        return handed

    def restash(self, blocks: list[int], ctx: int, region: int, recompute: bool) -> int:
        """Nested checkpoints are called: each call stashes the RNG state, a CPU tensor its frame
        keeps (a context's own stash is ``enter_checkpoint``'s). The top-level forward's frames
        live until their block's backward is done (``release_stashes_inside``). A recompute's
        frames are dropped when it returns, while the originals stay; from then on the context's
        own stash stands in for its original. Returns how many stashes go as the recompute returns."""
        state = self.trace.checkpoint_state_bytes
        ending = 0
        for block in blocks:
            if block == region:
                continue  # its own recompute runs the block's function, not its checkpoint
            if not recompute:
                self.mem += state
                if block in self.stale_stashes:  # a block whose earlier call this one replaces
                    self.tick()
                    self.mem -= state
                self.stale_stashes.add(block)
            elif block != ctx:
                self.mem += state
                ending += 1
            elif block in self.stale_stashes:
                self.stale_stashes.discard(block)
                ending += 1
        return ending

    def release_stashes_inside(self, block: int) -> None:
        """The backward of ``block`` is done: stashes of checkpoints inside it that no recompute
        replaced (it stopped before them) go with its frame."""
        first, last = self.sim.first, self.sim.last
        for inner in [b for b in self.stale_stashes if first[block] <= first[b] <= last[block]]:
            self.stale_stashes.discard(inner)
            self.mem -= self.trace.checkpoint_state_bytes

    def pack_at_stop(self, region: int, stop: int, mapped: Callable[[int], int]) -> int:
        """Hold what the event that ends a recomputation packs.

        torch stops a recomputation at its last *pack*, and autograd packs an op's saved inputs
        before the op runs (an inner checkpoint packs its inputs as it starts): the op itself is
        not re-run, but what it packed stays in the checkpoint until its backward unpacks it.
        Returns the RNG stashes that go as the recompute returns (``restash``).
        """
        sim, trace = self.sim, self.trace
        ctx = self.context(trace.event_node[stop], region)
        if ctx >= 0 and stop == sim.first[ctx]:
            self.enter_checkpoint(ctx, mapped)
            self.recomputed_nodes.add(ctx)
            self.tick()  # its stash is allocated before the pack stops the recompute
            if ctx in self.stale_stashes:  # its stash now stands in for the original's
                self.stale_stashes.discard(ctx)
                return 1
        elif ctx < 0 and trace.event_saves[stop]:
            self.event_holds[stop] = self.hold([mapped(s) for s in trace.event_saves[stop]])
            self.recomputed_holds.add(stop)
        return 0

    def end_pass(self) -> None:
        """Bookkeeping's clipped sums (one booked layer at a time), then the pass's leftover
        activation gradients go (a retained pass's saves stay for the next)."""
        self.mem -= sum(self.pending.values())  # the norms are known: summed per-sample gradients go
        self.pending = {}
        for holds, grad, tap in self.book:
            transient = tap.sum_bytes + tap.book_copy_bytes
            self.wrote_parameter_gradients(tap.parameter_bytes)
            self.mem += transient
            self.tick()
            self.mem -= transient
            self.release(holds)
            self.booked_grads.discard(grad)
            self.free_grad(grad)
        self.book = []
        for block, grads in self.deferred:
            self.replay_block(block)
            self.release(self.node_inputs.pop(block, []))
            for sid in grads:
                self.booked_grads.discard(sid)
                self.free_grad(sid)
        self.deferred = []
        for sid in [s for s in self.grads if self.sim.is_activation[s]]:
            self.free_grad(sid)
        self.mem -= sum(self.pieces.values())
        self.pieces = {}

    def defers(self, block: int, region: int) -> bool:
        """Whether this pass replays ``block`` after its book instead of booking the taps inside."""
        if not (self.pass_.replays_checkpoints and region == 0 and self.options[block] == Option.FULL):
            return False
        if not self.trace.nodes[block].replayable:
            return False
        parent = self.sim.parent[block]
        while parent >= 0:  # the runtime records only blocks no other planned block encloses
            if self.options[parent] != Option.KEEP:
                return False
            parent = self.sim.parent[parent]
        return True

    def replay_block(self, block: int) -> None:
        """A deferred block again: its forward from the kept inputs (inner checkpoints as planned),
        then its backward from the kept output gradients, writing its taps' clipped sums."""
        sim, trace = self.sim, self.trace
        outer_pass, outer_region = self.pass_, self.region
        self.pass_, self.region = _REPLAY_PASS, block
        outputs = self.forward(
            block, sim.first[block], sim.last[block], recompute=True, keep=trace.nodes[block].outputs
        )
        self.backward(block, sim.first[block], sim.last[block])
        self.recompute_cost += sum(trace.event_backward_cost[sim.first[block] : sim.last[block] + 1])
        for sid in outputs:
            self.python_refs.discard(sid)
            self.maybe_free(sid)
        self.pass_, self.region = outer_pass, outer_region

    def free_grad(self, sid: int) -> None:
        """The gradient of ``sid`` is released (its buffer may live on in views of it)."""
        if sid not in self.grads:
            return
        self.grads.discard(sid)
        if sid in self.grad_view_of:
            self.drop_grad_view(sid)
        elif self.grad_views.get(sid):
            self.grad_orphans.add(sid)  # its slices still point into the buffer
        else:
            self.mem -= self.sim.sizes[sid]

    def release_or_retain(self, holds: list[int], recomputed: bool) -> list[int]:
        """Release ``holds`` after their backward, unless a retained pass keeps them (what the
        forward saved; recomputed tensors are dropped after use even then). Returns what stays."""
        if self.pass_.retains_graph and not recomputed:
            return holds
        self.release(holds)
        return []

    def backward(self, region: int, lo: int, hi: int) -> None:
        sim, trace = self.sim, self.trace
        event_node, backward_event = trace.event_node, self.backward_event
        idle = sim.top_backward_idle if region == 0 else sim.backward_idle
        event, node, ctx = hi, -1, -1
        while event >= lo:
            if event_node[event] != node:  # a block's events mostly run back to back
                node = event_node[event]
                ctx = self.context(node, region)
            if ctx < 0:
                if idle[event]:  # only the clock moves (``Simulator.backward_idle``)
                    self.tick()
                else:
                    backward_event(event)
                event -= 1
                continue
            self.recompute_counts[ctx] = self.recompute_counts.get(ctx, 0) + 1
            outer_region, self.region = self.region, ctx
            defers = self.defers(ctx, region)
            if defers:  # its output gradients stay, with its inputs, for the replay
                grads = [sid for sid in trace.nodes[ctx].outputs if sid in self.grads]
                self.booked_grads.update(grads)
                self.deferred.append((ctx, grads))
                self.deferring = True
            # torch forks the RNG around a recompute: a copy of the CPU state lives while it runs
            self.mem += trace.checkpoint_state_bytes
            self.forward(ctx, sim.first[ctx], self.early_stop_end(ctx), recompute=True)
            self.mem -= trace.checkpoint_state_bytes
            self.release(self.node_cache.pop(ctx, []))  # consumed by the recompute (or its saves)
            self.backward(ctx, sim.first[ctx], sim.last[ctx])
            recomputed = ctx in self.recomputed_nodes
            self.recomputed_nodes.discard(ctx)
            if defers:
                self.deferring = False
            else:
                kept = self.release_or_retain(self.node_inputs.pop(ctx, []), recomputed)
                if kept:
                    self.node_inputs[ctx] = kept
            if self.stale_stashes:
                self.release_stashes_inside(ctx)
            self.region = outer_region
            event = sim.first[ctx] - 1

    def early_stop_end(self, block: int) -> int:
        """Last event a recompute of ``block`` runs, given the checkpoints inside it."""
        sim, trace = self.sim, self.trace
        first, last = sim.first[block], sim.last[block]
        inner_starts = []
        plain_last = first - 1
        event_node, event_saves = trace.event_node, trace.event_saves
        node = ctx = -1
        for event in range(first, last + 1):
            if event_node[event] != node:
                node = event_node[event]
                ctx = self.context(node, block)
            if ctx >= 0 and event == sim.first[ctx]:
                inner_starts.append(event)
            if ctx < 0 and event_saves[event]:
                plain_last = event
        candidates = [sim.stop_after(first, plain_last)] if plain_last >= first else []
        candidates += [start - 1 for start in inner_starts]
        return max(candidates, default=first - 1)

    def backward_event(self, event: int) -> None:
        sim, sizes, facts = self.sim, self.sim.sizes, self.sim.backward_facts[event]
        outputs, grads = facts.outputs, self.grads
        viewing = (facts.slices_grad or facts.aliases_grad) and len(outputs) == 1 and outputs[0] in grads
        rebuild_peak, rebuilt = self.rebuilds.get(event, (0, 0)) if self.rebuilds else (0, 0)  # every pass rebuilds
        transient = facts.workspace + rebuilt
        created = self.mem
        for sid, size in facts.partial_grads:  # a gradient the size of the view read
            self.pieces[sid] = self.pieces.get(sid, 0) + size
            self.mem += size
        merged = 0
        if facts.is_view_op:  # the view op's backward merges the pieces into one gradient
            merged = sum(self.pieces.pop(sid, 0) for sid in facts.inputs)
        tap = facts.tap
        if tap is not None:  # what the DP engine computes at this layer in this pass
            transient += tap.norm_bytes * ("norm" in self.pass_.tap_transient)
            transient += tap.sum_bytes * ("sum" in self.pass_.tap_transient)
            repeated = tap.layer in sim.repeated_layers and tap.layer not in self.pending
            if "norm" in self.pass_.tap_transient and repeated:
                # a layer called more than once sums its per-sample gradients until the norms are known
                self.pending[tap.layer] = tap.per_sample_bytes
                self.mem += tap.per_sample_bytes
        for sid in facts.grads_created:
            if sid in grads or not (self.pass_.parameter_gradients or sim.is_activation[sid]):
                continue
            grads.add(sid)
            # an alias only where autograd hands the gradient on as it is: same size (no broadcast
            # reduction), and not a parameter's (accumulated into its .grad)
            if viewing and (facts.slices_grad or (sim.is_activation[sid] and sizes[sid] == sizes[outputs[0]])):
                base = self.grad_view_of.get(outputs[0], outputs[0])
                self.grad_view_of[sid] = base
                self.grad_views[base] = self.grad_views.get(base, 0) + 1
                if facts.slices_grad or outputs[0] in self.grad_slices:
                    self.grad_slices.add(sid)
            elif sim.is_activation[sid]:
                self.mem += sizes[sid]
            else:
                self.wrote_parameter_gradients(sizes[sid])
        if facts.needs_contiguous_grad and self.grad_slices:  # a slice-view gradient is copied to contiguous first
            transient += sum(sizes[sid] for sid in outputs if sid in self.grad_slices)
        for sid in facts.grads_accumulated:
            if sid in self.grad_view_of:  # a second contribution: autograd sums into a new buffer
                self.mem += sizes[sid]
                self.drop_grad_view(sid)
            elif not facts.passes_grad:
                transient += sizes[sid]
            if self.pass_.parameter_gradients and not sim.is_activation[sid]:
                # a parameter's contributions are summed into a new buffer: measured for Linear
                # weights and biases (the DiT embedding called twice); conv, norm and embedding
                # weights sum in place, so there this over-counts one weight's bytes, briefly
                transient += sizes[sid]
        # the saved tensors are rebuilt (unpacked) before the op's backward allocates anything
        transient = max(transient, rebuild_peak - (self.mem - created))
        self.mem += transient
        self.tick()
        self.mem -= transient
        holds = self.event_holds.pop(event, [])
        recomputed = event in self.recomputed_holds
        self.recomputed_holds.discard(event)
        if tap is not None and self.pass_ is _REPLAY_PASS:
            self.wrote_parameter_gradients(tap.parameter_bytes)  # the replay writes its clipped sum into them
        if tap is not None and self.pass_.books_taps and not self.deferring and tap.output_sid in self.grads:
            if rebuilt:  # a lazy block's saved input, rebuilt for this backward, now stays in the book
                kept = self.new_storage(rebuilt)
                self.alive.add(kept)
                self.mem += rebuilt
                holds = [*holds, *self.hold([kept])]
            self.book.append((holds, tap.output_sid, tap))  # kept, with the output gradient, to the end
            self.booked_grads.add(tap.output_sid)
        elif holds and (kept := self.release_or_retain(holds, recomputed)):
            self.event_holds[event] = kept
        self.mem -= merged  # the pieces die with the view op's backward
        freed = facts.grads_freed
        if self.pieces:
            for sid in freed:  # pieces never merged (no view op in between)
                self.mem -= self.pieces.pop(sid, 0)
        for sid in freed:
            if sid in grads and sid not in self.booked_grads:
                self.free_grad(sid)

    def drop_grad_view(self, sid: int) -> None:
        self.grad_slices.discard(sid)
        base = self.grad_view_of.pop(sid)
        self.grad_views[base] -= 1
        if not self.grad_views[base] and base in self.grad_orphans:
            self.grad_orphans.discard(base)
            self.mem -= self.sim.sizes[base]
