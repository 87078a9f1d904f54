"""Simulations of plans that differ only in blocks after one event share the rest of the step.

An unrolled chain's last calls are planned apart at the end of the search (``Solver.untie``):
every plan tried there differs from the others only in the blocks of the last calls, yet each
simulation replays the whole chain. The ledger is deterministic, so two plans that agree on
every block starting before an event ``split`` (the *prefix*) reach that event of the forward
in the same state; and the backward of the events before ``split`` runs last, from whatever
state the backward of the later events left. That state is the same wherever the later blocks'
plans differ only in what they recompute and when they free it, which is the common case: once
the last calls' backward is done, what they saved is gone and only the gradient they hand on
remains.

So a simulation with a shared prefix restores the forward's state at ``split`` from the first
simulation of that prefix, and, after the backward of the events from ``split`` on, compares its
state with the states earlier simulations of the prefix reached there. Where one is equal in
every field the rest of the step reads, the rest of the step is that simulation's: its peak,
costs and recomputations are taken from it instead of replayed. Nothing is approximated: a state
that differs in any field replays the rest (and becomes a candidate for later ones), and the
results are equal, field by field, to a simulation without sharing (``test_shared_prefix.py``).

Only the plain single-pass step shares (a step model's effects keep state of their own), and
only a plan without streamed blocks (their weights' bytes count from the step's start) and
without a checkpoint around ``split`` (its backward is one recompute that cannot be cut there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_tbp.remat.options import CHECKPOINTS, Option
from lightning_tbp.remat.trace_facts import TraceFacts

#: Fields of the simulated step a restored state does not carry: the plan and what is derived
#: from it (memoised per plan, or set up from the whole plan before the forward), the limits of
#: this simulation, and the read-only trace.
PLAN_FIELDS = frozenset(
    {
        "facts",
        "trace",
        "options",
        "contexts",
        "lazy_blocks",
        "offload_blocks",
        "nested_starts",
        "limit_bytes",
        "capture_step",
        "host_limit_bytes",
        "streams",
    }
)
#: Fields a state compared at the split does not include: the running results, which the rest
#: of the step only adds to (and which are kept apart while it runs), the step counter and
#: storage table (the last calls' recomputations number their steps and storages differently;
#: the storages still alive are compared by size, ``fingerprint``), what the forward alone
#: left behind for the result, and the per-simulation effects object.
RESULT_FIELDS = frozenset(
    {
        "peak",
        "peak_step",
        "step",
        "case_peaks",
        "host_peak",
        "recompute_cost",
        "recompute_flops",
        "recompute_counts",
        "storage_sizes",
        "loss_steps",
        "forward_end",
        "optimizer_step",
        "effects",
        "rebuilds",
    }
)
#: Snapshots and outcomes kept per shared prefix: a search moves from plan to plan, rarely back.
_KEPT = 8


@dataclass(frozen=True)
class RestOfStep:
    """What the rest of a step (from the backward at ``split`` to the step's end) did: its own
    peak and per-case peaks, the step (counted from the split) of its peak and of the optimizer
    step (-1: none), its costs and recomputations. Nothing about the host tier: blocks offload
    in the top-level forward only, so the rest adds nothing there."""

    peak: int
    peak_offset: int
    case_peaks: dict[Any, int]
    recompute_cost: float
    recompute_flops: int
    recompute_counts: dict[int, int]
    optimizer_offset: int


def copied(value: Any) -> Any:
    """A copy of one field deep enough that the simulation's in-place edits do not reach it."""
    if isinstance(value, set):
        return value.copy()
    if isinstance(value, list):
        return value[:]
    if isinstance(value, dict):
        return {k: v[:] if isinstance(v, list) else v for k, v in value.items()}
    return value


def snapshot(fields: dict[str, Any]) -> dict[str, Any]:
    """The state a later simulation of the same prefix resumes from."""
    return {name: copied(value) for name, value in fields.items() if name not in PLAN_FIELDS}


def fingerprint(fields: dict[str, Any], split: int) -> dict[str, Any]:
    """What the rest of the step reads of the state at ``split``: every field but the plan's and
    the running results, with the storages alive that the simulation made (recomputed copies,
    stashes) by size, lazy rebuilds only of the events still to be backpropagated, and only the
    storages something holds."""
    kept = {name: value for name, value in fields.items() if name not in PLAN_FIELDS and name not in RESULT_FIELDS}
    sizes, made = fields["storage_sizes"], len(fields["facts"].sizes)
    kept["made_alive"] = sorted(sizes[sid] for sid in fields["alive"] if sid >= made)
    kept["rebuilds"] = {event: v for event, v in fields["rebuilds"].items() if event < split}
    kept["holders"] = {sid: count for sid, count in fields["holders"].items() if count}  # released ones stay at 0
    return kept


class SharedPrefix:
    """The snapshots and rest-of-step outcomes of the plans simulated with a prefix ending at
    event ``split``; ``hits`` counts the rests taken instead of replayed, ``misses`` those replayed."""

    def __init__(self, facts: TraceFacts, split: int) -> None:
        self.split = split
        first, last = facts.first, facts.last
        self.before = [node for node in range(len(first)) if first[node] < split]
        self.around = [node for node in self.before if last[node] >= split]
        self.snapshots: OrderedDict[tuple[Option, ...], dict[str, Any]] = OrderedDict()
        self.rests: OrderedDict[tuple[Option, ...], list[tuple[dict[str, Any], RestOfStep]]] = OrderedDict()
        self.hits = self.misses = 0

    def key(self, options: Sequence[Option]) -> tuple[Option, ...] | None:
        """The plan's prefix, or None where the plan cannot share it (see the module doc)."""
        if Option.STREAM in options or any(options[node] in CHECKPOINTS for node in self.around):
            return None
        return tuple(options[node] for node in self.before)

    def resume_state(self, key: tuple[Option, ...]) -> dict[str, Any] | None:
        state = self.snapshots.get(key)
        if state is not None:
            self.snapshots.move_to_end(key)
        return state

    def keep_state(self, key: tuple[Option, ...], state: dict[str, Any]) -> None:
        self.snapshots[key] = state
        if len(self.snapshots) > _KEPT:
            self.snapshots.popitem(last=False)

    def rest(self, key: tuple[Option, ...], state: dict[str, Any]) -> RestOfStep | None:
        for seen, rest in self.rests.get(key, ()):
            if seen == state:
                self.hits += 1
                return rest
        self.misses += 1
        return None

    def keep_rest(self, key: tuple[Option, ...], state: dict[str, Any], rest: RestOfStep) -> None:
        """Keep ``state``: a ``fingerprint`` copied (``snapshot``) before the rest ran and edited it."""
        rests = self.rests.setdefault(key, [])
        self.rests.move_to_end(key)
        rests.insert(0, (state, rest))
        del rests[_KEPT:]
        if len(self.rests) > _KEPT:
            self.rests.popitem(last=False)
