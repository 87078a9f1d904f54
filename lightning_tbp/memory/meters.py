"""Allocator peak of a code region, exact on CPU and CUDA.

CPU: PyTorch's CPU allocator has no peak counter, but the profiler records every allocation
and free as a ``[memory]`` event with a signed byte count. Replaying those events in time order
gives the exact allocator peak of the region (checked against torch 2.13).
CUDA: the caching allocator's own ``max_memory_allocated`` after a peak reset.

Garbage: the profiler reports the free of a block that an *earlier* profiling session saw
allocated (only blocks from outside any session are dropped, with a warning). Cyclic garbage
from earlier code, collected at a random moment inside a region, would then lower its count by
whatever that garbage held: a full test run saw a step measured 21% below its exact, repeatable
peak. So the CPU meters collect garbage first and hold the collector off inside the region.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_tbp.compat import DeviceType

#: Name of the profiler range that marks an instant of an exact CPU region (see :meth:`AllocatorPeak.mark`).
_MARK = "lightning_tbp::mark"


@dataclass(frozen=True)
class Mark:
    """An instant of a measured region (:meth:`AllocatorPeak.mark`), relative to the region's start."""

    level_bytes: int
    """Net allocation at the mark."""
    peak_before_bytes: int
    """Highest net allocation between the previous mark (or the region's start) and this one."""


@dataclass
class AllocatorPeak:
    """Bytes allocated by tensors inside a measured region, relative to its start."""

    peak_bytes: int = 0
    """Highest net allocation reached inside the region."""
    net_bytes: int = 0
    """Net allocation left when the region ended (what it kept alive)."""
    marks: list[Mark] = field(default_factory=list)
    """The instants :meth:`mark` noted, in order (filled when the region ends on CPU)."""
    _marker: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def mark(self) -> None:
        """Note this instant inside the region, to split its peak into windows (for one, a
        training step's loss: from its module's forward end to its output gradients)."""
        if self._marker is not None:
            self._marker()


def profiler_active() -> bool:
    """Whether a torch profiler is running: the exact CPU meter cannot nest inside one."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def cpu_memory_events(events: Iterable[Any]) -> list[tuple[int, int]]:
    """``(time_ns, signed bytes)`` of the CPU allocator's events in a profiler trace, in time order."""
    memory = [
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    return sorted(memory, key=lambda event: event[0])  # stable: same-time events keep their order


def refuse_nested_profiler() -> None:
    """The exact CPU meter is a profiler session; a nested one would switch the running one off."""
    if profiler_active():
        raise RuntimeError(
            "exact CPU memory measurement runs torch.profiler, and a profiler is already running; "
            "measure outside it (or on CUDA, whose allocator keeps its own statistics)"
        )


@contextlib.contextmanager
def garbage_collection_held(collect: bool = True) -> Iterator[None]:
    """Collect Python's cyclic garbage now and hold the collector off until the block ends.

    Inside an outer hold this does nothing (nothing new to collect cheaply), so a loop of many
    small measurements can pay for one collection under one outer hold. ``collect=False`` only
    holds the collector off: that alone keeps the meters exact (no collection frees old blocks
    inside), and skips a full collection that costs ~0.3 s in a process with diffusers loaded;
    old cycles then keep their memory until after the block."""
    if not gc.isenabled():
        yield
        return
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _cpu_mark() -> None:
    with torch.profiler.record_function(_MARK):  # its start time, on the memory events' clock, is the mark
        pass


@contextlib.contextmanager
def _cpu_region(result: AllocatorPeak) -> Iterator[None]:
    refuse_nested_profiler()
    result._marker = _cpu_mark
    try:
        with garbage_collection_held(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
    finally:
        result._marker = None
    events = prof.profiler.kineto_results.events()
    marks: list[tuple[int, int | None]] = [(e.start_ns(), None) for e in events if e.name() == _MARK]
    current = peak = window = 0
    # a stable sort: an allocation at a mark's very nanosecond counts before it
    for _, nbytes in sorted(cpu_memory_events(events) + marks, key=lambda event: event[0]):
        if nbytes is None:
            result.marks.append(Mark(current, window))
            window = current
            continue
        current += nbytes
        peak, window = max(peak, current), max(window, current)
    result.peak_bytes, result.net_bytes = peak, current


@contextlib.contextmanager
def _cuda_region(result: AllocatorPeak, device: torch.device) -> Iterator[None]:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    highest = 0  # of the windows before the last mark (each mark resets the allocator's peak)

    def mark() -> None:
        nonlocal highest
        torch.cuda.synchronize(device)
        window = torch.cuda.max_memory_allocated(device) - start
        result.marks.append(Mark(torch.cuda.memory_allocated(device) - start, window))
        highest = max(highest, window)
        torch.cuda.reset_peak_memory_stats(device)

    result._marker = mark
    try:
        yield
    finally:
        result._marker = None
    torch.cuda.synchronize(device)
    result.peak_bytes = max(highest, torch.cuda.max_memory_allocated(device) - start)
    result.net_bytes = torch.cuda.memory_allocated(device) - start


@contextlib.contextmanager
def allocator_peak(device: torch.device | str = "cpu") -> Iterator[AllocatorPeak]:
    """Measure the exact allocator peak of the ``with`` body on ``device``.

    >>> with allocator_peak("cpu") as m:
    ...     y = torch.ones(1024)
    >>> m.peak_bytes >= 4096
    True
    """
    device = torch.device(device)
    result = AllocatorPeak()
    if device.type == "cuda":
        region = _cuda_region(result, device)
    elif device.type == "cpu":
        region = _cpu_region(result)
    else:
        raise ValueError(f"no exact allocator meter for device type {device.type!r} (cpu and cuda are supported)")
    with region:
        yield result


def measure_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> AllocatorPeak:
    """Run ``fn`` once and return its exact allocator peak (see :func:`allocator_peak`)."""
    with allocator_peak(device) as result:
        fn()
    return result
