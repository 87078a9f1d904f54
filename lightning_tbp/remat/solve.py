"""Choose a per-block option (keep / selective / full, nested) minimising recomputation under a budget.

The peak of a training step is a maximum over time of sums of live tensors, so the problem is not
a knapsack: freeing bytes that are not live at the peak buys nothing. The solver therefore works
from the simulation itself:

1. Simulate the current plan, take the instant of the peak and list who holds each live storage.
2. For every legal move (keep->selective, keep->full, selective->full) estimate the bytes it frees
   *at that instant* and its extra recomputation cost; rank by bytes per cost.
3. Simulate the best few candidates exactly and apply the one with the best real peak reduction per
   cost (on a plateau, where none of them lowers the peak, a few more are tried first). Repeat
   until the peak fits the budget.
4. Prune: undo or soften moves (most expensive first) that the final plan does not need.
5. Refine the winner: split a coarse decision into the same option on its child blocks, prune
   again, keep it if cheaper (pruning alone cannot make a whole-stage decision finer); then
   trade each planned block's option for the cheapest one that still fits.

A step made of calls that repeat (an unrolled chain) is searched with each block's calls moved
together, and its last calls are planned apart after (``repeats.py``, ``Solver.untie``).

Greedy descent is path dependent, so a small portfolio competes: the greedy path from the plain
model recorded at a few slightly tighter targets, and a start from a Lagrangian tree knapsack
(each option priced by one exact simulation, cost - lambda * bytes freed, over a sweep of lambda)
repaired by the greedy. The cheapest candidates are pruned against the real target
and the cheapest result wins.

Full checkpoints may nest (a stage checkpointed around checkpointed blocks: "height-compressed"
plans, whose held memory grows with the depth of the module tree, not its length); selective
checkpointing is only placed where no ancestor is checkpointed, because torch keeps a selective
region's cache alive for the whole outer region.

If no plan fits, :class:`InfeasibleBudgetError` names the smallest peak the search reached.

What the searches read of each block (its subtree, option prices, the bytes a checkpoint of it
would release at an instant) is ``block_tree.py``; the Lagrangian start's plans ``lagrangian.py``.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Set
from dataclasses import dataclass

from lightning_tbp.remat.block_tree import BlockTree
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.remat.folding import FoldedChain, fold_chain
from lightning_tbp.remat.lagrangian import Prices, lagrangian_plans, singleton_prices
from lightning_tbp.remat.options import KEEPS_SOME, SOFT, Option, clears_soft_below, next_options
from lightning_tbp.remat.repeats import repeated_at_least, repeated_calls
from lightning_tbp.remat.simulate import Holdings, SimResult, Simulator

_EXACT_CANDIDATES = 4
#: When none of the first candidates lowers the peak (it sits on a plateau: several instants at
#: the same height), this many are simulated before the best of them is taken anyway.
_EXACT_CANDIDATES_ON_A_PLATEAU = 16
_MAX_STALLED_MOVES = 3
#: Targets (fractions of the real one) whose plans compete; see ``Solver._solve``.
_TARGET_PORTFOLIO = (1.0, 0.96, 0.92, 0.88)
_PRUNED_CANDIDATES = 3
_MAX_PRUNE_PASSES = 4
#: Above this many blocks, the greedy applies moves in batches and only the cheapest candidate is
#: pruned, in one pass (planning stays within seconds for hundreds of blocks).
_LARGE_MODEL_NODES = 64
#: How many of each repeated block's calls, the last ones, ``Solver.untie`` plans again untied.
_UNTIED_CALLS = 2
#: How much cheaper than a descent's plan pruning may leave it (seen: 1-3% on chains of 8 calls):
#: ``Solver.untie`` stops a descent once its plan costs this much more than the best found.
_PRUNING_ROOM = 0.1
#: Targets above the real one (as fractions of it, added) at which the tied search's plans are
#: kept for ``Solver.untie`` to finish in the last calls.
_NEAR = (0.06, 0.03)
#: The solver plans to (1 - PLANNING_MARGIN) of the budget: the simulator predicts measured CPU
#: allocator peaks within a few percent, and the budget is a promise about the measured peak.
PLANNING_MARGIN = 0.05


def budget_for_peak(peak_bytes: int) -> int:
    """The smallest budget a plan predicted to peak at ``peak_bytes`` is chosen for (the margin added)."""
    return math.ceil(peak_bytes / (1 - PLANNING_MARGIN) if peak_bytes >= 0 else peak_bytes / (1 + PLANNING_MARGIN))


def planning_target(budget_bytes: int) -> int:
    """What a plan for ``budget_bytes`` must peak under: the margin taken off. A budget below zero
    (the device holds less than the parameters as loaded: streamed weights make room) keeps its
    margin below it too."""
    return int(budget_bytes - PLANNING_MARGIN * abs(budget_bytes))


class InfeasibleBudgetError(ValueError):
    """The memory budget is below the smallest peak any plan reaches.

    Its message advises a budget that, passed back, plans: a fraction of the naive peak, and in
    bytes the device's total, :attr:`minimum_budget_bytes` (the step's own minimum,
    :attr:`minimum_step_bytes`, and what training holds outside the step, once that is known)."""

    def __init__(self, budget_bytes: int, minimum_peak_bytes: int, naive_bytes: int, host_bytes: int = 0) -> None:
        """``host_bytes``: what the lowest plan keeps on the host tier (0: nothing)."""
        minimum = budget_for_peak(minimum_peak_bytes)
        # in the step's frame: above what training holds outside it
        self.budget_bytes, self.minimum_step_bytes, self.naive_bytes = budget_bytes, minimum, naive_bytes
        self.minimum_peak_bytes, self.host_bytes = minimum_peak_bytes, host_bytes
        self.minimum_device_bytes: int | None = None
        """The device's total that fits: the step's minimum and what training holds outside it
        (with whatever the plan took to lower that); None until that is known."""
        self._message: str | None = None
        super().__init__(budget_bytes, minimum_peak_bytes, naive_bytes, host_bytes)

    def freeze_message(self) -> None:
        """Keep the message as it reads now, whatever the figures are changed to later."""
        self._message = str(self)

    @property
    def minimum_budget_bytes(self) -> int:
        """The least ``memory_budget`` in bytes that plans: the device's total where what training
        holds outside the step is known (:attr:`minimum_device_bytes`), else the step's minimum."""
        return self.minimum_step_bytes if self.minimum_device_bytes is None else self.minimum_device_bytes

    @property
    def held_bytes(self) -> int:
        """What training holds outside the step, as the advised device total counts it (0: unknown)."""
        return self.minimum_budget_bytes - self.minimum_step_bytes

    @property
    def advised_fraction(self) -> float:
        """The fractional budget the message advises (rounded up to three places)."""
        return math.ceil(self.minimum_step_bytes / self.naive_bytes * 1000) / 1000

    def __str__(self) -> str:
        if self._message is not None:
            return self._message
        budget = (
            f"memory budget {format_bytes(self.budget_bytes)}"
            if self.budget_bytes >= 0
            else "memory budget (none left for the step: see below)"
        )
        host = f", keeping {format_bytes(self.host_bytes)} on the host tier" if self.host_bytes else ""
        minimum, naive = self.minimum_step_bytes, self.naive_bytes
        device = "" if self.minimum_device_bytes is None else ", the device's total"
        lowest = format_bytes(self.minimum_peak_bytes)
        fraction = (
            f"or >= {self.advised_fraction:.3f} (fraction)"
            if self.advised_fraction <= 1
            else "(no fraction of the naive peak reaches it: a fraction is at most 1)"
        )
        return (
            f"{budget} is below the minimum feasible budget {format_bytes(minimum)} ({minimum / naive:.3f} of the "
            f"naive peak {format_bytes(naive)}; the lowest plan peaks at {lowest}{host}, plus a "
            f"{PLANNING_MARGIN:.0%} margin); pass memory_budget >= {self.minimum_budget_bytes} (bytes{device}) "
            + fraction
        )


#: The most times slower than the unplanned step a plan may be predicted to run by default: a
#: tenth of the speed is where users of hand-set block swap report a fine-tune no longer usable.
DEFAULT_MAX_SLOWDOWN = 10.0


def check_max_slowdown(max_slowdown: object) -> None:
    """Refuse a ``max_slowdown`` that is not a factor >= 1 or None, by name."""
    if max_slowdown is not None and (
        isinstance(max_slowdown, bool) or not isinstance(max_slowdown, int | float) or not max_slowdown >= 1
    ):
        raise ValueError(f"max_slowdown must be a factor >= 1 or None, got {max_slowdown!r}")


class StallingPlanError(ValueError):
    """The plan that meets the memory budget is predicted to run the step more than
    ``max_slowdown`` times slower than without a plan (host transfers that would stall it)."""

    def __init__(
        self, budget_bytes: int, slowdown: float, max_slowdown: float, parts: dict[str, float], unplanned_ns: float
    ) -> None:
        self.budget_bytes, self.slowdown, self.max_slowdown, self.parts = budget_bytes, slowdown, max_slowdown, parts
        what = ", ".join(f"{name} {ns / 1e6:.1f} ms" for name, ns in parts.items() if ns > 0)
        super().__init__(
            f"the plan that meets the memory budget {format_bytes(budget_bytes)} is predicted to run the step "
            f"{slowdown:.1f}x slower than without a plan ({unplanned_ns / 1e6:.1f} ms, plus {what}), above "
            f"max_slowdown={max_slowdown:g}: it would stall on what it moves and recomputes rather than train. "
            "Give it a larger budget (or a device whose link to the host is faster), or pass a larger "
            "max_slowdown (None: no limit) to run it anyway"
        )


@dataclass
class Solution:
    options: list[Option]
    result: SimResult
    naive: SimResult
    solve_seconds: float
    simulations: int


class Solver:
    """Greedy, simulation-guided search over nested checkpoint plans for one trace."""

    def __init__(
        self,
        simulator: Simulator,
        *,
        selective: bool = True,
        offload: bool = False,
        stream: bool = False,
        tie_repeats: bool = True,
        fold_chains: bool = True,
    ) -> None:
        """``selective=False`` leaves selective blocks out of every plan: torch's selective
        checkpoint hands its cached outputs to the first backward only, so a graph that is
        backpropagated twice (DP's ghost and flash modes) cannot use them. ``offload=True`` lets
        plans offload blocks' saved activations to host memory (``host_tier.py``), and
        ``stream=True`` stream blocks' frozen weights from it (``host_weights.py``). ``tie_repeats=False`` searches each
        call of a repeated block apart however long the chain (the reference the tied search is
        compared with); ``fold_chains=False`` searches a chain on its whole trace, not folded to
        four calls (``folding.py``)."""
        self.sim = simulator
        options = (Option.FULL, Option.SELECTIVE, Option.LAZY) if selective else (Option.FULL, Option.LAZY)
        self.options = (*options, *((Option.OFFLOAD,) if offload else ()), *((Option.STREAM,) if stream else ()))
        self.tree = BlockTree(simulator.trace, simulator.facts.block_weights)
        self.nodes = self.tree.nodes
        self.large = len(self.nodes) > _LARGE_MODEL_NODES  # batched moves, a smaller portfolio, one pruning pass
        self.subtree_end, self.ancestors = self.tree.subtree_end, self.tree.ancestors
        self.members = repeated_calls(simulator.trace)
        # a large step made of calls repeated more often than ``untie`` plans apart (an unrolled
        # chain) is searched with each block's calls moved together (``repeats.py``), then untied
        self.chained = tie_repeats and self.large and repeated_at_least(self.members, _UNTIED_CALLS + 1)
        self.tied = self.chained
        self._movable: frozenset[int] | None = None  # the blocks the searches may move (None: all)
        self.simulations = 0
        self._prices: Prices | None = None
        self._memo: dict[tuple[Option, ...], SimResult] = {}
        self._over: dict[tuple[Option, ...], int] = {}  # plans whose peak passes this many bytes
        self._naive: SimResult | None = None
        self._pinned: frozenset[int] = frozenset()  # blocks no plan may give an option
        # how many calls a block stands for (a folded chain's second call: it and those left out)
        self._calls_of: dict[int, int] = {}
        self.fold_chains = fold_chains
        self.lowest_found: tuple[list[Option], SimResult] | None = None  # set where no plan fits

    # -- public -----------------------------------------------------------------------------------
    def naive(self) -> SimResult:
        if self._naive is None:
            self._naive = self.simulate([Option.KEEP] * len(self.nodes))
        return self._naive

    def solve(self, budget_bytes: int) -> Solution:
        """Cheapest plan found whose predicted peak is within the budget less the margin."""
        target_bytes = planning_target(budget_bytes)
        folded = self._solve_folded(target_bytes, budget_bytes)
        return folded if folded is not None else self._solve(target_bytes, budget_bytes)

    @functools.cached_property
    def folded_solver(self) -> tuple[Solver, FoldedChain] | None:
        """A solver for the chain folded to four calls (``folding.py``): for a chained plain step
        (one backward pass, nothing around it) with no weights streamed; None otherwise."""
        sim = self.sim
        plain = len(sim.step.passes) == 1 and sim.effects is None
        if not (self.fold_chains and self.chained and plain and Option.STREAM not in self.options):
            return None
        folded = fold_chain(sim.trace)
        if folded is None:
            return None
        inner = Solver(
            Simulator(
                folded.trace, sim.step, sim.loss_bytes, sim.loop, sim.alongside, sim.host_budget_bytes, folded.fold
            ),
            selective=Option.SELECTIVE in self.options,
            offload=Option.OFFLOAD in self.options,
            fold_chains=False,
        )
        inner.large, inner.chained, inner.tied = self.large, True, True
        inner._pinned = folded.pinned
        fold = folded.fold
        inner._calls_of = {
            node.index: 1 + fold.omitted
            for node in folded.trace.nodes
            if fold.first_end < node.first_event <= fold.second_end
        }
        return inner, folded

    def _solve_folded(self, target_bytes: int, budget_bytes: int) -> Solution | None:
        """The search on the folded chain, its plan replayed on the whole step; None where the
        step does not fold or the replay passes the target (the search then runs on the whole)."""
        found = self.folded_solver
        if found is None:
            return None
        inner, folded = found
        start = time.perf_counter()
        try:
            options = inner._solve(target_bytes, budget_bytes).options
        except InfeasibleBudgetError:
            assert inner.lowest_found is not None
            lowest, reached = inner.lowest_found
            result = self.simulate([lowest[i] for i in folded.node_of])
            if result.peak_bytes != reached.peak_bytes:
                return None  # the fold did not stand for this plan: the whole step's search names the minimum
            raise InfeasibleBudgetError(
                budget_bytes, result.peak_bytes, self.naive().peak_bytes, result.host_peak_bytes
            ) from None
        options = [options[i] for i in folded.node_of]
        result = self.simulate(options)
        if result.peak_bytes > target_bytes:
            return None
        return Solution(
            options, result, self.naive(), time.perf_counter() - start, self.simulations + inner.simulations
        )

    def _solve(self, target_bytes: int, budget_bytes: int) -> Solution:
        try:
            return self._search(target_bytes, budget_bytes)
        finally:
            self.tied = self.chained

    def _search(self, target_bytes: int, budget_bytes: int) -> Solution:
        start = time.perf_counter()
        naive = self.naive()
        keep_all = [Option.KEEP] * len(self.nodes)
        if naive.peak_bytes <= target_bytes:  # the budget allows the unplanned step, margin included
            return Solution(keep_all, naive, naive, time.perf_counter() - start, self.simulations)
        # Greedy search is path dependent: a slightly tighter target can end cheaper. Plans made
        # for a few tighter targets all fit the real one; the cheapest after pruning wins.
        targets = [int(target_bytes - abs(target_bytes) * (1 - f)) for f in _TARGET_PORTFOLIO]  # tighter below zero too
        near: list[tuple[list[Option], SimResult]] = []
        if self.tied:  # tied plans a little above the target, for ``untie`` to finish in the last calls
            near = self.greedy_path(keep_all, naive, [int(target_bytes + abs(target_bytes) * f) for f in _NEAR])
        candidates = self.greedy_path(*(near[-1] if near else (keep_all, naive)), targets)
        # one Lagrangian start, for the real target: each costs a repair descent, and starts for
        # the tighter targets never gave the cheapest plan (66 solves of 11 architectures at
        # 0.3-0.9 of naive; earlier, an SDXL-style U-Net's at 0.29-0.5) for 10% of solve time
        if not self.tied:  # tied, its repair descent took half the solve; its plan never won on chains
            options, result = self.greedy(*self.lagrangian_start(naive, target_bytes), target_bytes)
            if result.peak_bytes <= target_bytes:
                candidates.append((options, result))
        candidates += [(o, r) for o, r in self.uniform_plans() if r.peak_bytes <= target_bytes]
        if not candidates:
            options, result = self.lowest(target_bytes)
            if result.peak_bytes > target_bytes:
                self.lowest_found = (options, result)
                raise InfeasibleBudgetError(budget_bytes, result.peak_bytes, naive.peak_bytes, result.host_peak_bytes)
            candidates.append((options, result))
        unique = {tuple(o): (o, r) for o, r in candidates}.values()
        keep = 1 if self.large else _PRUNED_CANDIDATES
        cheapest = sorted(unique, key=lambda c: c[1].recompute_cost)[:keep]
        pruned = [self.prune(o, r, target_bytes) for o, r in cheapest]
        options, result = self.refine(*min(pruned, key=lambda c: c[1].recompute_cost), target_bytes)
        options, result = self.trade(options, result, target_bytes)
        if self.tied:
            options, result = self.untie([*near, (options, result)], target_bytes)
        return Solution(options, result, naive, time.perf_counter() - start, self.simulations)

    def lowest(self, target_bytes: int) -> tuple[list[Option], SimResult]:
        """The cheapest plan under ``target_bytes`` that descents ranking moves by bytes alone
        find, else the lowest peak they reach.

        Measured op times vary from run to run and steer the cost-aware searches; these descents
        depend only on the (deterministic) memory model, so the minimum they name is reached again
        when the user retries with that budget. One descent is path dependent (a ControlNet
        stalled at 0.62 of naive from the plain model, while 0.47 is reachable), so one starts
        from the plain model and one from each of the two uniform plans with the lowest peaks,
        and the lowest wins. On the eleven zoo architectures, descents from every uniform plan
        reached no floor more than 0.05% below these three's; on an SDXL U-Net at 1024² (11k ops)
        a descent from the plain model costs ~10 s, from a low uniform plan 1-3 s.
        """
        uniform = sorted({tuple(o): (o, r) for o, r in self.uniform_plans()}.values(), key=lambda p: p[1].peak_bytes)
        starts = [([Option.KEEP] * len(self.nodes), self.naive()), *uniform[:2]]
        ends = [self.greedy(options, result, target_bytes, cost_blind=True) for options, result in starts]
        fitting = [end for end in ends if end[1].peak_bytes <= target_bytes]
        if fitting:
            return min(fitting, key=lambda end: end[1].recompute_cost)
        return min(ends, key=lambda end: end[1].peak_bytes)

    def uniform_plans(self) -> list[tuple[list[Option], SimResult]]:
        """Every block of a kind checkpointed in full, for each kind that repeats, and for the two
        commonest kinds together: what diffusers' ``enable_gradient_checkpointing()`` does, so a
        plan is never chosen that costs more than uniform checkpointing fitting the same budget."""
        kinds = Counter(node.kind for node in self.nodes[1:] if node.has_events)
        repeated = [kind for kind, count in kinds.most_common() if count > 1]
        groups = [[kind] for kind in repeated] + ([repeated[:2]] if len(repeated) > 1 else [])
        plans = []
        for group in groups:
            options = [Option.KEEP] * len(self.nodes)
            for node in self.nodes[1:]:
                if (
                    node.has_events
                    and node.index not in self._pinned
                    and node.kind in group
                    and all(options[a] == Option.KEEP for a in self.ancestors[node.index])
                ):
                    options[node.index] = Option.FULL
            plans.append((options, self.simulate(options)))
            if Option.STREAM in self.options:  # the same blocks streamed: "block swap" of every block
                streamed = [
                    Option.STREAM if o == Option.FULL and self.tree.stream_bytes[i] else o
                    for i, o in enumerate(options)
                ]
                if streamed != options:
                    plans.append((streamed, self.simulate(streamed)))
        return plans

    def greedy_path(
        self, options: list[Option], result: SimResult, targets: list[int]
    ) -> list[tuple[list[Option], SimResult]]:
        """One greedy descent; returns the first plan under each target it reaches."""
        found: list[tuple[list[Option], SimResult]] = []
        for target in sorted(targets, reverse=True):
            options, result = self.greedy(options, result, target)
            if result.peak_bytes > target:
                break
            found.append((options, result))
        return found

    def greedy(
        self,
        options: list[Option],
        result: SimResult,
        target_bytes: int,
        cost_blind: bool = False,
        cost_bound: float = math.inf,
    ) -> tuple[list[Option], SimResult]:
        """Apply the best move at the peak until the plan fits (or no move helps any more).

        A descent does not return to a plan it has been at: on a plateau of the peak a move and
        its reverse (a block lazy, then full, then lazy) would otherwise take turns until the
        stall limit. ``cost_blind`` ranks moves by bytes alone (the search for the lowest
        reachable peak). A descent whose plan costs more than ``cost_bound`` stops there (its
        moves only add cost: it cannot end cheaper than a plan already found)."""
        best = (result.peak_bytes, options, result)
        stalled = 0
        visited = {tuple(options)}
        while result.peak_bytes > target_bytes and stalled < _MAX_STALLED_MOVES and result.recompute_cost <= cost_bound:
            move = self.best_move(options, result, target_bytes, cost_blind, visited)
            if move is None:
                break
            options, result = move
            visited.add(tuple(options))
            stalled = stalled + 1 if result.peak_bytes >= best[0] else 0
            if result.peak_bytes < best[0]:
                best = (result.peak_bytes, options, result)
        return (options, result) if result.peak_bytes <= target_bytes else (best[1], best[2])

    def lagrangian_start(self, naive: SimResult, target_bytes: int) -> tuple[list[Option], SimResult]:
        """Cheapest plan of the Lagrangian sweep (``lagrangian.py``) that fits, else the sweep's
        lowest peak; every distinct plan of the sweep is simulated exactly."""
        if self._prices is None:
            holdings = self.holdings_at([Option.KEEP] * len(self.nodes), self.sim.trace.num_events - 1)
            self._prices = singleton_prices(self.tree, holdings, self.options)
        best: tuple[tuple[bool, float], list[Option], SimResult] | None = None
        for options in lagrangian_plans(self.tree, self._prices, self.options):
            if best is not None and not best[0][0]:  # once one fits, only those that fit compete
                result = self.simulate_within(options, target_bytes)
                if result is None:
                    continue
            else:
                result = self.simulate(options)
            fits = result.peak_bytes <= target_bytes
            rank = (not fits, result.recompute_cost if fits else result.peak_bytes)
            if best is None or rank < best[0]:
                best = (rank, options, result)
        assert best is not None
        return best[1], best[2]

    # -- search ---------------------------------------------------------------------------------
    def simulate(self, options: list[Option]) -> SimResult:
        """Replay a plan; the searches revisit plans often, so simulations are memoised."""
        key = tuple(options)
        result = self._memo.get(key)
        if result is None:
            self.simulations += 1
            result = self._memo[key] = self.sim.run(options)
        return result

    def holdings_at(self, options: list[Option], step: int) -> Holdings:
        """Who holds what at ``step`` of the plan's simulation (one that stops there)."""
        self.simulations += 1
        return self.sim.holdings_at(options, step)

    def simulate_within(self, options: list[Option], limit_bytes: int) -> SimResult | None:
        """The simulation of a plan if it peaks within ``limit_bytes``, else None (a bounded simulation
        stops where the memory passes the bound: the searches reject most plans they try)."""
        key = tuple(options)
        result = self._memo.get(key)
        if result is not None:
            return result if result.peak_bytes <= limit_bytes else None
        if self._over.get(key, -1) >= limit_bytes:  # known to pass a bound at least this low
            return None
        self.simulations += 1
        result = self.sim.run_within(options, limit_bytes)
        if result is None:
            self._over[key] = limit_bytes
        else:
            self._memo[key] = result
        return result

    def legal_moves(self, options: list[Option]) -> list[tuple[int, Option]]:
        moves = []
        for node in self.nodes[1:]:
            i = node.index
            if not node.has_events or (self.tied and self.members[i][0] != i):
                continue
            if (self._movable is not None and i not in self._movable) or i in self._pinned:
                continue
            checkpointed_above = not self._outermost(i, options)
            if any(options[a] in SOFT for a in self.ancestors[i]):
                continue  # a selective or lazy block keeps its subtree plain (see the module doc)
            plain_below = not self.subtree_planned(i, options)
            following = next_options(options[i], checkpointed_above=checkpointed_above, plain_below=plain_below)
            moves += [(i, option) for option in following]
        return [(index, option) for index, option in moves if self._offers(index, option)]

    def _offers(self, index: int, option: Option) -> bool:
        """Whether plans may give block ``index`` ``option``: one this solver allows, and streaming
        only where the block has frozen weights to stream (else it is a full checkpoint by another name)."""
        return option in self.options and (option != Option.STREAM or bool(self.tree.stream_bytes[index]))

    def _soft_options(self, index: int) -> list[Option]:
        return [option for option in SOFT if self._offers(index, option)]

    def subtree_planned(self, index: int, options: list[Option]) -> bool:
        return any(options[j] != Option.KEEP for j in range(index + 1, self.subtree_end[index]))

    def apply(self, options: list[Option], index: int, option: Option) -> list[Option]:
        """``options`` with ``option`` on block ``index`` (and on the calls tied to it)."""
        new = list(options)
        for member in self.tied_to(index):
            new[member] = option
            if clears_soft_below(option):
                for j in range(member + 1, self.subtree_end[member]):
                    if new[j] in SOFT:
                        new[j] = Option.KEEP
        return new

    def tied_to(self, index: int) -> list[int]:
        """The blocks a move on ``index`` moves: its repeated calls while the search is tied, else itself."""
        return self.members[index] if self.tied else [index]

    def untie(self, starts: list[tuple[list[Option], SimResult]], budget_bytes: int) -> tuple[list[Option], SimResult]:
        """Plan the last calls of each repeated block again, each call on its own, around tied
        plans of the calls before (``starts``: the tied winner, and tied plans a little above the
        target); the cheapest plan that fits wins (the winner itself, at worst).

        A chain's calls are undone last first, so an earlier call's saved tensors are live
        through every later call's backward and a later call's for less of it: the cheapest plan
        is graded, and the last call, whose backward is the peak, often best planned apart (an
        unrolled chain of four U-Net calls at a third of its naive peak checkpoints the whole
        U-Net in its first two calls only). From the winner the tail starts unplanned, from a plan
        above the target as it is (a little more on the last calls may be all it lacks); a
        descent and pruning over the tail alone fit the plan to the budget.
        """
        self.tied = False
        tail: set[int] = set()
        for index, group in enumerate(self.members):
            if len(group) > 1 and group[0] == index:  # each repeated block once
                for member in group[-_UNTIED_CALLS:]:
                    tail.update(range(member, self.subtree_end[member]))
        best = starts[-1]
        self._movable = frozenset(tail)
        # every plan tried from here differs only in the tail: the simulations share the rest
        split = min(self.sim.facts.first[i] for i in tail if self.nodes[i].has_events)
        try:
            with self.sim.sharing_prefix(split):
                # the winner first: the plan it ends at bounds the others' descents
                for options, result in reversed(starts):
                    # a plan that fits starts with its tail unplanned; one above the target as it is
                    start = (
                        [Option.KEEP if i in tail else o for i, o in enumerate(options)]
                        if result.peak_bytes <= budget_bytes
                        else options
                    )
                    bound = best[1].recompute_cost * (1 + _PRUNING_ROOM)
                    replanned = self.greedy(start, self.simulate(start), budget_bytes, cost_bound=bound)
                    if replanned[1].peak_bytes > budget_bytes:
                        continue
                    planned = frozenset(i for i in tail if replanned[0][i] != Option.KEEP)
                    replanned = self.prune(*replanned, budget_bytes, only=planned)
                    if replanned[1].recompute_cost < best[1].recompute_cost:
                        best = replanned
        finally:
            self._movable = None
        return best

    def best_move(
        self,
        options: list[Option],
        result: SimResult,
        target_bytes: int,
        cost_blind: bool = False,
        visited: Set[tuple[Option, ...]] = frozenset(),
    ) -> tuple[list[Option], SimResult] | None:
        holdings = self.holdings_at(options, result.peak_step)
        freed_full, lca = self.tree.releasable_bytes(holdings)
        scored = []
        for index, option in self.legal_moves(options):
            freed, extra = 0, 0.0
            for member in self.tied_to(index):
                calls = self._calls_of.get(member, 1)
                freed += calls * self._freed(member, option, options, freed_full, holdings, lca)
                extra += calls * (self.tree.cost_of(member, option) - self.tree.cost_of(member, options[member]))
            if freed <= 0:
                continue
            extra = 1.0 if cost_blind else extra
            scored.append((freed / max(extra, 1.0), index, option, freed))
        scored.sort(reverse=True)
        if self.large:
            # a cost-blind descent must not depend on its target either: the user who retries with
            # the minimum it named must be led down the same path (as if to the floor, target 0)
            deficit = result.peak_bytes - (0 if cost_blind else target_bytes)
            batched = self._batch_move(options, result, scored, deficit)
            if batched is not None:
                return batched
        best = None
        for rank, (_, index, option, _) in enumerate(scored):
            lowered = best is not None and best[0][0]
            if rank >= _EXACT_CANDIDATES_ON_A_PLATEAU or (rank >= _EXACT_CANDIDATES and lowered):
                break  # past the first few, only while none has lowered the peak (or all were visited)
            candidate = self.apply(options, index, option)
            if tuple(candidate) in visited:  # back to where the descent was: it would cycle
                continue
            if best is not None and best[0][0]:  # once one lowers the peak, only those that do compete
                trial = self.simulate_within(candidate, result.peak_bytes - 1)
                if trial is None:
                    continue
            else:
                trial = self.simulate(candidate)
            gain = result.peak_bytes - trial.peak_bytes
            extra = 1.0 if cost_blind else max(trial.recompute_cost - result.recompute_cost, 1.0)
            key = (gain > 0, gain / extra)
            if best is None or key > best[0]:
                best = (key, candidate, trial)
        return None if best is None else (best[1], best[2])

    def _freed(
        self, index: int, option: Option, options: list[Option], freed_full: list[int], holdings: Holdings, lca: dict
    ) -> int:
        """Estimated bytes ``option`` on block ``index`` frees at the instant ``holdings`` was read."""
        freed = freed_full[index] - self.tree.kept_inputs(index, holdings, lca)
        if option in KEEPS_SOME:
            freed -= self.tree.cache_bytes(index, holdings, lca)
        elif option == Option.STREAM:  # its weights leave the device, outside its own windows
            freed = self.tree.stream_bytes[index] + (0 if options[index] == Option.FULL else freed)
        return freed

    def _batch_move(self, options, result, scored, deficit) -> tuple[list[Option], SimResult] | None:
        """On large models, apply the best-ranked moves on disjoint subtrees together.

        They are taken until their estimated savings cover half the remaining deficit, so the
        descent needs a logarithmic rather than linear number of simulations; the exact one-move
        step remains the fallback when a batch does not lower the peak.
        """
        batch: list[int] = []
        candidate, covered = list(options), 0
        for _, index, option, freed in scored:
            if any(index in range(b, self.subtree_end[b]) or b in range(index, self.subtree_end[index]) for b in batch):
                continue
            candidate = self.apply(candidate, index, option)
            batch.append(index)
            covered += freed
            if covered >= deficit / 2:
                break
        if len(batch) < 2:
            return None
        trial = self.simulate_within(candidate, result.peak_bytes - 1)
        return None if trial is None else (candidate, trial)

    def refine(self, options: list[Option], result: SimResult, budget_bytes: int) -> tuple[list[Option], SimResult]:
        """Split coarse decisions the pruning cannot: a block checkpointed (or lazy) as a whole is
        replaced by the same option on each of its child blocks, which pruning may then undo one
        by one; kept if the pruned plan costs less. (A greedy path that took a whole decoder lazy
        early ends there, 2.5x the cost of the plan other paths find.) Each split prunes its
        children and the outermost planned blocks that cost as much as the cheapest of them (the
        rest of the plan was pruned before; a split can leave a weighty block elsewhere unneeded,
        since peaks are not monotonic in the options). Pruning all of the plan after each split
        made an unrolled chain of eight U-Net calls at half its naive peak spend 5,500
        simulations here, 61 s of its 74 s solve (now about 2,000)."""
        coarse = sorted(
            (
                i
                for i, o in enumerate(options)
                if o in (Option.FULL, Option.LAZY) and self._outermost(i, options) and self._leads(i)
            ),
            key=lambda i: self.tree.subtree_cost[i],
            reverse=True,
        )
        for index in coarse:
            children = [c for c in self.nodes[index].children if self.nodes[c].has_events]
            if len(children) < 2 or options[index] not in (Option.FULL, Option.LAZY):
                continue
            candidate = list(options)
            for member in self.tied_to(index):
                for child in self.nodes[member].children:
                    if self.nodes[child].has_events and candidate[child] == Option.KEEP:
                        candidate[child] = options[member]
                candidate[member] = Option.KEEP
            trial = self.simulate_within(candidate, budget_bytes)
            if trial is None:
                continue
            # the children, and the planned blocks above no other that cost as much as the cheapest child:
            # a split can leave one of those unneeded (peaks are not monotonic in the options)
            cheapest = min(self.tree.subtree_cost[c] for c in children)
            weighty = (
                i
                for i, o in enumerate(candidate)
                if o != Option.KEEP
                and self._outermost(i, candidate)
                and self._leads(i)
                and self.tree.subtree_cost[i] >= cheapest
            )
            pruned = self.prune(candidate, trial, budget_bytes, only=frozenset((*children, *weighty)))
            if pruned[1].recompute_cost < result.recompute_cost:
                options, result = pruned
        return options, result

    def trade(self, options: list[Option], result: SimResult, budget_bytes: int) -> tuple[list[Option], SimResult]:
        """Give each planned block, most expensive first, the cheapest option that still fits.

        Pruning only undoes a move or softens a full checkpoint, but which option costs least
        depends on the block once calibrated: a full checkpoint can cost less than a selective
        one. Run on the winner only, so it can only make the plan cheaper (on saved traces of
        the zoo at 0.3-0.8 of naive and at their floors, 14 of 69 plans 0.2-8.9% cheaper)."""

        def others(index: int, options: list[Option]) -> list[Option]:
            choices = [Option.KEEP, Option.FULL]
            if self._outermost(index, options):
                choices += self._soft_options(index)
            return [option for option in choices if option != options[index]]

        return self._sweep(options, result, budget_bytes, others, cheapest=True)

    def prune(
        self, options: list[Option], result: SimResult, budget_bytes: int, only: frozenset[int] | None = None
    ) -> tuple[list[Option], SimResult]:
        """Undo or soften moves the plan does not need, most expensive first (``only``: of these blocks)."""

        def softer(index: int, options: list[Option]) -> list[Option]:
            if options[index] == Option.FULL and self._outermost(index, options):
                return [Option.KEEP, *self._soft_options(index)]
            return [Option.KEEP]

        return self._sweep(options, result, budget_bytes, softer, cheapest=False, only=only)

    def _sweep(
        self,
        options: list[Option],
        result: SimResult,
        budget_bytes: int,
        alternatives: Callable[[int, list[Option]], list[Option]],
        cheapest: bool,
        only: frozenset[int] | None = None,
    ) -> tuple[list[Option], SimResult]:
        """Visit the planned blocks, most expensive first, and give each the first (or, with
        ``cheapest``, the cheapest) of its ``alternatives`` that fits and costs less; repeat
        while that changes the plan (one pass on large models)."""
        improved, passes = True, 1 if self.large else _MAX_PRUNE_PASSES
        while improved and passes > 0:
            improved, passes = False, passes - 1
            planned = sorted(
                (
                    i
                    for i, o in enumerate(options)
                    if o != Option.KEEP and self._leads(i) and (only is None or i in only)
                ),
                key=lambda i: self.tree.subtree_cost[i],
                reverse=True,
            )
            for index in planned:
                found: tuple[list[Option], SimResult] | None = None
                for option in alternatives(index, options):
                    candidate = list(options)
                    for member in self.tied_to(index):
                        candidate[member] = option
                    if option in SOFT and self.subtree_planned(index, candidate):
                        continue
                    trial = self.simulate_within(candidate, budget_bytes)
                    if trial is not None and trial.recompute_cost < (found or (options, result))[1].recompute_cost:
                        found = (candidate, trial)
                        if not cheapest:
                            break
                if found is not None:
                    (options, result), improved = found, True
        return options, result

    def _leads(self, index: int) -> bool:
        """Whether the searches visit block ``index``: all blocks, or while tied the first of its calls."""
        return not self.tied or self.members[index][0] == index

    def _outermost(self, index: int, options: list[Option]) -> bool:
        return not any(options[a] != Option.KEEP for a in self.ancestors[index])
