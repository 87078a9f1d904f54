"""One training step simulated under a plan: its memory ledger, event by event, and its extension point.

The simulation follows what torch does with non-reentrant ``torch.utils.checkpoint``:

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

Memory is counted above what training holds outside the step (parameters, optimizer state); the
module's inputs and the rest of what the loop keeps beside the step are ``step.Alongside``.

What a step does around the plain backward (more passes, work at some layers, saves kept to the
pass's end, blocks run again after it) is its step model's (``step.StepModel.effects_for``): a
:class:`StepEffects` the ledger calls at fixed points, whose default does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_tbp.remat.folding import ChainFold
from lightning_tbp.remat.host_tier import offloaded
from lightning_tbp.remat.lazy import MIN_LAZY_BYTES
from lightning_tbp.remat.options import CHECKPOINTS, Option, checkpoint_context, enclosing_block
from lightning_tbp.remat.shared_prefix import RestOfStep, SharedPrefix, copied, fingerprint, snapshot
from lightning_tbp.remat.step import (
    NOTHING_ALONGSIDE,
    PLAIN_LOOP,
    PLAIN_STEP,
    Alongside,
    BackwardPass,
    LoopModel,
    PriorGradients,
    StepModel,
)
from lightning_tbp.remat.trace import GatherSpan
from lightning_tbp.remat.trace_facts import TraceFacts

#: The device peak a plan that cannot run is given (one whose host copies pass the host budget).
UNREACHABLE = 2**62


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
    host_peak_bytes: int = 0
    """The most bytes offloaded blocks keep on the host tier at once (``host_tier.py``)."""
    streamed_bytes: int = 0
    """Frozen weights streamed blocks keep on the host (``host_weights.py``): off the device
    all step but inside those blocks, the parameters as loaded less these."""


@dataclass
class Holdings:
    """Who holds which storage at one instant of a simulated step (used to steer the solver)."""

    region: int
    event_holds: dict[int, list[int]]
    node_holds: dict[int, list[int]]
    python_refs: set[int]
    sizes: dict[int, int]


class OverLimit(Exception):
    """A bounded simulation passed its memory bound (``Simulator.run_within``)."""


class Captured(Exception):
    """A simulation reached the instant it was to capture (``Simulator.holdings_at``): nothing after it matters."""

    def __init__(self, holdings: Holdings) -> None:
        super().__init__()
        self.holdings = holdings


class StepEffects:
    """What a step model does around the plain backward, called by the ledger at fixed points;
    the plain step does nothing. Subclasses act on the ledger's public state (``step``): its
    memory level, holds, gradients, and its forward and backward phases.

    * ``backward_transient``: bytes the effects allocate, briefly, at a noted event's backward.
    * ``take_saves``: whether they keep a noted event's saves (``holds``) past its backward;
      ``rebuilt``: bytes a lazy block rebuilt, or an offloaded one copied back, for that backward.
    * ``defer_block`` / ``deferred_block_done``: whether a checkpointed block's backward is
      deferred (its inputs stay: the effects run it again later), and its backward ended.
    * ``end_pass``: the pass's backward is done; before the ledger frees its leftover gradients.
    """

    def __init__(self, step: SimulatedStep) -> None:
        self.step = step

    def backward_transient(self, event: int) -> int:
        return 0

    def take_saves(self, event: int, holds: list[int], rebuilt: int) -> bool:
        return False

    def defer_block(self, block: int, region: int) -> bool:
        return False

    def deferred_block_done(self, block: int) -> None:
        pass

    def end_pass(self) -> None:
        pass


class SimulatedStep:
    """One training step simulated under a plan: the memory ledger, advanced event by event
    (``tick``); methods mirror the phases of the step. ``effects``: what the step model does
    around the plain backward (``StepModel.effects_for``), made once this step is set up."""

    def __init__(
        self,
        facts: TraceFacts,
        options: list[Option],
        step: StepModel = PLAIN_STEP,
        effects: Callable[[SimulatedStep], StepEffects] | None = None,
        loss_bytes: int = 0,
        loop: LoopModel = PLAIN_LOOP,
        alongside: Alongside = NOTHING_ALONGSIDE,
        capture_step: int = -1,
        limit_bytes: float = math.inf,
        host_limit_bytes: float = math.inf,
        shared: SharedPrefix | None = None,
        fold: ChainFold | None = None,
    ) -> None:
        self.facts = facts
        self.fold = fold
        # the folded chain's marks (``top_forward``, ``top_backward``): the level, host bytes
        # and costs as the first call's span ends (forward) or the second call's begins (backward)
        self.fold_mark: tuple[int, int, float, int] | None = None
        self.fold_bytes = self.fold_host = 0  # the left-out calls' held bytes, device and host
        self.limit_bytes = limit_bytes
        self.host_limit_bytes = host_limit_bytes
        self.trace = facts.trace
        self.options = options
        self.capture_step = capture_step
        self.storage_sizes = list(facts.sizes)  # recomputed copies and stashed states are appended
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
        # streamed blocks' weights (``host_weights.py``): on the host all step, but for the
        # block's forward and its recompute-and-backward, where copies live on the device
        self.streams = {b: facts.block_weights[b] for b in range(1, len(options)) if options[b] == Option.STREAM}
        self.streamed = streamed = sum(facts.sizes[sid] for sids in self.streams.values() for sid in sids)
        # bytes on the host tier now, and at most: with the optimizer's state there, all step long
        self.host = self.host_peak = streamed + loop.host_state_bytes
        self.stream_open = -1  # the streamed block whose forward holds its weights' copies now
        self.stream_copies: list[int] = []
        # FSDP2 units' gathered parameters (``fsdp_gathers.py``): spans by their first and last
        # events, and the spans gathered now
        self.gather_firsts: dict[int, list[int]] = {}
        self.gather_lasts: dict[int, list[int]] = {}
        for index, span in enumerate(self.trace.fsdp.spans):
            self.gather_firsts.setdefault(span.first_event, []).append(index)
            self.gather_lasts.setdefault(span.last_event, []).append(index)
        self.gathered: set[int] = set()
        self.reduce_inputs: list[int] = []  # the reduce-scatter inputs FSDP2 keeps, oldest first
        self.flat_gathered = 0  # across processes: the forward's last all-gather output, kept
        self.prefetched: dict[int, int] = {}  # spans whose all-gather output a backward prefetch made
        # per span, the span whose unit's forward ended last before it (FSDP2's backward prefetch)
        self.prefetch_target = _prefetch_targets(self.trace.fsdp.spans)
        # the loop's batch and what training_step made before the call, against the parameters
        # as loaded: streamed weights are off the device
        self.mem = alongside.total - streamed
        self.peak = self.mem
        self.step = 0
        self.peak_step = 0
        self.region = 0
        self.recompute_cost = 0.0
        self.recompute_flops = 0
        self.recompute_counts: dict[int, int] = {}
        self.contexts: dict[tuple[int, int], int] = {}  # (node, region) -> context, for this plan
        self.lazy_blocks: dict[int, int] = {}  # node -> enclosing lazy block, for this plan
        self.offload_blocks: dict[int, int] = {}  # node -> enclosing offloaded block, for this plan
        self.offloaded: dict[int, list[int]] = {}  # event -> its saves on the host tier
        self.host_refs: dict[tuple[int, int], int] = {}  # (offloaded block, storage) -> saves of its host copy
        self.host_block: dict[int, int] = {}  # event -> the offloaded block it saved in
        # A checkpoint inside another stashes the RNG state whenever the enclosing forward or a
        # recompute calls it (a CPU tensor its frame keeps): ``restash``.
        self.nested_starts: dict[int, list[int]] = {}  # event -> nested checkpoints starting there
        self.stale_stashes: set[int] = set()  # nested checkpoints whose last stash is still held
        if self.trace.checkpoint_state_bytes:
            for block in range(1, len(options)):
                if (
                    options[block] in CHECKPOINTS
                    and checkpoint_context(facts.parent, facts.parent[block], 0, options) >= 0
                ):
                    self.nested_starts.setdefault(facts.first[block], []).append(block)

        # the step's backward passes (see ``step.py``)
        self.pass_ = step.passes[0]
        self.every_step_passes = step.every_step_passes
        self.recomputed_holds: set[int] = set()  # events whose holds a recomputation made
        self.recomputed_nodes: set[int] = set()  # checkpoints a recomputation entered
        self.kept_grads: set[int] = set()  # gradients the step's effects keep past their producer's backward
        self.timing = True  # costs are charged (not in a first-step-only probe pass)
        self.loss_steps: set[int] = set()
        # the training loop's cases (``LoopModel``): ``mem`` is the level of a step that starts
        # without gradients; the others are offsets of it, followed at every tick
        self.cases = loop.gradients
        self.plain_loop = self.cases == PLAIN_LOOP.gradients
        self.prior_bytes = 0 if self.plain_loop else self.trace.parameter_grad_bytes
        self.case_peaks = dict.fromkeys(self.cases, self.mem)
        self.in_backward = False
        self.parameter_grads = 0  # parameter gradient bytes the step wrote so far
        self.written_now = 0  # of those, written since the last tick
        self.optimizer_step = -1
        # the optimizer inside the backward (``LoopModel.step_in_backward``): parameters stepped
        # where their gradient is complete, or under FSDP2 after their unit's reduce-scatter
        sharded = bool(self.trace.fsdp.spans)
        self.parameter_steps = facts.parameter_grads_done if loop.step_in_backward and not sharded else {}
        self.steps_in_backward = loop.step_in_backward
        self.parameter_step_ratio = loop.parameter_step_ratio
        # parameters stepped on the host where only some are (``LoopModel.hosted_parameters``): no temporaries here
        hosted = loop.hosted_parameters or frozenset()
        self.host_stepped = {sid for sid, name in self.trace.trainable_weights.items() if name in hosted}

        trace = self.trace
        # a prefix shared with other plans (``shared_prefix.py``): the plain single-pass step only
        if shared is not None and (effects is not None or len(step.passes) > 1 or self.trace.fsdp.spans):
            shared = None
        key = shared.key(options) if shared is not None else None
        split = shared.split if shared is not None and key is not None else 0
        if shared is not None and key is not None and not self.resume(shared, key):
            self.top_forward(0, split - 1)
            shared.keep_state(key, snapshot(vars(self)))
        self.top_forward(split, trace.num_events - 1)
        self.forward_end = self.mem
        self.effects = effects(self) if effects is not None else StepEffects(self)
        if shared is not None and key is not None:
            self.begin_pass(step.passes[0], loss_bytes, alongside)
            self.top_backward(split, trace.num_events - 1)
            self.rest_shared(shared, key, loop)
            return
        for backward_pass in step.passes:
            self.begin_pass(backward_pass, loss_bytes, alongside)
            self.top_backward(0, trace.num_events - 1)
            self.end_pass()
        self.optimizer_step_after(loop)

    def begin_pass(self, backward_pass: BackwardPass, loss_bytes: int, alongside: Alongside) -> None:
        """A backward pass starts: the loss's backward (its forward too, before the first pass),
        then the module's outputs' gradients."""
        self.pass_ = backward_pass
        # a probe of the first step only: its memory counts, its recomputation is no cost of every step
        self.timing = backward_pass.every_step
        if loss_bytes:
            self.mem += loss_bytes
            self.loss_steps.add(self.step)
            self.tick()
            self.mem -= loss_bytes
        if not self.in_backward:  # training_step returned: its own tensors go, the batch stays
            self.mem -= alongside.until_backward
            for sid in self.trace.autocast_cached:  # and autocast's cache with its context
                self.python_refs.discard(sid)
                self.maybe_free(sid)
        self.in_backward = True  # Lightning frees the last step's gradients here
        for sid in self.trace.module_outputs:
            if self.trace.storage_needs_grad[sid] and sid not in self.grads:
                self.grads.add(sid)
                self.mem += self.facts.sizes[sid]
        self.tick()

    def optimizer_step_after(self, loop: LoopModel) -> None:
        """The optimizer's step on the gradients, after the backward (unless it runs inside it)."""
        if loop.optimizer_step_bytes and not loop.step_in_backward:
            self.mem += loop.optimizer_step_bytes
            self.optimizer_step = self.step
            self.tick()
            self.mem -= loop.optimizer_step_bytes

    def resume(self, shared: SharedPrefix, key: tuple[Option, ...]) -> bool:
        """Take the forward's state at the shared prefix's end from an earlier simulation of it;
        False where none is kept, or where this one must stop inside the prefix (a capture)."""
        state = shared.resume_state(key)
        if state is None or 0 <= self.capture_step < state["step"]:
            return False
        for name, value in state.items():
            setattr(self, name, copied(value))
        if self.peak > self.limit_bytes:
            raise OverLimit
        return True

    def rest_shared(self, shared: SharedPrefix, key: tuple[Option, ...], loop: LoopModel) -> None:
        """The rest of the step (the backward before the split, the pass's end, the optimizer's
        step): an earlier simulation's where it left the same state, else run here and kept."""
        split = shared.split
        if self.capture_step >= self.step:  # the capture is in the rest: run it
            self.rest_of_step(split, loop)
            return
        state = fingerprint(vars(self), split)
        rest = shared.rest(key, state)
        if rest is None:
            state = snapshot(state)  # the rest edits the step's own fields
            rest = self.run_rest(split, loop)
            shared.keep_rest(key, state, rest)
        if rest.peak > self.limit_bytes:
            raise OverLimit
        if rest.peak > self.peak:
            self.peak, self.peak_step = rest.peak, self.step + rest.peak_offset
        for case, peak in rest.case_peaks.items():
            self.case_peaks[case] = max(self.case_peaks[case], peak)
        self.recompute_cost += rest.recompute_cost
        self.recompute_flops += rest.recompute_flops
        for node, count in rest.recompute_counts.items():
            self.recompute_counts[node] = self.recompute_counts.get(node, 0) + count
        if rest.optimizer_offset >= 0:
            self.optimizer_step = self.step + rest.optimizer_offset

    def rest_of_step(self, split: int, loop: LoopModel) -> None:
        self.top_backward(0, split - 1)
        self.end_pass()
        self.optimizer_step_after(loop)

    def run_rest(self, split: int, loop: LoopModel) -> RestOfStep:
        """Run the rest of the step with its results counted apart (the running ones put aside)."""
        put_aside = (self.peak, self.peak_step, self.case_peaks)
        cost, flops, counts, start = self.recompute_cost, self.recompute_flops, self.recompute_counts, self.step
        self.peak, self.case_peaks = -1, dict.fromkeys(self.cases, -1)
        self.recompute_cost, self.recompute_flops, self.recompute_counts = 0.0, 0, {}
        self.rest_of_step(split, loop)
        rest = RestOfStep(
            peak=self.peak,
            peak_offset=self.peak_step - start,
            case_peaks=self.case_peaks,
            recompute_cost=self.recompute_cost,
            recompute_flops=self.recompute_flops,
            recompute_counts=self.recompute_counts,
            optimizer_offset=self.optimizer_step - start if self.optimizer_step >= 0 else -1,
        )
        self.peak, self.peak_step, self.case_peaks = put_aside
        self.recompute_cost, self.recompute_flops, self.recompute_counts = cost, flops, counts
        self.step, self.optimizer_step = start, -1
        return rest

    def result(self) -> SimResult:
        """The step's result; a plan that passes the host budget cannot run, so its device peak
        reads as :data:`UNREACHABLE` and every search rejects it."""
        return SimResult(
            peak_bytes=self.peak if self.host_peak <= self.host_limit_bytes else UNREACHABLE,
            recompute_cost=self.recompute_cost,
            recompute_flops=self.recompute_flops,
            forward_end_bytes=self.forward_end,
            peak_step=self.peak_step,
            recompute_counts=self.recompute_counts,
            peak_in_loss=self.peak_step in self.loss_steps,
            peak_in_optimizer_step=self.peak_step == self.optimizer_step,
            case_peaks={PriorGradients.RELEASED: self.peak} if self.plain_loop else dict(self.case_peaks),
            host_peak_bytes=self.host_peak,
            streamed_bytes=self.streamed,
        )

    # -- the ledger -----------------------------------------------------------------------------
    def new_storage(self, nbytes: int) -> int:
        """A storage the simulation makes (a recomputed copy, a checkpoint's stashed state): its id."""
        self.storage_sizes.append(nbytes)
        return len(self.storage_sizes) - 1

    def size(self, sid: int) -> int:
        return self.storage_sizes[sid]

    def tick(self) -> None:
        """One instant of the step: its level against the peak and the limit, the capture. The
        hottest loops skip the call where nothing can change: a plain loop's level (``mem``) not
        above the peak and no capture at this step (a fifth of a simulation of a 4-call chain)."""
        level = self.mem if self.plain_loop else self.loop_level()
        if level > self.peak:
            if level > self.limit_bytes:
                raise OverLimit
            self.peak, self.peak_step = level, self.step
        if self.step == self.capture_step:
            raise Captured(
                Holdings(
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
            if self.facts.sizes[sid] < MIN_LAZY_BYTES:
                held += self.hold([sid])
                continue
            leaves, rebuild, cost = self.facts.lazy_leaves(sid, block)
            for leaf in leaves:  # the recipe kept it alive since it was made
                if leaf not in self.alive and self.facts.is_activation[leaf]:
                    self.alive.add(leaf)
                    self.mem += self.size(leaf)
            held += self.hold(leaves)
            if rebuild:  # unpacked one after another: earlier ones stay rebuilt while later ones are
                peak, rebuilt = self.rebuilds.get(event, (0, 0))
                self.rebuilds[event] = (max(peak, rebuilt + rebuild), rebuilt + self.facts.sizes[sid])
                self.charge(Option.LAZY, cost * self.every_step_passes)
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
        """The lazy block enclosing ``node`` under this step's plan (``options.enclosing_block``), memoised."""
        found = self.lazy_blocks.get(node)
        if found is None:
            found = self.lazy_blocks[node] = enclosing_block(self.facts.parent, node, self.options, Option.LAZY)
        return found

    def offload_block(self, node: int) -> int:
        """The offloaded block enclosing ``node`` under this step's plan, memoised."""
        found = self.offload_blocks.get(node)
        if found is None:
            found = self.offload_blocks[node] = enclosing_block(self.facts.parent, node, self.options, Option.OFFLOAD)
        return found

    def offload(self, event: int, block: int) -> list[int]:
        """An offloaded block's op saves: what goes to the host is copied there, once per storage
        while it lives (``host_tier.HostCopies``), and its device storage is left to its Python
        references; the rest is held. Returns what is held."""
        saves = self.trace.event_saves[event]
        sizes = self.facts.sizes
        copied = copies = 0
        for sid in saves:
            if not offloaded(self.trace, sid):
                continue
            self.offloaded.setdefault(event, []).append(sid)
            key = (block, sid)
            if key not in self.host_refs or sid not in self.alive:
                copied += sizes[sid]
                copies += 1
                self.host += sizes[sid] if key not in self.host_refs else 0
            self.host_refs[key] = self.host_refs.get(key, 0) + 1
        if event in self.offloaded:
            self.host_block[event] = block
        self.host_peak = max(self.host_peak, self.host)
        if self.host_peak > self.host_limit_bytes and self.limit_bytes < math.inf:
            raise OverLimit  # a bounded simulation rejects the plan at once (``result`` says why otherwise)
        overheads = self.trace.overheads
        copy_ns = copied * overheads.offload_ns_per_byte + copies * overheads.offload_save_ns
        self.charge(Option.OFFLOAD, copy_ns + len(saves) * overheads.checkpoint_save_ns)
        return self.hold([sid for sid in saves if not offloaded(self.trace, sid)])

    def unpacked(self, event: int) -> int:
        """Bytes ``event``'s backward copies back from the host (each save its own copy); its host
        copies go after it, unless a retained pass needs them again, which copies them back once
        more (one way of the round trip :meth:`offload` charged)."""
        sids = self.offloaded.get(event)
        if not sids:
            return 0
        nbytes = sum(self.facts.sizes[sid] for sid in sids)
        if self.pass_.retains_graph:
            overheads = self.trace.overheads
            self.charge(
                Option.OFFLOAD, 0.5 * (nbytes * overheads.offload_ns_per_byte + len(sids) * overheads.offload_save_ns)
            )
        else:
            del self.offloaded[event]
            block = self.host_block.pop(event)
            for sid in sids:
                key = (block, sid)
                self.host_refs[key] -= 1
                if not self.host_refs[key]:
                    del self.host_refs[key]
                    self.host -= self.facts.sizes[sid]
        return nbytes

    def context(self, node: int, region: int) -> int:
        """``options.checkpoint_context`` under this plan, memoised: every event asks it, often more than once."""
        key = (node, region)
        found = self.contexts.get(key)
        if found is None:
            found = self.contexts[key] = checkpoint_context(self.facts.parent, node, region, self.options)
        return found

    # -- phases ---------------------------------------------------------------------------------
    def top_forward(self, lo: int, hi: int) -> None:
        """The top-level forward over events ``lo..hi``; in a folded chain (``folding.py``), the
        left-out calls' held bytes and costs are added where the second call's span ends."""
        fold = self.fold
        if fold is not None:
            for end, hook in ((fold.first_end, self.first_call_forwarded), (fold.second_end, self.calls_folded_in)):
                if lo <= end <= hi:
                    self.forward(0, lo, end, recompute=False)
                    hook(fold.omitted)
                    lo = end + 1
        if lo <= hi:
            self.forward(0, lo, hi, recompute=False)

    def first_call_forwarded(self, omitted: int) -> None:
        self.fold_mark = (self.mem, self.host, self.recompute_cost, self.recompute_flops)

    def calls_folded_in(self, omitted: int) -> None:
        """The second call's span ended: each left-out call holds what it did (``fold_bytes``)
        and costs what it did in the forward."""
        assert self.fold_mark is not None
        mem, host, cost, flops = self.fold_mark
        self.fold_bytes, self.fold_host = omitted * (self.mem - mem), omitted * (self.host - host)
        self.mem += self.fold_bytes
        self.host += self.fold_host
        self.host_peak = max(self.host_peak, self.host)
        if self.host_peak > self.host_limit_bytes and self.limit_bytes < math.inf:
            raise OverLimit
        self.recompute_cost += omitted * (self.recompute_cost - cost)
        self.recompute_flops += omitted * (self.recompute_flops - flops)
        self.fold_mark = None

    def top_backward(self, lo: int, hi: int) -> None:
        """The top-level backward over events ``hi..lo``; in a folded chain, the left-out
        calls' held bytes go where the backward reaches the second call's span, and their costs
        are added as it leaves it."""
        fold = self.fold
        if fold is not None:
            for end, hook in ((fold.second_end, self.calls_folded_out), (fold.first_end, self.second_call_undone)):
                if lo <= end <= hi:
                    if end < hi:
                        self.backward(0, end + 1, hi)
                    hook(fold.omitted)
                    hi = end
        self.backward(0, lo, hi)

    def calls_folded_out(self, omitted: int) -> None:
        self.mem -= self.fold_bytes
        self.host -= self.fold_host
        self.fold_mark = (self.mem, self.host, self.recompute_cost, self.recompute_flops)

    def second_call_undone(self, omitted: int) -> None:
        """The second call's backward is done: each left-out call's cost as much."""
        assert self.fold_mark is not None
        _, _, cost, flops = self.fold_mark
        self.recompute_cost += omitted * (self.recompute_cost - cost)
        self.recompute_flops += omitted * (self.recompute_flops - flops)
        self.fold_mark = None

    def forward(self, region: int, lo: int, hi: int, recompute: bool, keep: tuple[int, ...] = ()) -> list[int]:
        """Forward over events ``lo..hi`` of ``region``; a recompute uses fresh storage ids.

        ``keep``: storages whose recomputed copies the caller still references when the
        recomputation returns (a block run again, its outputs); returns their new ids."""
        facts, trace, options = self.facts, self.trace, self.options
        selective_recompute = recompute and options[region] == Option.SELECTIVE
        cache_end = facts.cache_end[region]
        remap: dict[int, int] = {}
        handed: list[int] = []  # cached outputs a selective recompute took from its cache

        def mapped(sid: int) -> int:
            return remap.get(sid, sid)

        # the loop runs for every event of every simulation: what it reads is bound once here, and
        # what depends only on the event's block (its checkpoint, its lazy block, the costs they
        # charge) once per run of that block's events
        event_node, event_outputs, event_saves = trace.event_node, trace.event_outputs, trace.event_saves
        event_heavy, event_workspace, dies_at = facts.heavy, trace.event_forward_workspace, facts.dies_at
        activation_outputs, sizes, first = facts.activation_outputs, facts.sizes, facts.first
        nested_starts = self.nested_starts
        alive, python_refs, storage_sizes, holders = self.alive, self.python_refs, self.storage_sizes, self.holders
        event_cost, event_flops, timing = trace.event_cost, trace.event_flops, self.timing
        scale, overheads = trace.option_scale, trace.overheads
        # a streamed block recomputes as a full checkpoint does (its copies are charged apart)
        recompute_scale = scale.get(Option.FULL if options[region] == Option.STREAM else options[region], 1.0)
        streaming = recompute and options[region] == Option.STREAM
        if streaming:  # the recompute copies the block's weights in first
            for sid in self.streams[region]:
                remap[sid] = self.stream_copy(sid)
            self.charge_stream(region)
        resident_saves = trace.event_resident_saves
        idle = facts.recompute_idle if recompute else facts.forward_idle
        plain, capture = self.plain_loop, self.capture_step
        top, dead_release_at = region == 0 and not recompute, facts.dead_release_at
        node = ctx = lazy = off = -1
        per_op_ns = save_scale = 0.0
        caching = False
        stashes_ending = 0  # RNG stashes that go as this recompute returns (``restash``)
        gather_firsts, gather_lasts = self.gather_firsts, self.gather_lasts
        for event in range(lo, hi + 1):
            # a unit's post-forward reshards it before the next unit's pre-forward gathers
            if gather_lasts and not recompute and event - 1 in gather_lasts and event > lo:
                self.reshard(gather_lasts[event - 1])
            if gather_firsts and event in gather_firsts:
                self.gather(gather_firsts[event], in_forward=not recompute)
            if event_node[event] != node:  # a block's events mostly run back to back
                node = event_node[event]
                ctx = self.context(node, region)
                lazy = self.lazy_block(node) if ctx < 0 and not recompute else -1
                off = self.offload_block(node) if ctx < 0 and not recompute else -1
                caching = ctx >= 0 and options[ctx] == Option.SELECTIVE
                # each op through torch's caching dispatch mode, or recorded (and rebuilt) as a recipe
                per_op_ns = 0.0
                if selective_recompute or caching:
                    per_op_ns += overheads.selective_op_ns * scale.get(Option.SELECTIVE, 1.0)
                if lazy >= 0:
                    per_op_ns += overheads.lazy_op_ns * scale.get(Option.LAZY, 1.0)
                save_scale = scale.get(options[ctx], 1.0) if ctx >= 0 and not recompute else 0.0
            if self.stream_open >= 0 and event > facts.last[self.stream_open]:
                self.stream_out()
            if idle[event] and not per_op_ns:  # only the clock moves (``TraceFacts.forward_idle``)
                if plain and self.mem <= self.peak and self.step != capture:
                    self.step += 1  # ``tick`` where the level cannot pass the peak: the hottest path
                else:
                    self.tick()
                continue
            if ctx >= 0 and event == first[ctx]:
                self.enter_checkpoint(ctx, mapped)
                if recompute:
                    self.recomputed_nodes.add(ctx)
                elif options[ctx] == Option.STREAM:
                    self.stream_in(ctx)
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
            if streaming and resident_saves[event]:  # the weights' copies it saves stay too
                saves = [*saves, *(sid for sid in resident_saves[event] if sid in remap)]
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
                elif off >= 0:
                    self.event_holds[event] = self.offload(event, off)
                else:
                    self.event_holds[event] = self.hold([remap.get(s, s) for s in saves] if remap else saves)
                    if recompute:
                        self.recomputed_holds.add(event)
            elif caching and event_heavy[event] and event <= facts.cache_end[ctx]:
                self.node_cache[ctx].extend(self.hold([mapped(s) for s in event_outputs[event]]))
            workspace = 0 if cached else event_workspace[event]
            if plain and self.mem + workspace <= self.peak and self.step != capture:
                self.step += 1  # ``tick`` below the peak
            else:
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
        if gather_lasts and not recompute and hi in gather_lasts:
            self.reshard(gather_lasts[hi])
        if self.flat_gathered and region == 0 and not recompute and hi == self.trace.num_events - 1:
            self.mem -= self.flat_gathered  # the root's post-forward frees the last all-gather output
            self.flat_gathered = 0
        if self.stream_open >= 0 and hi >= facts.last[self.stream_open]:
            self.stream_out()
        if recompute and hi < facts.last[region]:
            stashes_ending += self.pack_at_stop(region, hi + 1, mapped)
        kept = [mapped(sid) for sid in keep if mapped(sid) in self.alive]
        if recompute:  # the recomputed function's own results are dropped when it returns
            self.mem -= stashes_ending * self.trace.checkpoint_state_bytes
            for sid in [*remap.values(), *handed]:
                if sid not in kept:
                    self.python_refs.discard(sid)
                    self.maybe_free(sid)
        return kept

    def gather(self, spans: list[int], in_forward: bool = False) -> None:
        """FSDP2 gathers these spans' units' parameters (unless they are gathered now). Across
        processes it all-gathers into one flat output first and copies out of it: in the forward
        the output stays until the next unit's copy-out (the root's post-forward frees the last),
        elsewhere it goes after its own, unless a prefetch made it earlier (``pre_backward``)."""
        across = self.trace.fsdp.world > 1
        for index in spans:
            if index in self.gathered:
                continue
            self.gathered.add(index)
            nbytes = self.trace.fsdp.spans[index].nbytes
            if not across or not nbytes:
                self.mem += nbytes
            elif in_forward:
                self.all_gather(nbytes)  # this unit's all-gather output
                self.mem += nbytes - self.flat_gathered  # the last one freed, then the copy-out
                self.flat_gathered = nbytes
            else:
                if not self.prefetched.pop(index, 0):
                    self.all_gather(nbytes)
                self.mem += nbytes  # the copy-out, then the output freed
                self.tick()
                self.mem -= nbytes

    def all_gather(self, nbytes: int) -> None:
        """An all-gather of ``nbytes`` into a new flat output: an instant of the step (a backward
        prefetch's can be its peak), with gloo's flat copy of the output beside it there."""
        copy = nbytes if self.trace.fsdp.gathers_through_copy else 0
        self.mem += nbytes + copy
        self.tick()
        self.mem -= copy

    def pre_backward(self, spans: list[int]) -> None:
        """The backward reaches these spans' units: each is gathered again (where it was freed
        after its forward), and across processes FSDP2 then prefetches the unit whose forward
        ended just before: its all-gather output is made now, copied out when its backward comes."""
        self.gather(spans)
        if self.trace.fsdp.world == 1:
            return
        for index in spans:
            before = self.prefetch_target[index]
            if before >= 0 and before not in self.gathered and before not in self.prefetched:
                self.prefetched[before] = self.trace.fsdp.spans[before].nbytes
                self.all_gather(self.prefetched[before])

    def reshard(self, spans: list[int], after_backward: bool = False) -> None:
        """These spans' units free their gathered parameters: after their forward where they
        reshard then, after their backward always."""
        for index in spans:
            span = self.trace.fsdp.spans[index]
            if index in self.gathered and (after_backward or span.regathered):
                self.gathered.discard(index)
                self.mem -= span.nbytes
            if after_backward and span.post_backward:
                self.post_backward(span)

    def post_backward(self, span: GatherSpan) -> None:
        """A unit's post-backward, after its resharding: FSDP2 frees the oldest reduce-scatter
        inputs it keeps (down to one fewer than it may keep), then copies the unit's gradients
        into a new one (``reduce_bytes``), kept; its sharded gradients, a 1/world share, replace
        the full ones (the same bytes in one process). An optimizer inside the backward steps
        them there, one parameter at a time, and their buffer goes once all are stepped."""
        kept = self.reduce_inputs
        while kept and len(kept) >= self.trace.fsdp.reduce_inputs_kept:
            self.mem -= kept.pop(0)
        reduce_bytes, world = span.reduce_bytes, self.trace.fsdp.world
        if not reduce_bytes:
            return
        kept.append(reduce_bytes)
        self.mem += reduce_bytes
        self.tick()
        sharded_away = reduce_bytes - reduce_bytes // world
        self.mem -= sharded_away
        self.parameter_grads -= sharded_away
        if self.steps_in_backward:
            temporaries = math.ceil(self.parameter_step_ratio * span.largest_reduced_bytes / world)
            self.mem += temporaries
            self.tick()
            self.mem -= temporaries
            if self.plain_loop:  # kept, as an upper bound, where the loop holds earlier gradients
                self.mem -= reduce_bytes // world
                self.parameter_grads -= reduce_bytes // world

    def stream_copy(self, sid: int) -> int:
        """A device copy of streamed weight ``sid``, referenced from Python: its new storage id."""
        copy = self.new_storage(self.facts.sizes[sid])
        self.alive.add(copy)
        self.python_refs.add(copy)
        self.mem += self.facts.sizes[sid]
        return copy

    def stream_in(self, block: int) -> None:
        """A streamed block's forward starts: its weights are copied in until it returns."""
        self.stream_open = block
        self.stream_copies = [self.stream_copy(sid) for sid in self.streams[block]]
        self.charge_stream(block)

    def stream_out(self) -> None:
        """The streamed block's forward returned: nothing saved its copies (a checkpoint's forward)."""
        for sid in self.stream_copies:
            self.python_refs.discard(sid)
            self.maybe_free(sid)
        self.stream_open, self.stream_copies = -1, []

    def charge_stream(self, block: int) -> None:
        """One copy of a streamed block's weights from the host: one way of the measured round trip."""
        sids = self.streams[block]
        overheads = self.trace.overheads
        nbytes = sum(self.facts.sizes[sid] for sid in sids)
        self.charge(
            Option.STREAM, 0.5 * (nbytes * overheads.offload_ns_per_byte + len(sids) * overheads.offload_save_ns)
        )

    def charge(self, option: Option, nanoseconds: float) -> None:
        """Add a cost of ``option``, scaled by what calibration measured against the model's estimate."""
        if self.timing:
            self.recompute_cost += nanoseconds * self.trace.option_scale.get(option, 1.0)

    def enter_checkpoint(self, ctx: int, mapped: Callable[[int], int]) -> None:
        """A checkpoint starts: it holds its inputs, and the RNG state it stashes, until its backward.

        Its frame lives through what its ops pack: a block none of whose ops saves anything for
        a backward (frozen layers on inputs that need no gradient, a LoRA model's first blocks)
        keeps nothing, and its backward recomputes nothing."""
        self.charge(self.options[ctx], self.trace.overheads.checkpoint_call_ns)
        if self.facts.packs_nothing[ctx]:
            self.node_inputs[ctx], self.node_cache[ctx] = [], []
            return
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
            if sid in self.alive and self.facts.is_activation[sid]:
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
        first, last = self.facts.first, self.facts.last
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
        facts, trace = self.facts, self.trace
        ctx = self.context(trace.event_node[stop], region)
        if ctx >= 0 and stop == facts.first[ctx]:
            self.enter_checkpoint(ctx, mapped)
            self.recomputed_nodes.add(ctx)
            self.tick()  # its stash is allocated before the pack stops the recompute
            if ctx in self.stale_stashes:  # its stash now stands in for the original's
                self.stale_stashes.discard(ctx)
                return 1
        elif ctx < 0 and (trace.event_saves[stop] or trace.event_resident_saves[stop]):
            saves = [*trace.event_saves[stop], *trace.event_resident_saves[stop]]
            self.event_holds[stop] = self.hold([mapped(s) for s in saves])
            self.recomputed_holds.add(stop)
        return 0

    def end_pass(self) -> None:
        """The step's effects end the pass, then its leftover activation gradients go (a retained
        pass's saves stay for the next)."""
        self.effects.end_pass()
        self.mem -= sum(self.reduce_inputs)  # FSDP2's final callback frees the ones it kept
        self.reduce_inputs.clear()
        for sid in [s for s in self.grads if self.facts.is_activation[s]]:
            self.free_grad(sid)
        self.mem -= sum(self.pieces.values())
        self.pieces = {}

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
            self.mem -= self.facts.sizes[sid]

    def release_or_retain(self, holds: list[int], recomputed: bool) -> list[int]:
        """Release ``holds`` after their backward, unless a retained pass keeps them (what the
        forward saved; recomputed tensors are dropped after use even then). Returns what stays."""
        if self.pass_.retains_graph and not recomputed:
            return holds
        self.release(holds)
        return []

    def backward(self, region: int, lo: int, hi: int) -> None:
        facts, trace = self.facts, self.trace
        event_node, backward_event = trace.event_node, self.backward_event
        idle = facts.top_backward_idle if region == 0 else facts.backward_idle
        event, node, ctx = hi, -1, -1
        gather_firsts, gather_lasts = self.gather_firsts, self.gather_lasts
        while event >= lo:
            if gather_lasts and event in gather_lasts:  # the backward reaches a unit: gathered again
                self.pre_backward(gather_lasts[event])
            if event_node[event] != node:  # a block's events mostly run back to back
                node = event_node[event]
                ctx = self.context(node, region)
            if ctx < 0:
                if idle[event]:  # only the clock moves (``TraceFacts.backward_idle``)
                    self.tick()
                else:
                    backward_event(event)
                if gather_firsts and event in gather_firsts:  # the unit's backward is done
                    self.reshard(gather_firsts[event], after_backward=True)
                event -= 1
                continue
            self.recompute_counts[ctx] = self.recompute_counts.get(ctx, 0) + 1
            outer_region, self.region = self.region, ctx
            defers = self.effects.defer_block(ctx, region)  # its inputs stay, for the effects to run it again
            # torch recomputes at the first unpack of a saved tensor: the backward of the block's
            # last ops, which saved nothing (a residual add, a scale by a number), runs before
            tail = self.save_free_tail(ctx)
            self.backward(ctx, tail, facts.last[ctx])
            # torch forks the RNG around a recompute: a copy of the CPU state lives while it runs
            self.mem += trace.checkpoint_state_bytes
            self.forward(ctx, facts.first[ctx], self.early_stop_end(ctx), recompute=True)
            self.mem -= trace.checkpoint_state_bytes
            self.release(self.node_cache.pop(ctx, []))  # consumed by the recompute (or its saves)
            self.backward(ctx, facts.first[ctx], tail - 1)
            recomputed = ctx in self.recomputed_nodes
            self.recomputed_nodes.discard(ctx)
            if defers:
                self.effects.deferred_block_done(ctx)
            else:
                kept = self.release_or_retain(self.node_inputs.pop(ctx, []), recomputed)
                if kept:
                    self.node_inputs[ctx] = kept
            if self.stale_stashes:
                self.release_stashes_inside(ctx)
            self.region = outer_region
            event = facts.first[ctx] - 1

    def save_free_tail(self, block: int) -> int:
        """First event of the run of ``block``'s last events whose backward unpacks nothing:
        they saved nothing, or no gradient reaches them (a dead branch: no backward at all), and
        lie in no checkpoint inside it (``last + 1``: none). Only full and selective checkpoints
        recompute on an unpack (a streamed block's weights come in first)."""
        trace, facts = self.trace, self.facts
        last = facts.last[block]
        if self.options[block] not in (Option.FULL, Option.SELECTIVE):
            return last + 1
        event_node, event_saves, resident_saves = trace.event_node, trace.event_saves, trace.event_resident_saves
        dead = facts.dead
        tail = last + 1
        while tail > facts.first[block]:
            event = tail - 1
            unpacks = (event_saves[event] or resident_saves[event]) and not dead[event]
            if unpacks or self.context(event_node[event], block) >= 0:
                break
            tail = event
        return tail

    def early_stop_end(self, block: int) -> int:
        """Last event a recompute of ``block`` runs, given the checkpoints inside it."""
        facts, trace = self.facts, self.trace
        first, last = facts.first[block], facts.last[block]
        inner_starts = []
        plain_last = first - 1
        event_node, event_saves = trace.event_node, trace.event_saves
        node = ctx = -1
        for event in range(first, last + 1):
            if event_node[event] != node:
                node = event_node[event]
                ctx = self.context(node, block)
            if ctx >= 0 and event == facts.first[ctx]:
                inner_starts.append(event)
            if ctx < 0 and (event_saves[event] or trace.event_resident_saves[event]):
                plain_last = event
        candidates = [facts.stop_after(first, plain_last)] if plain_last >= first else []
        candidates += [start - 1 for start in inner_starts]
        return max(candidates, default=first - 1)

    def backward_event(self, event: int) -> None:
        facts, sizes, event_facts = self.facts, self.facts.sizes, self.facts.backward_facts[event]
        outputs, grads = event_facts.outputs, self.grads
        viewing = (event_facts.slices_grad or event_facts.aliases_grad) and len(outputs) == 1 and outputs[0] in grads
        rebuild_peak, rebuilt = self.rebuilds.get(event, (0, 0)) if self.rebuilds else (0, 0)  # every pass rebuilds
        unpacked = self.unpacked(event) if self.offloaded else 0  # copied back before the op's backward
        transient = event_facts.workspace + rebuilt + unpacked
        created = self.mem
        for sid, size in event_facts.partial_grads:  # a gradient the size of the view read
            self.pieces[sid] = self.pieces.get(sid, 0) + size
            self.mem += size
        merged = 0
        if event_facts.is_view_op:  # the view op's backward merges the pieces into one gradient
            merged = sum(self.pieces.pop(sid, 0) for sid in event_facts.inputs)
        if event_facts.noted:  # what the step's effects compute at this layer in this pass
            transient += self.effects.backward_transient(event)
        for sid in event_facts.grads_created:
            if sid in grads or not (self.pass_.parameter_gradients or facts.is_activation[sid]):
                continue
            grads.add(sid)
            # an alias only where autograd hands the gradient on as it is: same size (no broadcast
            # reduction), and not a parameter's (accumulated into its .grad)
            if viewing and (event_facts.slices_grad or (facts.is_activation[sid] and sizes[sid] == sizes[outputs[0]])):
                base = self.grad_view_of.get(outputs[0], outputs[0])
                self.grad_view_of[sid] = base
                self.grad_views[base] = self.grad_views.get(base, 0) + 1
                if event_facts.slices_grad or outputs[0] in self.grad_slices:
                    self.grad_slices.add(sid)
            elif facts.is_activation[sid]:
                self.mem += sizes[sid]
            else:
                self.wrote_parameter_gradients(sizes[sid])
        if (
            event_facts.needs_contiguous_grad and self.grad_slices
        ):  # a slice-view gradient is copied to contiguous first
            transient += sum(sizes[sid] for sid in outputs if sid in self.grad_slices)
        for sid in event_facts.grads_accumulated:
            if sid in self.grad_view_of:  # a second contribution: autograd sums into a new buffer
                self.mem += sizes[sid]
                self.drop_grad_view(sid)
            elif not event_facts.passes_grad:
                transient += sizes[sid]
            if self.pass_.parameter_gradients and not facts.is_activation[sid]:
                # a parameter's contributions are summed into a new buffer: measured for Linear
                # weights and biases (the DiT embedding called twice); conv, norm and embedding
                # weights sum in place, so there this over-counts one weight's bytes, briefly
                transient += sizes[sid]
        # the saved tensors are rebuilt (unpacked) before the op's backward allocates anything
        transient = max(transient, rebuild_peak - (self.mem - created))
        if self.plain_loop and self.mem + transient <= self.peak and self.step != self.capture_step:
            self.step += 1  # ``tick`` below the peak
        else:
            self.mem += transient
            self.tick()
            self.mem -= transient
        holds = self.event_holds.pop(event, [])
        recomputed = event in self.recomputed_holds
        self.recomputed_holds.discard(event)
        taken = event_facts.noted and self.effects.take_saves(event, holds, rebuilt + unpacked)
        if not taken and holds and (kept := self.release_or_retain(holds, recomputed)):
            self.event_holds[event] = kept
        self.mem -= merged  # the pieces die with the view op's backward
        freed = event_facts.grads_freed
        if self.pieces:
            for sid in freed:  # pieces never merged (no view op in between)
                self.mem -= self.pieces.pop(sid, 0)
        for sid in freed:
            if sid in grads and sid not in self.kept_grads:
                self.free_grad(sid)
        if self.parameter_steps and event in self.parameter_steps and self.pass_.parameter_gradients:
            self.step_parameters(self.parameter_steps[event])

    def step_parameters(self, sids: list[int]) -> None:
        """The optimizer steps these parameters, whose gradients are now complete, one at a time:
        each step's temporaries while it runs, then its gradient freed (kept, as an upper bound,
        where the loop holds earlier gradients: ``LoopModel.step_in_backward``)."""
        sizes = self.facts.sizes
        for sid in sids:
            if sid not in self.grads:
                continue
            temporaries = 0 if sid in self.host_stepped else math.ceil(self.parameter_step_ratio * sizes[sid])
            self.mem += temporaries
            self.tick()
            self.mem -= temporaries
            if self.plain_loop:
                self.grads.discard(sid)
                self.mem -= sizes[sid]
                self.parameter_grads -= sizes[sid]

    def step_written_gradients(self, nbytes: int) -> None:
        """Parameter gradients the step's effects just wrote, complete, are stepped at once (the
        optimizer inside the backward): their step's temporaries while it runs, then the
        gradients freed (kept where the loop holds earlier ones, as in :meth:`step_parameters`)."""
        temporaries = math.ceil(self.parameter_step_ratio * nbytes)
        self.mem += temporaries
        self.tick()
        self.mem -= temporaries
        if self.plain_loop:
            self.mem -= nbytes
            self.parameter_grads -= nbytes

    def drop_grad_view(self, sid: int) -> None:
        self.grad_slices.discard(sid)
        base = self.grad_view_of.pop(sid)
        self.grad_views[base] -= 1
        if not self.grad_views[base] and base in self.grad_orphans:
            self.grad_orphans.discard(base)
            self.mem -= self.facts.sizes[base]


def _prefetch_targets(spans: list[GatherSpan]) -> list[int]:
    """Per span (in the order its units' forwards ended, FSDP2's post-forward order), the one
    before it whose unit has parameters (one without has no param group to gather): -1 if none."""
    targets, last = [], -1
    for index, span in enumerate(spans):
        targets.append(last)
        if span.nbytes:
            last = index
    return targets
