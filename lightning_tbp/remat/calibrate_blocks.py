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
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_tbp.compat import tree_flatten, tree_map
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.forward_timing import frozen_buffers
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.overheads import timed_ns
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.trace import Trace

#: Block classes calibrated (the commonest first).
CLASSES = 2
#: Interleaved rounds per block: at least the fewest, and more, up to the most, while the block's
#: rounds have taken less than ``ROUNDS_FILL_NS``. An option's extra time is the difference of two
#: noisy step times: on a small Flux (block steps of a few milliseconds) three rounds gave the
#: full-checkpoint scale anywhere in 1.30-1.63 over six profiles, twelve in 1.42-1.57; the blocks
#: of a large model, whose steps are long and steady, stay at three.
ROUNDS = (3, 12)
ROUNDS_FILL_NS = 100_000_000
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


class BlockInputs:
    """Chooses the representative blocks (the commonest block classes, each its block of median
    cost) and keeps the inputs the profile's timed forward calls them with (``record_trace``'s
    ``block_inputs``): a forward of the whole model for them alone cost an SD-1.5 U-Net's
    profile 4.9 s of its 32.8 s."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.paths: list[str] = []
        self.inputs: dict[str, tuple[tuple, dict]] = {}

    def choose(self, trace: Trace) -> list[str]:
        modules = dict(self.module.named_modules())
        by_class: dict[str, list[int]] = {}
        for node in trace.nodes[1:]:
            # a module called several times is timed at its first call (whose inputs ``capture`` keeps)
            if node.has_events and node.call == 0 and node.path in modules:
                by_class.setdefault(type(modules[node.path]).__name__, []).append(node.index)
        counts = Counter({name: len(nodes) for name, nodes in by_class.items()})
        self.paths = []
        for name, _ in counts.most_common(CLASSES):
            nodes = sorted(by_class[name], key=lambda i: _cost(trace, i))
            self.paths.append(trace.nodes[nodes[len(nodes) // 2]].path)
        return self.paths

    def capture(self, path: str, args: tuple, kwargs: dict) -> None:
        self.inputs.setdefault(path, tree_map(_detached, (args, kwargs)))


def calibrate(module: nn.Module, trace: Trace, block_inputs: BlockInputs, options: tuple[Option, ...]) -> Calibration:
    """Time the blocks ``block_inputs`` chose and holds the inputs of, under ``options`` (see the
    module docstring)."""
    simulator = Simulator(trace)
    node_of = {node.key: node.index for node in trace.nodes}  # a path is the key of its module's first call
    timings: list[BlockTiming] = []
    for path in block_inputs.paths:
        if path not in block_inputs.inputs or path not in node_of:
            continue
        node = node_of[path]
        try:
            measured = _time_block(module, path, block_inputs.inputs[path], options, simulator.cache_limit(node))
        except (RuntimeError, TypeError, ValueError):  # a block that cannot run alone keeps the estimate
            continue
        keep = [Option.KEEP] * len(trace.nodes)
        for option, extra in measured.items():
            plan = list(keep)
            plan[node] = option
            timings.append(BlockTiming(path, option, simulator.run(plan).recompute_cost, extra))
    block_inputs.inputs.clear()  # the trace outlives the calibration; the activations need not
    scale: dict[Option, float] = {}
    for option in options:
        ratios = [t.measured_ns / t.predicted_ns for t in timings if t.option == option and t.predicted_ns > 0]
        if ratios:
            scale[option] = min(max(statistics.median(ratios), SCALE_RANGE[0]), SCALE_RANGE[1])
    return Calibration(tuple(timings), scale)


def _cost(trace: Trace, node: int) -> float:
    first, last = trace.nodes[node].first_event, trace.nodes[node].last_event
    return sum(trace.event_cost[first : last + 1])


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
        wrappers.begin_step()
        # fresh containers each run: a block may write into those it is given (a video VAE's feature cache)
        call_args, call_kwargs = tree_map(lambda x: x, (block_args, block_kwargs))
        output = block(*call_args, **call_kwargs)
        outputs = [o for o in tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)[0]]
        loss = sum(o.float().square().mean() for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad)
        assert isinstance(loss, torch.Tensor), "a block chosen for calibration has an output that needs a gradient"
        torch.autograd.grad(loss, [*leaves, *params], allow_unused=True)

    samples: dict[Option, list[float]] = {option: [] for option in (Option.KEEP, *options)}
    try:
        with frozen_buffers(module), torch.random.fork_rng():
            table[path] = Option.KEEP  # warm-up (kernels, allocator); an option's first-call
            step()  # cost, if any, is one of its samples and the median drops it
            fewest, most = ROUNDS
            start, rounds = time.perf_counter_ns(), 0
            while rounds < fewest or (rounds < most and time.perf_counter_ns() - start < ROUNDS_FILL_NS):
                for option, spent in samples.items():
                    table[path] = option
                    spent.append(timed_ns(step, device))
                rounds += 1
    finally:
        wrappers.remove()
    plain = statistics.median(samples.pop(Option.KEEP))
    return {option: max(0.0, statistics.median(spent) - plain) for option, spent in samples.items()}
