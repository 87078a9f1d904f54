"""What a simulation of one trace needs to know about it, worked out once for every plan the solver tries.

Which ops are dead branches, when each storage's Python reference ends, who creates, sums and
frees each gradient, what each event's backward reads, which events only tick the clock, where a
recomputation stops and what a lazy block keeps: all fixed by the trace, none by the plan.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from lightning_tbp.remat.ops import GradientHandOff
from lightning_tbp.remat.trace import Trace


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


def block_weights(
    trace: Trace, parent: list[int], first: list[int], last: list[int], dead: list[bool]
) -> list[list[int]]:
    """Per node, the frozen weights (``trace.frozen_weights``) only its events read: what
    streaming the block moves off the device. A weight goes to the lowest node whose events
    span all its reads, and to every node enclosing that one.

    A weight a dead branch reads stays resident: the backward never reaches that op, so what a
    recompute saves there is not unpacked, and torch's checkpoint keeps it until the graph goes
    (after the step, when the loop drops its loss): a copy would outlive the step."""
    reads: dict[int, list[int]] = {}
    read_dead: set[int] = set()
    for event, inputs in enumerate(trace.event_inputs):
        for sid in inputs:
            if sid in trace.frozen_weights:
                span = reads.setdefault(sid, [event, event])
                span[1] = event
                if dead[event]:
                    read_dead.add(sid)
    for sid in read_dead:
        del reads[sid]
    owned: list[list[int]] = [[] for _ in parent]
    for sid, (lo, hi) in reads.items():
        node = trace.event_node[lo]
        while node > 0 and last[node] < hi:
            node = parent[node]
        if node > 0 and first[node] <= lo:
            owned[node].append(sid)
    for node in range(len(parent) - 1, 0, -1):  # children come after their parent (pre-order)
        if parent[node] > 0:
            owned[parent[node]].extend(owned[node])
    return [sorted(sids) for sids in owned]


class BackwardFacts(NamedTuple):
    """What the backward of one event reads about it (``TraceFacts.backward_facts``)."""

    outputs: tuple[int, ...]
    inputs: tuple[int, ...]
    workspace: int
    partial_grads: list[tuple[int, int]]
    is_view_op: bool
    noted: bool  # the step model noted a layer here (``step.LayerNote``): its effects act at this event
    slices_grad: bool
    aliases_grad: bool
    needs_contiguous_grad: bool
    passes_grad: bool
    grads_created: list[int]
    grads_accumulated: list[int]
    grads_freed: list[int]


class TraceFacts:
    """The per-trace precomputation of the simulator. ``noted``: events where the step model
    acts (``step.LayerNote``): never skipped as idle."""

    def __init__(self, trace: Trace, noted: Collection[int] = ()) -> None:
        self.trace = trace
        noted = set(noted)
        n_storages = len(trace.storage_bytes)
        n_events = trace.num_events
        self.parent = [node.parent for node in trace.nodes]
        self.first = [node.first_event for node in trace.nodes]
        self.last = [node.last_event for node in trace.nodes]
        # An op that reads a storage through a smaller view (a chunk, a slice) gets a gradient of
        # the view's size, kept apart until the view op's backward merges the pieces into one
        # gradient of the whole storage; the storage's gradient proper starts there.
        self.is_view_op = [traits.picks_part for traits in trace.event_traits]
        self.heavy = [traits.heavy for traits in trace.event_traits]
        # ops no gradient reaches contribute none, and their saves go in the forward
        self.dead, self.dead_release_at = dead_branches(trace)
        dead = self.dead
        self.partial_grads: list[list[tuple[int, int]]] = [[] for _ in range(n_events)]
        merged = set()
        no_grad_writes = trace.no_grad_writes
        for event, partial in enumerate(trace.event_partial_inputs):
            if self.is_view_op[event] or dead[event]:
                continue
            for sid, size in partial.items():
                if trace.storage_needs_grad[sid] and sid not in no_grad_writes.get(event, ()):
                    self.partial_grads[event].append((sid, size))
                    merged.add(sid)
        last_consumer = [-1] * n_storages
        for event, inputs in enumerate(trace.event_inputs):
            if dead[event]:
                continue
            for sid in inputs:
                if sid in no_grad_writes.get(event, ()):
                    continue  # written without grad: no gradient comes back through this op
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
            if trace.event_traits[event].reshapes and not trace.event_outputs[event]:
                continue  # whoever uses the view uses the storage: their contributions are counted there
            if dead[event]:
                continue
            for sid in inputs:
                partial_use = sid in merged and sid in trace.event_partial_inputs[event] and not self.is_view_op[event]
                written_without_grad = sid in no_grad_writes.get(event, ())
                if (
                    trace.storage_needs_grad[sid]
                    and last_consumer[sid] != event
                    and not partial_use
                    and not written_without_grad
                ):
                    self.grads_accumulated[event].append(sid)
        for sid in range(n_storages):
            if not trace.storage_needs_grad[sid]:
                continue
            if last_consumer[sid] >= 0:
                self.grads_created[last_consumer[sid]].append(sid)
            producer = trace.storage_producer[sid]
            if producer >= 0:
                self.grads_freed[producer].append(sid)
        # where each parameter's gradient is complete: the backward of its first reader (autograd
        # sums every contribution before it accumulates the gradient, and runs hooks there)
        first_reader: dict[int, int] = {}
        for event in range(n_events - 1, -1, -1):
            for sid in (*self.grads_created[event], *self.grads_accumulated[event]):
                if not trace.storage_is_activation[sid]:
                    first_reader[sid] = event
        self.parameter_grads_done: dict[int, list[int]] = {}
        for sid, event in first_reader.items():
            self.parameter_grads_done.setdefault(event, []).append(sid)
        # Where a recomputation of a plain block stops: torch ends it at the last saved tensor. A
        # saved input is packed *before* its op runs, so if the last save holds only inputs the op
        # itself is not re-run. A selective block caches heavy outputs up to that point only.
        self.cache_end = [self.stop_after(node.first_event, node.last_event) for node in trace.nodes]
        self.block_weights = block_weights(trace, self.parent, self.first, self.last, dead)
        # blocks none of whose ops packs anything for a backward: a checkpoint there keeps nothing
        packs = [
            bool(saves or resident)
            for saves, resident in zip(trace.event_saves, trace.event_resident_saves, strict=True)
        ]
        self.packs_nothing = [
            not any(packs[first : last + 1]) if first >= 0 else True
            for first, last in zip(self.first, self.last, strict=True)
        ]
        self.is_activation = trace.storage_is_activation
        self.sizes = trace.storage_bytes
        # what the forward makes that it counts (activations), and what each event's backward
        # reads, bound into one tuple per event: the simulation's loops run for every event of every
        # plan the solver tries, and one lookup there replaces a dozen
        self.activation_outputs = [
            tuple(sid for sid in outputs if self.is_activation[sid]) for outputs in trace.event_outputs
        ]
        self.backward_facts = [
            BackwardFacts(
                outputs=trace.event_outputs[event],
                inputs=trace.event_inputs[event],
                workspace=trace.event_workspace[event],
                partial_grads=self.partial_grads[event],
                is_view_op=self.is_view_op[event],
                noted=event in noted,
                slices_grad=trace.event_traits[event].hand_off is GradientHandOff.SLICES,
                aliases_grad=trace.event_traits[event].hand_off is GradientHandOff.ALIASES,
                needs_contiguous_grad=trace.event_traits[event].contiguous_grad,
                passes_grad=trace.event_traits[event].passes_grad,
                grads_created=self.grads_created[event],
                grads_accumulated=self.grads_accumulated[event],
                grads_freed=self.grads_freed[event],
            )
            for event in range(n_events)
        ]
        # Events at which a simulation does nothing but tick its clock (views and other ops that
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
            not (f.partial_grads or f.is_view_op or f.noted or f.grads_created or f.grads_accumulated or f.grads_freed)
            and not (f.workspace or f.needs_contiguous_grad or trace.event_saves[e])
            for e, f in enumerate(self.backward_facts)
        ]
        # outside any recomputation, a dead op whose saves went in the forward has no backward
        released = {e for events in self.dead_release_at.values() for e in events}
        self.top_backward_idle = [idle or e in released for e, idle in enumerate(self.backward_idle)]

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
        outside = producer < lo or producer > hi
        if outside or not trace.event_traits[producer].recomputable or trace.storage_written[sid]:
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
            if saves or trace.event_resident_saves[event]:  # a parameter's pack counts too
                outputs = set(trace.event_outputs[event])
                return event if any(s in outputs for s in saves) else event - 1
        return first - 1

    def cache_limit(self, node: int) -> int:
        """Heavy ops a selective checkpoint of ``node`` caches (see ``cache_end``)."""
        trace = self.trace
        first = trace.nodes[node].first_event
        return sum(self.heavy[e] for e in range(first, self.cache_end[node] + 1))
