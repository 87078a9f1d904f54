"""An unrolled chain folded to four calls: the same step's memory and cost from a quarter of its events.

A chain of K equal calls (``x <- x - c * unet(x, t_i)``) is periodic: from its second call on,
every call runs the same ops on the same shapes, and a plan that gives a module's middle calls
one option each (the solver's tied search, ``repeats.py``) repeats with it. Under such a plan the
memory at an instant of call ``p``'s forward (or backward) is that of the same instant of call 2
plus ``(p - 2) * delta``, where ``delta`` is what one call leaves held for the backward: linear in
``p``, so its highest is at the second call or the last but one. A trace that keeps the first two
calls and the last two, with the others' held bytes added as one sum where they are left out
(``SimulatedStep``'s fold hooks) and their cost as that many times the second call's, reaches the
whole chain's peak and cost exactly, at ``4 / K`` of the simulation's work.

The fold is checked, not assumed: the calls must be equal op by op (the same traits, FLOPs,
workspaces and sizes, each tensor read from the same place relative to its call), every tensor a
middle call makes must go within the next call, and nothing after the left-out calls may read what
they or the second call made except the chain's carried state. A step that is not such a chain
is not folded. The solver plans on the folded trace, then replays the plan on the whole one
(``Solver``): what it reports is the whole step's simulation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from lightning_tbp.remat.repeats import repeated_calls
from lightning_tbp.remat.trace import Node, Trace

#: Calls kept: the first, the second (standing for every middle call), the last two.
_KEPT_CALLS = 4


@dataclass(frozen=True)
class ChainFold:
    """Where a folded trace's simulation adds the left-out calls: ``first_end`` and
    ``second_end`` are its last events of the first and the second call's span (each runs to the
    next call's first event); ``omitted``: how many calls were left out after the second."""

    first_end: int
    second_end: int
    omitted: int


@dataclass(frozen=True)
class FoldedChain:
    """A chain's trace with its middle calls left out. ``node_of``: per node of the whole trace,
    its node in the folded one (a left-out call's node: its counterpart in the second call);
    ``pinned``: folded nodes that span the fold, which plans must leave unplanned (the fold's
    hooks run in the top-level passes only)."""

    trace: Trace
    fold: ChainFold
    node_of: list[int]
    pinned: frozenset[int]


def fold_chain(trace: Trace) -> FoldedChain | None:
    """The trace folded to four calls of its longest chain of outermost equal calls, or None
    where it is no such chain (fewer than five calls, calls that differ, tensors living across
    several calls, or what the left-out calls made read after them)."""
    if trace.fsdp.spans:  # FSDP2 units' spans are not folded
        return None
    members = repeated_calls(trace, counting_inputs=True)
    chains = [
        group
        for index, group in enumerate(members)
        if index > 0
        and group[0] == index
        and len(group) > _KEPT_CALLS
        and (trace.nodes[index].parent <= 0 or len(members[trace.nodes[index].parent]) == 1)
    ]
    if not chains:
        return None
    calls = max(chains, key=len)
    starts = [trace.nodes[n].first_event for n in calls]
    period = starts[1] - starts[0]
    if period <= 0 or any(b - a != period for a, b in pairwise(starts)):
        return None
    return _Folder(trace, starts[0], period, len(calls)).fold()


class _Folder:
    """Checks a chain's periodicity and builds its folded trace (``fold_chain``)."""

    def __init__(self, trace: Trace, start: int, period: int, calls: int) -> None:
        self.trace, self.start, self.period, self.calls = trace, start, period, calls
        self.made_at: dict[int, tuple[int, int]] = {}  # storage -> (producer event, output position)
        for event, outputs in enumerate(trace.event_outputs):
            for position, sid in enumerate(outputs):
                self.made_at[sid] = (event, position)
        # periods 1..calls-1 run from their call's first event to the next call's; the last to the end
        self.chain_end = start + (calls - 1) * period  # first event of the last call
        self.gap = (start + 2 * period, start + (calls - 2) * period)  # left-out events [lo, hi)

    def call_of(self, event: int) -> int:
        """The chain call (from 1) whose span holds ``event``; 0 before the chain, ``calls`` from the last on."""
        if event < self.start:
            return 0
        return min(1 + (event - self.start) // self.period, self.calls)

    def made_in(self, sid: int) -> int:
        """The call (``call_of``) whose span made ``sid``; -1: made outside the step's ops."""
        made = self.made_at.get(sid)
        return -1 if made is None or not self.trace.storage_is_activation[sid] else self.call_of(made[0])

    def shifted(self, sid: int, calls: int) -> int | None:
        """The storage the same op made ``calls`` calls later (None: none)."""
        event, position = self.made_at[sid]
        target = event + calls * self.period
        outputs = self.trace.event_outputs[target] if 0 <= target < self.trace.num_events else ()
        return outputs[position] if position < len(outputs) else None

    def corresponds(self, sid: int, later: int) -> bool:
        """Whether ``later``, read one call after ``sid`` at the same place, is its counterpart:
        the same storage, or the one the same op made a call later where ``sid`` was made within
        a call's span of the chain's start or after it (the first call reads what the ops before
        it made as each later call reads what its predecessor's last ops made)."""
        if sid == later:
            return True
        made = self.made_at.get(sid)
        return (
            made is not None
            and self.trace.storage_is_activation[sid]
            and made[0] >= self.start - self.period
            and self.shifted(sid, 1) == later
        )

    def periodic(self) -> bool:
        """Whether calls 1..calls-1 run the same ops, reading and saving corresponding storages,
        and every storage a call makes goes (its last Python reference) within the next call."""
        trace = self.trace
        for event in range(self.start, self.chain_end - self.period):
            later = event + self.period
            if (
                trace.event_traits[event] != trace.event_traits[later]
                or trace.event_flops[event] != trace.event_flops[later]
                or trace.event_forward_workspace[event] != trace.event_forward_workspace[later]
                or trace.event_workspace[event] != trace.event_workspace[later]
                or trace.nodes[trace.event_node[event]].path != trace.nodes[trace.event_node[later]].path
                or len(trace.event_outputs[event]) != len(trace.event_outputs[later])
                or trace.event_resident_saves[event] != trace.event_resident_saves[later]
                or list(trace.event_partial_inputs[event].values()) != list(trace.event_partial_inputs[later].values())
            ):
                return False
            for mine, theirs in (
                (trace.event_inputs[event], trace.event_inputs[later]),
                (trace.event_saves[event], trace.event_saves[later]),
                (tuple(trace.event_partial_inputs[event]), tuple(trace.event_partial_inputs[later])),
            ):
                if len(mine) != len(theirs) or not all(map(self.corresponds, mine, theirs)):
                    return False
            for sid, other in zip(trace.event_outputs[event], trace.event_outputs[later], strict=True):
                death, other_death = trace.storage_death[sid], trace.storage_death[other]
                if (
                    trace.storage_bytes[sid] != trace.storage_bytes[other]
                    or trace.storage_needs_grad[sid] != trace.storage_needs_grad[other]
                    or trace.storage_written[sid] != trace.storage_written[other]
                    or death < 0
                    or not self.dies_alike(death, other_death)
                    or self.call_of(death) > self.call_of(event) + 1
                ):
                    return False
        return True

    def dies_alike(self, death: int, later_death: int) -> bool:
        """Whether a storage's counterpart a call later goes as it does, a call later; in the last
        call's span, which the folded trace keeps whole (a sampler's last step may run other
        ops), anywhere there."""
        expected = death + self.period
        return later_death >= self.chain_end if expected >= self.chain_end else later_death == expected

    def carried(self, sid: int) -> int | None:
        """What a read after the fold of ``sid`` becomes in the folded trace (None: the fold
        cannot stand for it): the last left-out call's storages become the second call's."""
        made = self.made_in(sid)
        if made < 2 or made >= self.calls - 1:
            return sid
        if made == self.calls - 2:
            return self.shifted(sid, -(self.calls - 4))
        return None

    def fold(self) -> FoldedChain | None:
        trace = self.trace
        if self.calls <= _KEPT_CALLS or trace.step_notes or not self.periodic():
            return None
        lo, hi = self.gap
        omitted = self.calls - _KEPT_CALLS
        shift = hi - lo

        def new_event(event: int) -> int:
            return event if event < lo or event < 0 else event - shift

        remap: dict[int, int] = {}
        reads_after = [
            sid
            for event in range(hi, trace.num_events)
            for sid in (*trace.event_inputs[event], *trace.event_saves[event], *trace.event_partial_inputs[event])
        ]
        reads_after += [s for n in trace.nodes if n.first_event >= hi for s in (*n.inputs, *n.outputs)]
        reads_after += trace.module_outputs
        for sid in set(reads_after):
            carried = self.carried(sid)
            if carried is None:
                return None
            if carried != sid:
                remap[sid] = carried
        if len(set(remap.values())) != len(remap):
            return None  # the second call's own storage would stand for two

        folded = copy.copy(trace)
        kept = [e for e in range(trace.num_events) if not lo <= e < hi]
        folded.event_node = [trace.event_node[e] for e in kept]  # renumbered below
        folded.event_inputs = [tuple(remap.get(s, s) for s in trace.event_inputs[e]) for e in kept]
        folded.event_partial_inputs = [
            {remap.get(s, s): n for s, n in trace.event_partial_inputs[e].items()} for e in kept
        ]
        folded.event_outputs = [trace.event_outputs[e] for e in kept]
        folded.event_saves = [[remap.get(s, s) for s in trace.event_saves[e]] for e in kept]
        folded.event_resident_saves = [list(trace.event_resident_saves[e]) for e in kept]
        for name in ("event_traits", "event_flops", "event_cost", "event_backward_cost"):
            setattr(folded, name, [getattr(trace, name)[e] for e in kept])
        for name in ("event_forward_workspace", "event_workspace"):
            setattr(folded, name, [getattr(trace, name)[e] for e in kept])
        folded.storage_producer = list(trace.storage_producer)
        folded.storage_death = list(trace.storage_death)
        folded.storage_needs_grad = list(trace.storage_needs_grad)
        for sid, (event, _) in self.made_at.items():
            if lo <= event < hi:  # made by a left-out call: never made in the folded trace
                folded.storage_producer[sid], folded.storage_death[sid] = -1, -1
                folded.storage_needs_grad[sid] = False
            else:
                folded.storage_producer[sid] = new_event(event)
        for sid, death in enumerate(trace.storage_death):
            made = self.made_at.get(sid, (-1, 0))[0]
            if death < 0 or not trace.storage_is_activation[sid] or lo <= made < hi:
                continue
            if lo <= death < hi:  # the second call's, going in the third: it lives as the last left-out call's
                counterpart = self.shifted(sid, omitted) if self.made_in(sid) == 2 else None
                death = trace.storage_death[counterpart] if counterpart is not None else -1
                if not death >= hi:
                    return None  # something made outside the calls left out went inside them
            folded.storage_death[sid] = new_event(death)
        folded.module_outputs = tuple(remap.get(s, s) for s in trace.module_outputs)
        node_of, nodes = self._nodes(new_event, remap, lo, hi)
        if nodes is None:
            return None
        folded.nodes = nodes
        index_of = {n.index: i for i, n in enumerate(nodes)}  # (set by _nodes: the old index)
        for i, node in enumerate(nodes):
            node.index, node.parent = i, index_of.get(node.parent, -1)
            node.children = [index_of[c] for c in node.children if c in index_of]
        folded.event_node = [index_of[n] for n in folded.event_node]
        full_to_folded = [index_of[n] for n in node_of]
        pinned = frozenset(i for i, n in enumerate(nodes) if 0 <= n.first_event < lo <= n.last_event)
        return FoldedChain(
            trace=folded,
            fold=ChainFold(
                first_end=new_event(self.start + self.period - 1), second_end=new_event(lo - 1), omitted=omitted
            ),
            node_of=full_to_folded,
            pinned=pinned,
        )

    def _nodes(
        self, new_event: Callable[[int], int], remap: dict[int, int], lo: int, hi: int
    ) -> tuple[list[int], list[Node] | None]:
        """The folded trace's nodes (carrying their old index until renumbered) and, per old
        node, the old node standing for it: a left-out call's node its counterpart in the second
        call, a node without ops inside one the root (it is never planned)."""
        trace = self.trace
        by_start = {(n.path, n.first_event): n.index for n in trace.nodes}
        node_of: list[int] = []
        nodes: list[Node] = []
        dropped: set[int] = set()
        for node in trace.nodes:
            if node.has_events and lo <= node.first_event < hi:
                calls_back = self.call_of(node.first_event) - 2
                counterpart = by_start.get((node.path, node.first_event - calls_back * self.period))
                if counterpart is None or node.last_event >= hi:
                    return node_of, None
                node_of.append(counterpart)
                dropped.add(node.index)
                continue
            if node.parent in dropped:
                node_of.append(0)
                dropped.add(node.index)
                continue
            if node.has_events and node.first_event < lo <= node.last_event < hi:
                return node_of, None  # a block that ends among the left-out calls
            node_of.append(node.index)
            folded = copy.copy(node)
            if node.has_events:
                folded.first_event = new_event(node.first_event)
                folded.last_event = new_event(node.last_event)
            folded.inputs = tuple(remap.get(s, s) for s in node.inputs)
            folded.outputs = tuple(remap.get(s, s) for s in node.outputs)
            folded.children = list(node.children)
            nodes.append(folded)
        return node_of, nodes
