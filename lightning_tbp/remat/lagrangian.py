"""The Lagrangian start of the solver's portfolio: plans from a tree knapsack over prices per byte.

Each block option is priced once, from one reading of what the plain model holds at the end of
its forward: its recomputation cost, and the bytes only that block holds less what the option
keeps. For a price ``lam`` per byte the module tree is then solved exactly for
``cost - lam * bytes freed`` (a full checkpoint makes its subtree's choices moot; a selective or
lazy one requires a plain subtree). The peak is not a sum, so these plans are only candidates:
the solver simulates each distinct one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from lightning_tbp.remat.block_tree import BlockTree
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.simulated_step import Holdings

#: Prices per byte swept, in cost units (nanoseconds) per byte.
LAMBDAS = tuple(10 ** (k / 8) for k in range(-40, 33))

Prices = dict[tuple[int, Option], tuple[float, float]]


def singleton_prices(tree: BlockTree, holdings: Holdings, options: Sequence[Option]) -> Prices:
    """(cost, bytes freed) of each of ``options`` on each block alone, from ``holdings`` read at
    the end of the plain model's forward."""
    freed_full, lca = tree.releasable_bytes(holdings)
    prices: Prices = {}
    for node in tree.nodes[1:]:
        if not node.has_events:
            continue
        full = freed_full[node.index] - tree.kept_inputs(node.index, holdings, lca)
        selective = full - tree.cache_bytes(node.index, holdings, lca)
        freed = {
            Option.FULL: full,
            Option.SELECTIVE: selective,
            Option.LAZY: selective,
            Option.OFFLOAD: full,
            Option.STREAM: full + tree.stream_bytes[node.index],
        }
        for option in options:
            if option == Option.STREAM and not tree.stream_bytes[node.index]:
                continue
            prices[node.index, option] = (tree.cost_of(node.index, option), freed[option])
    return prices


def lagrangian_plans(tree: BlockTree, prices: Prices, options: Sequence[Option]) -> Iterator[list[Option]]:
    """The distinct plans of the sweep over :data:`LAMBDAS`, cheapest price per byte first."""
    seen: set[tuple[Option, ...]] = set()
    for lam in LAMBDAS:
        plan = [Option.KEEP] * len(tree.nodes)
        _assign(tree, 0, lam, prices, options, plan)
        key = tuple(plan)
        if key not in seen:
            seen.add(key)
            yield plan


def _assign(
    tree: BlockTree, index: int, lam: float, prices: Prices, options: Sequence[Option], plan: list[Option]
) -> float:
    """Solve the subtree of ``index`` for ``cost - lam * freed``; writes ``plan``, returns the value."""
    value_keep = sum(_assign(tree, child, lam, prices, options, plan) for child in tree.nodes[index].children)
    if index == 0:
        return value_keep
    best_value, best_option = value_keep, Option.KEEP
    for option in options:
        if (index, option) in prices:
            cost, freed = prices[index, option]
            if cost - lam * freed < best_value:
                best_value, best_option = cost - lam * freed, option
    if best_option != Option.KEEP:
        for j in range(index + 1, tree.subtree_end[index]):
            plan[j] = Option.KEEP
    plan[index] = best_option
    return best_value
