"""What each plan option costs beyond the ops it recomputes, measured on the device once.

Recomputed FLOPs are not what a user pays. A non-reentrant checkpoint stashes and restores the
RNG state and runs Python hooks for every tensor it saves (packed in the forward, unpacked and
recomputed in the backward); a lazy block records every op's recipe through a Python dispatch
mode and rebuilds saved activations one op at a time in Python; a selective block routes every
op through torch's caching dispatch mode. On a CPU these per-call and per-op costs are tens of
microseconds and can exceed the recomputed FLOPs, so a planner that ignores them prefers options
that are slower than they look.

Each cost is measured by running the option on a small chain of ops against the same chain
plain, forward and backward (interleaved repetitions, medians), so the numbers include what
the option really adds: see :class:`StepOverheads`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_tbp.remat.host_tier import host_buffer
from lightning_tbp.remat.lazy import lazy_recompute


@dataclass(frozen=True)
class StepOverheads:
    """Nanoseconds an option adds to a training step, by what it adds them for."""

    checkpoint_call_ns: float = 0.0
    """Per checkpointed call (the RNG state stashed and restored, the frame, the recompute's set-up)."""
    checkpoint_save_ns: float = 0.0
    """Per tensor a checkpointed region saves (packed, unpacked, its recomputation kept and handed over)."""
    lazy_op_ns: float = 0.0
    """Per op run inside a lazy block (its recipe recorded; a saved one rebuilt in Python)."""
    selective_op_ns: float = 0.0
    """Per op run inside a selective block, in its forward and again in its recomputation."""
    offload_ns_per_byte: float = 0.0
    """Per byte an offloaded block copies to the host tier and back (``host_tier.py``)."""
    offload_save_ns: float = 0.0
    """Per saved tensor an offloaded block copies, beyond its bytes (a host buffer, a device one)."""


_CHAIN = 40  # ops per chain: sigmoid (saves its result) then a scale, alternating
_MEASURED: dict[str, StepOverheads] = {}


def step_overheads(device: torch.device) -> StepOverheads:
    """The overheads on ``device``'s type, measured the first time they are asked for."""
    if device.type not in _MEASURED:
        # the measurement draws its own inputs; the user's random stream must not move
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _MEASURED[device.type] = _measure(device)
    return _MEASURED[device.type]


def _measure(device: torch.device) -> StepOverheads:
    x = torch.randn(64, device=device, requires_grad=True)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(_CHAIN // 2):
            x = torch.sigmoid(x) * 1.0001
        return x

    def single(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def plain(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: torch.autograd.backward(fn(x).sum())

    def checkpointed(fn: Callable[[torch.Tensor], torch.Tensor], **extra: Any) -> Callable[[], None]:
        return lambda: torch.autograd.backward(checkpoint(fn, x, use_reentrant=False, **extra).sum())

    def lazily() -> None:
        with lazy_recompute():
            y = chain(x)
        torch.autograd.backward(y.sum())

    def cache_nothing(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        from torch.utils.checkpoint import CheckpointPolicy

        return CheckpointPolicy.PREFER_RECOMPUTE

    selective = checkpointed(chain, context_fn=lambda: create_selective_checkpoint_contexts(cache_nothing))
    runs = {
        "plain_chain": plain(chain),
        "plain_single": plain(single),
        "checkpoint_single": checkpointed(single),
        "checkpoint_chain": checkpointed(chain),
        "lazy_chain": lazily,
        "selective_chain": selective,
        "forward_chain": lambda: _no_grad(chain, x),
    }
    times = _interleaved(runs, device)
    recompute = times["forward_chain"]
    call = max(0.0, times["checkpoint_single"] - times["plain_single"])
    saves = _CHAIN // 2  # sigmoid saves its result; the scale by a constant saves nothing
    per_save = max(0.0, times["checkpoint_chain"] - times["plain_chain"] - recompute - call) / saves
    lazy = max(0.0, times["lazy_chain"] - times["plain_chain"]) / _CHAIN
    selective_ops = max(0.0, times["selective_chain"] - times["checkpoint_chain"]) / (2 * _CHAIN)
    return StepOverheads(call, per_save, lazy, selective_ops, *_offload_costs(device))


_PROBE_BYTES = (64 * 2**10, 4 * 2**20)


def _offload_costs(device: torch.device) -> tuple[float, float]:
    """Nanoseconds per byte, and per saved tensor beyond its bytes, of a trip to the host tier
    and back as an offloaded block makes it: a fresh host buffer filled, a fresh device buffer
    filled from it (fresh memory is what the pack and unpack get), at a small and a large size."""
    sources = [torch.ones(n, dtype=torch.uint8, device=device) for n in _PROBE_BYTES]

    def round_trip(source: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            host = host_buffer(source.numel(), device)
            host.copy_(source)
            torch.empty_like(source).copy_(host)

        return run

    times = _interleaved({str(s.numel()): round_trip(s) for s in sources}, device)
    small, large = (times[str(n)] for n in _PROBE_BYTES)
    per_byte = max(0.0, large - small) / (_PROBE_BYTES[1] - _PROBE_BYTES[0])
    return per_byte, max(0.0, small - per_byte * _PROBE_BYTES[0])


def _no_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    with torch.no_grad():
        fn(x)


def _interleaved(runs: dict[str, Callable[[], None]], device: torch.device, rounds: int = 9) -> dict[str, float]:
    """Median nanoseconds of each run, timed in interleaved rounds (drift hits them all alike)."""
    for run in runs.values():
        run()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            samples[name].append(timed_ns(run, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def timed_ns(run: Callable[[], object], device: torch.device) -> int:
    """Wall nanoseconds of ``run()``, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter_ns()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter_ns() - start
