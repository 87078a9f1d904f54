"""Real forwards of the profiled module, timed per block, and the op prices scaled to them.

The recorder times each op alone (``calibrate.py``); a recomputation runs inside the framework
(Python, module calls, autograd's graph), which adds a different share per block. Two real
forwards with gradients, their saved tensors dropped as in the profile so they stay memory-safe,
give each block's wall time, and each op's price is scaled to its block's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lightning_tbp.remat.trace import Trace


@contextlib.contextmanager
def frozen_buffers(module: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. running statistics) that the profiling forward may update."""
    saved = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buf in module.named_buffers():
                buf.copy_(saved[name])


#: Bounds of a block's real forward over its ops' isolated times: a wild measurement of one
#: small block must not price its recomputation at nothing or at a hundred times its ops.
FRAMEWORK_FACTOR_RANGE = (0.5, 10.0)
#: A real forward this long is timed once, not best of two (as ``calibrate.SINGLE_RUN_NS`` for ops).
SINGLE_FORWARD_NS = 1_000_000_000


def time_forward(
    module: nn.Module,
    candidates: dict[nn.Module, str],
    args: tuple,
    kwargs: dict,
    inside_call: bool,
    cuda_devices: list[int],
    *,
    keep_inputs: dict[nn.Module, Callable[[tuple, dict], None]] | None = None,
) -> tuple[float, list[float]]:
    """Best of two real forwards with gradients (one if the first is long), autograd and module
    overhead included, its saved tensors dropped as in the profile so it stays memory-safe:
    nanoseconds of the whole forward, and of each candidate block's call in call order (the
    trace's node order). Each block in ``keep_inputs`` hands its arguments to its function."""

    def refuse(_: None) -> torch.Tensor:
        raise RuntimeError("lightning_tbp timing graph cannot be backpropagated")

    def synchronise() -> None:
        for device in cuda_devices:
            torch.cuda.synchronize(device)

    calls: list[float] = []
    open_calls: list[tuple[int, int]] = []

    def enter(*_: object) -> None:
        synchronise()
        open_calls.append((len(calls), time.perf_counter_ns()))
        calls.append(0.0)

    def leave(*_: object) -> None:
        synchronise()
        slot, start = open_calls.pop()
        calls[slot] = float(time.perf_counter_ns() - start)

    # registered first, so the time a block takes to hand its inputs over is outside its call
    handles = [
        sub.register_forward_pre_hook(
            lambda _, block_args, block_kwargs, keep=keep: keep(block_args, block_kwargs), with_kwargs=True
        )
        for sub, keep in (keep_inputs or {}).items()
    ]
    handles += [sub.register_forward_pre_hook(enter) for sub in candidates]
    handles += [sub.register_forward_hook(leave) for sub in candidates]
    best, best_calls, runs = float("inf"), None, 0
    try:
        with (
            frozen_buffers(module),
            torch.random.fork_rng(devices=cuda_devices),
            torch.autograd.graph.saved_tensors_hooks(lambda _: None, refuse),
        ):
            while runs == 0 or (runs < 2 and best < SINGLE_FORWARD_NS):
                calls.clear()
                synchronise()
                start = time.perf_counter_ns()
                output = module.forward(*args, **kwargs) if inside_call else module(*args, **kwargs)
                synchronise()
                best, runs = min(best, time.perf_counter_ns() - start), runs + 1
                if best_calls is None or len(best_calls) != len(calls):
                    best_calls = list(calls)
                else:
                    best_calls = [min(a, b) for a, b in zip(best_calls, calls, strict=True)]
                del output
    finally:
        for handle in handles:
            handle.remove()
    return float(best), best_calls or []


def scale_to_framework(trace: Trace, forward_ns: float, block_ns: list[float]) -> None:
    """Scale each op's isolated forward time to what it costs inside its block's real forward.

    A recomputation runs in the framework: Python, module calls, autograd's graph. How much that
    adds over the ops alone differs by block (measured on a small Flux: its adaptive norms of ten
    tiny ops pay 2.5x their ops, its attention 1.5x, a U-Net's convolutions 1.1x), so one factor
    for the whole model misprices the blocks a plan recomputes. The ops a block runs itself
    (outside its child blocks) share what its real forward spent beyond its children's; the
    ops outside every block share the rest of the whole forward. A block's recomputation is then
    priced at its measured forward, and the unplanned forward at the measured one.
    """
    nodes = trace.nodes
    low, high = FRAMEWORK_FACTOR_RANGE
    if len(block_ns) != len(nodes) - 1:  # the calls differ from the profile's (data-dependent branches)
        factor = min(max(forward_ns / max(sum(trace.event_cost), 1.0), low), high)
        trace.event_cost = [cost * factor for cost in trace.event_cost]
        return
    wall = [forward_ns, *block_ns]
    own_events: list[list[int]] = [[] for _ in nodes]
    for event, owner in enumerate(trace.event_node):
        own_events[owner].append(event)
    for node in nodes:
        alone = sum(trace.event_cost[e] for e in own_events[node.index])
        spent = wall[node.index] - sum(wall[child] for child in node.children)
        factor = min(max(spent / alone, low), high) if alone > 0 and wall[node.index] > 0 else 1.0
        for event in own_events[node.index]:
            trace.event_cost[event] *= factor
