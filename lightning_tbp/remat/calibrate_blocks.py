"""Plan options timed on the model itself: real block steps against the planner's estimate.

The planner prices an option from its ops' times and per-op overheads measured on toy chains
(``overheads.py``). Real blocks differ (longer recipe chains, more saved tensors, framework work
per module call), and on a CPU the difference decides between options. So after profiling, a few
representative blocks (the commonest block classes) run a real forward and backward, alone,
under each option and plainly, in interleaved rounds; the measured extra time over the estimate
gives each option's scale. Only one block's activations exist at a time, so this stays as
memory-safe as the profile; parameter gradients go through ``autograd.grad``, never ``.grad``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_tbp.compat import tree_flatten, tree_map
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.overheads import timed_ns
from lightning_tbp.remat.simulate import Option, Simulator
from lightning_tbp.remat.trace import Trace, frozen_buffers

#: Block classes calibrated (the commonest first) and interleaved rounds per block.
CLASSES, ROUNDS = 2, 3
#: Scales are clipped to this range: a wild measurement must not flip every decision.
SCALE_RANGE = (0.5, 8.0)


@dataclass(frozen=True)
class BlockTiming:
    """One block under one option: the extra time the model predicted and the one measured."""

    path: str
    option: Option
    predicted_ns: float
    measured_ns: float


@dataclass(frozen=True)
class Calibration:
    timings: tuple[BlockTiming, ...]
    option_scale: dict[Option, float]


def calibrate(
    module: nn.Module, trace: Trace, args: tuple, kwargs: dict, options: tuple[Option, ...], *, inside_call: bool
) -> Calibration:
    """Time representative blocks of ``module`` under ``options`` (see the module docstring)."""
    simulator = Simulator(trace)
    chosen = _representatives(module, trace)
    inputs = _capture_inputs(module, [path for path, _ in chosen], args, kwargs, inside_call)
    timings: list[BlockTiming] = []
    for path, node in chosen:
        if path not in inputs:
            continue
        try:
            measured = _time_block(module, path, inputs[path], options, simulator.cache_limit(node))
        except (RuntimeError, TypeError, ValueError):  # a block that cannot run alone keeps the estimate
            continue
        keep = [Option.KEEP] * len(trace.nodes)
        for option, extra in measured.items():
            plan = list(keep)
            plan[node] = option
            timings.append(BlockTiming(path, option, simulator.run(plan).recompute_cost, extra))
    scale: dict[Option, float] = {}
    for option in options:
        ratios = [t.measured_ns / t.predicted_ns for t in timings if t.option == option and t.predicted_ns > 0]
        if ratios:
            scale[option] = min(max(statistics.median(ratios), SCALE_RANGE[0]), SCALE_RANGE[1])
    return Calibration(tuple(timings), scale)


def _representatives(module: nn.Module, trace: Trace) -> list[tuple[str, int]]:
    """For the commonest block classes, the block of median cost (path, node index)."""
    modules = dict(module.named_modules())
    by_class: dict[str, list[int]] = {}
    for node in trace.nodes[1:]:
        if node.has_events and node.path in modules:
            by_class.setdefault(type(modules[node.path]).__name__, []).append(node.index)
    counts = Counter({name: len(nodes) for name, nodes in by_class.items()})
    chosen = []
    for name, _ in counts.most_common(CLASSES):
        nodes = sorted(by_class[name], key=lambda i: _cost(trace, i))
        node = nodes[len(nodes) // 2]
        chosen.append((trace.nodes[node].path, node))
    return chosen


def _cost(trace: Trace, node: int) -> float:
    first, last = trace.nodes[node].first_event, trace.nodes[node].last_event
    return sum(trace.event_cost[first : last + 1])


def _capture_inputs(
    module: nn.Module, paths: list[str], args: tuple, kwargs: dict, inside_call: bool
) -> dict[str, tuple[tuple, dict]]:
    """The arguments each block at ``paths`` gets in a gradient-free forward of ``module``."""
    modules = dict(module.named_modules())
    captured: dict[str, tuple[tuple, dict]] = {}
    handles = []

    def hook_for(path: str) -> Any:
        def capture(_: nn.Module, block_args: tuple, block_kwargs: dict) -> None:
            captured.setdefault(path, tree_map(_detached, (block_args, block_kwargs)))

        return capture

    for path in paths:
        handles.append(modules[path].register_forward_pre_hook(hook_for(path), with_kwargs=True))
    try:
        with torch.no_grad(), frozen_buffers(module), torch.random.fork_rng():
            module.forward(*args, **kwargs) if inside_call else module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _time_block(
    module: nn.Module, path: str, block_inputs: tuple[tuple, dict], options: tuple[Option, ...], cache_limit: int
) -> dict[Option, float]:
    """Median extra nanoseconds of each option over the plain block step."""
    block = module.get_submodule(path)
    block_args, block_kwargs = tree_map(
        lambda x: x.requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, block_inputs),
    )
    leaves = [x for x in tree_flatten((block_args, block_kwargs))[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    params = [p for p in block.parameters() if p.requires_grad]
    table: dict[str, Option] = {}
    wrappers = InstalledWrappers(module, table, {path: cache_limit})
    wrappers.ensure([path])
    device = next((x.device for x in leaves), torch.device("cpu"))

    def step() -> None:
        output = block(*block_args, **block_kwargs)
        outputs = [o for o in tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)[0]]
        loss = sum(o.float().square().mean() for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad)
        torch.autograd.grad(loss, leaves + params, allow_unused=True)

    samples: dict[Option, list[float]] = {option: [] for option in (Option.KEEP, *options)}
    try:
        with frozen_buffers(module), torch.random.fork_rng():
            table[path] = Option.KEEP  # warm-up (kernels, allocator); an option's first-call
            step()  # cost, if any, is one of its samples and the median drops it
            for _ in range(ROUNDS):
                for option, spent in samples.items():
                    table[path] = option
                    spent.append(timed_ns(step, device))
    finally:
        wrappers.remove()
    plain = statistics.median(samples.pop(Option.KEEP))
    return {option: max(0.0, statistics.median(spent) - plain) for option, spent in samples.items()}
