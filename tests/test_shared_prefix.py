"""Simulations that share a prefix (``shared_prefix.py``) give the results of whole ones, field by
field, for any plans, any split, the training loop's cases and bounded or capturing runs; and the
search over an unrolled chain's last calls, which uses them, finds the plan it finds without."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import chain_trace

from lightning_tbp.remat.options import Option
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import Solver
from lightning_tbp.remat.step import LoopModel, PriorGradients

LOOPS = {
    "plain": LoopModel(),
    "last_gradients_and_a_step": LoopModel(
        gradients=frozenset({PriorGradients.RELEASED, PriorGradients.UNTIL_BACKWARD}), optimizer_step_bytes=64 * 2**20
    ),
    "accumulating": LoopModel(gradients=frozenset({PriorGradients.RELEASED, PriorGradients.ACCUMULATED})),
    "step_in_backward": LoopModel().with_step_in_backward(0.5),
}


@pytest.fixture(scope="module")
def trace():
    return chain_trace(3)


def _walk(solver: Solver, options: list[Option], moves: int, rng: random.Random) -> list[Option]:
    """A plan reached by ``moves`` legal moves drawn from ``options`` (on the solver's movable blocks)."""
    for _ in range(moves):
        legal = solver.legal_moves(options)
        if not legal:
            break
        options = solver.apply(options, *rng.choice(legal))
    return options


@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), loop=st.sampled_from(sorted(LOOPS)), where=st.floats(0.05, 0.95))
def test_a_shared_prefix_simulates_every_plan_as_a_whole_simulation_does(trace, seed, loop, where) -> None:
    """Plans that agree before a drawn event: each simulated with the prefix shared (the first
    of them fills it, the others resume from it and take its rest where their state matches)
    equals its whole simulation: the result, a run stopped at a bound, and who holds what at a
    step before its peak."""
    rng = random.Random(seed)
    whole = Simulator(trace, loss_bytes=4096, loop=LOOPS[loop])
    sharing = Simulator(trace, loss_bytes=4096, loop=LOOPS[loop])
    solver = Solver(whole, tie_repeats=False)
    starts = [node.first_event for node in trace.nodes[1:] if node.has_events]
    split = sorted(starts)[int(where * len(starts))]
    prefix = _walk(solver, [Option.KEEP] * len(trace.nodes), 6, rng)
    solver._movable = frozenset(n.index for n in trace.nodes[1:] if n.has_events and n.first_event >= split)
    later = [i for i in solver._movable]
    plans = [[Option.KEEP if i in later else o for i, o in enumerate(prefix)] for _ in range(5)]
    plans = [_walk(solver, plan, rng.randrange(0, 8), rng) for plan in plans]
    plans.append(plans[0])  # the same plan again: every part of it shared
    with sharing.sharing_prefix(split) as shared:
        for plan in plans:
            expected = whole.run(plan)
            assert sharing.run(plan) == expected
            limit = int(expected.peak_bytes * rng.uniform(0.8, 1.2))
            assert sharing.run_within(plan, limit) == whole.run_within(plan, limit)
            step = rng.randrange(0, expected.peak_step + 1)
            assert sharing.holdings_at(plan, step) == whole.holdings_at(plan, step)
    assert shared.key(plans[-1]) is None or shared.hits > 0  # the repeated plan's rest, at least, was taken


def test_the_search_over_a_chains_last_calls_shares_their_prefix_and_finds_the_same_plan(
    shared_prefixes, monkeypatch
) -> None:
    trace = chain_trace(8)
    shared = Solver(Simulator(trace))
    budget = int(shared.naive().peak_bytes * 0.2)
    with_sharing = shared.solve(budget)
    monkeypatch.undo()

    @contextmanager
    def not_shared(self: Simulator, split: int) -> Iterator[None]:
        yield None

    monkeypatch.setattr(Simulator, "sharing_prefix", not_shared)
    without = Solver(Simulator(trace)).solve(budget)
    used = shared_prefixes
    assert shared.chained and len(used) == 1
    assert with_sharing.options == without.options and with_sharing.result == without.result
    assert with_sharing.simulations == without.simulations
    # nearly every plan tried on the last calls took the rest of the step from an earlier one
    assert used[0].hits >= 4 * used[0].misses, (used[0].hits, used[0].misses)


def test_a_rest_is_taken_only_from_a_state_equal_in_what_the_rest_reads(trace) -> None:
    simulator = Simulator(trace)
    plan = [Option.KEEP] * len(trace.nodes)
    last_call = max(node.first_event for node in trace.nodes if node.path == "denoiser")
    with simulator.sharing_prefix(last_call) as shared:
        expected = simulator.run(plan)
        assert simulator.run(plan) == expected and (shared.hits, shared.misses) == (1, 1)
        ((state, _),) = shared.rests[shared.key(plan)]
        state["alive"] = set(list(state["alive"])[1:])  # as if one storage had been freed before the split
        assert simulator.run(plan) == expected and (shared.hits, shared.misses) == (1, 2)
