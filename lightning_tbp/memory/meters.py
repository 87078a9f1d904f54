"""Allocator peak of a code region, exact on CPU and CUDA.

CPU: PyTorch's CPU allocator has no peak counter, but the profiler records every allocation
and free as a ``[memory]`` event with a signed byte count. Replaying those events in time order
gives the exact allocator peak of the region (checked against torch 2.13).
CUDA: the caching allocator's own ``max_memory_allocated`` after a peak reset.

Garbage: the profiler reports the free of a block that an *earlier* profiling session saw
allocated (only blocks from outside any session are dropped, with a warning). Cyclic garbage
from earlier code, collected at a random moment inside a region, would then lower its count by
whatever that garbage held: a full test run saw a step measured 21% below its exact, repeatable
peak. So the meters hold the collector off inside the region, after collecting only the
youngest generation (a full collection first would cost more than a small model's step).

Threads: the profiler sees the allocations and frees of the threads it follows (the one that
started it and autograd's). A block that another thread frees last (gloo's worker dropping the
flat copy of DDP's initial parameter broadcast, at random) is never seen freed, and every level
after it reads that block's size too high: measure from after such a hand-over. Under FSDP2 over
gloo this happens on most steps (a reduce-scatter's input, an all-gather's output, dropped by the
work object on gloo's thread), so where :func:`frees_hidden_by_collectives` says so, a reading is
an upper bound that the caller balances against what it knows is alive at its end.

Regions nest and overlap (a metered training step contains the planner's metered ops; a test
measures a whole fit that contains metered steps): one chain of profiler sessions serves them
all, see :class:`_CpuSessions`. Only a profiler started elsewhere stops the CPU meter.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_tbp.compat import DeviceType, MemoryEventSession, profiler_enabled
from lightning_tbp.memory.native_stderr import ProfilerChatterFilter

#: Name of the profiler range that marks an instant of an exact CPU region (see :meth:`AllocatorPeak.mark`).
_MARK = "lightning_tbp::mark::"


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
    """The instants :meth:`mark` noted, in order (on CPU filled when the region ends, or by
    :meth:`marks_so_far`)."""
    _marker: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    _reader: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def mark(self) -> None:
        """Note this instant inside the region, to split its peak into windows (for one, a
        training step's loss: from its module's forward end to its output gradients)."""
        if self._marker is not None:
            self._marker()

    def marks_so_far(self) -> list[Mark]:
        """The marks noted up to now, while the region is still open (on CPU this reads the
        allocation events recorded so far)."""
        if self._reader is not None:
            self._reader()
        return self.marks


def peak_apart_from(marks: list[Mark], held_by: dict[int, int], first: int, last: int) -> int:
    """Highest of the stretches ending at marks ``first``..``last``, each less what ``held_by``
    says was made by its end (mark index -> bytes, growing; marks it does not name hold the last
    named value, 0 before any): memory a step makes for outside it (optimizer state), apart."""
    held, highest = 0, None
    for index in range(first, last + 1):
        held = held_by.get(index, held)
        stretch = marks[index].peak_before_bytes - held
        highest = stretch if highest is None else max(highest, stretch)
    assert highest is not None, "an empty range of marks"
    return highest


def foreign_profiler_active() -> bool:
    """Whether a torch profiler not started by these meters is running (a user's, Lightning's
    ``PyTorchProfiler``): the exact CPU meter cannot run beside it."""
    return profiler_enabled() and not _CPU_SESSIONS.running


def gloo_runs_the_collectives() -> bool:
    """Whether this process is one of several in a gloo process group (whose worker threads run
    the collectives, and whose all-gather goes through a copy of its output)."""
    distributed = torch.distributed
    if not distributed.is_available() or not distributed.is_initialized():
        return False
    return distributed.get_world_size() > 1 and "gloo" in str(distributed.get_backend())


def frees_hidden_by_collectives(device: torch.device | str) -> bool:
    """Whether the exact meter on ``device`` can miss frees in this process: on CPU, where gloo's
    worker threads run the collectives."""
    return torch.device(device).type == "cpu" and gloo_runs_the_collectives()


def cpu_memory_events(events: Iterable[Any]) -> list[tuple[int, int]]:
    """``(time_ns, signed bytes)`` of the CPU allocator's events in a profiler trace, in time order."""
    memory = [
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    return sorted(memory, key=lambda event: event[0])  # stable: same-time events keep their order


def refuse_foreign_profiler() -> None:
    """The exact CPU meter is a profiler session; beside another one it would switch that one off."""
    if foreign_profiler_active():
        raise RuntimeError(
            "exact CPU memory measurement runs torch.profiler, and another profiler is already running; "
            "measure outside it (or on CUDA, whose allocator keeps its own statistics)"
        )


_HELD = [False]  # whether the collector is off by :func:`garbage_collection_held`'s outermost hold


@contextlib.contextmanager
def garbage_collection_held() -> Iterator[None]:
    """Hold Python's cyclic garbage collector off until the block ends, after collecting its
    youngest generation.

    The young collection is cheap (objects made since the last collection, not the ~0.3-0.4 s
    of a full one in a process with torch and Lightning loaded) and promotes what survives it,
    so inside the hold the youngest generation holds only what the block made:
    :func:`collect_garbage_made_inside` can then free the block's own cycles, blocks the meters
    saw allocated, and nothing older. Older garbage stays until after the block. Inside an outer
    hold (or with the collector off already) this does nothing."""
    if not gc.isenabled():
        yield
        return
    gc.collect(0)
    gc.disable()
    _HELD[0] = True
    try:
        yield
    finally:
        _HELD[0] = False
        gc.enable()


def collect_garbage_made_inside() -> None:
    """Inside a hold (:func:`garbage_collection_held`), free the cycles made since it began (a
    young collection): a region's own garbage, whose blocks its meter saw allocated. Outside one
    it does nothing (the collector runs as usual)."""
    if _HELD[0]:
        gc.collect(0)


@dataclass
class _Region:
    """One open CPU region of the session chain; levels are the chain's running net bytes."""

    key: int
    open_level: int
    peak_level: int
    window_level: int  # highest level since the region's last mark
    result: AllocatorPeak


class _CpuSessions:
    """One chain of profiler sessions serving every open exact CPU region of the process.

    torch runs one profiler at a time, so two regions cannot each run their own session, yet a
    metered training step contains metered planning, and a whole fit measured by a test contains
    metered steps. The chain runs one session while any region is open; when a region opens or
    closes, the running session is stopped, its allocation events are replayed into every open
    region (a running net level, its peak, each region's marks), and a new session starts at
    once. The profiler's size table outlives sessions, so the free of a block allocated in an
    earlier session of the chain is reported with its size: the level stays exact across the
    sessions. Only the instants between one session's stop and the next one's start are unseen,
    and no tensor is allocated there. While the chain runs, torch's own profiler chatter on the
    native stderr is filtered out (``native_stderr``)."""

    def __init__(self) -> None:
        self._profiler: MemoryEventSession | None = None
        self._regions: list[_Region] = []
        self._level = 0
        self._keys = itertools.count()
        self._quiet = ProfilerChatterFilter()

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def open(self, result: AllocatorPeak) -> _Region:
        refuse_foreign_profiler()
        if self._profiler is None:
            self._quiet.start()
            self._level = 0
            self._profiler = self._started()
        else:
            self.flush()
        region = _Region(next(self._keys), self._level, self._level, self._level, result)
        result._marker = functools.partial(self.mark, region.key)
        result._reader = self.flush
        self._regions.append(region)
        return region

    def close(self, region: _Region) -> None:
        last = len(self._regions) == 1
        session = self._stop()
        if not last:
            self._profiler = self._started()
        try:
            self._replay(session)
        finally:
            self._regions.remove(region)
            if last:
                self._quiet.stop()
        result = region.result
        result._marker = result._reader = None
        result.peak_bytes = region.peak_level - region.open_level
        result.net_bytes = self._level - region.open_level

    def flush(self) -> None:
        """Fold the events recorded so far into the open regions (a new session goes on)."""
        if self._profiler is not None:
            session = self._stop()
            self._profiler = self._started()
            self._replay(session)

    def _started(self) -> MemoryEventSession:
        return MemoryEventSession()

    def _stop(self) -> Any:
        assert self._profiler is not None
        session, self._profiler = self._profiler, None
        return session.stop()

    def mark(self, key: int) -> None:
        if self._profiler is not None:
            self._profiler.mark(f"{_MARK}{key}")

    def _replay(self, result: Any) -> None:
        """Fold a stopped session's events into the open regions (``result`` is kept while its
        events are read: they point into it)."""
        events = result.events()
        by_key = {region.key: region for region in self._regions}
        marks: list[tuple[int, int, int | None]] = [
            (e.start_ns(), 0, int(e.name()[len(_MARK) :])) for e in events if e.name().startswith(_MARK)
        ]
        allocations: list[tuple[int, int, int | None]] = [
            (at, nbytes, None) for at, nbytes in cpu_memory_events(events)
        ]
        level = self._level
        # a stable sort: an allocation at a mark's very nanosecond counts before it
        for _, nbytes, key in sorted(allocations + marks, key=lambda event: event[0]):
            if key is not None:
                region = by_key.get(key)
                if region is not None:
                    region.result.marks.append(Mark(level - region.open_level, region.window_level - region.open_level))
                    region.window_level = level
                continue
            level += nbytes
            for region in self._regions:
                if level > region.peak_level:
                    region.peak_level = level
                if level > region.window_level:
                    region.window_level = level
        self._level = level


_CPU_SESSIONS = _CpuSessions()


class _CudaPeaks:
    """Every open CUDA region of one device, sharing the caching allocator's one peak counter.

    A region (or a mark) resets the counter to start a window of its own, which would erase the
    peak an enclosing region has not read yet; so before every reset the counter's peak is
    folded into every open region, and regions nest and overlap as on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._regions: list[_Region] = []
        self._keys = itertools.count()

    def open(self, result: AllocatorPeak) -> _Region:
        level = self._fold()
        region = _Region(next(self._keys), level, level, level, result)
        result._marker = functools.partial(self._mark, region)
        self._regions.append(region)
        return region

    def close(self, region: _Region) -> None:
        level = self._fold()
        self._regions.remove(region)
        result = region.result
        result._marker = None
        result.peak_bytes = region.peak_level - region.open_level
        result.net_bytes = level - region.open_level

    def _mark(self, region: _Region) -> None:
        level = self._fold()
        region.result.marks.append(Mark(level - region.open_level, region.window_level - region.open_level))
        region.window_level = level

    def _fold(self) -> int:
        """The level now; the counter's peak since the last reset goes into every open region."""
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        for region in self._regions:
            region.peak_level = max(region.peak_level, peak)
            region.window_level = max(region.window_level, peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)


_CUDA_PEAKS: dict[torch.device, _CudaPeaks] = {}


def cuda_peaks(device: torch.device) -> _CudaPeaks:
    """The open regions of a CUDA device (one registry per device)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _CUDA_PEAKS.setdefault(device, _CudaPeaks(device))


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
    regions: _CpuSessions | _CudaPeaks
    if device.type == "cuda":
        regions = cuda_peaks(device)
    elif device.type == "cpu":
        regions = _CPU_SESSIONS
    else:
        raise ValueError(f"no exact allocator meter for device type {device.type!r} (cpu and cuda are supported)")
    # a collection inside would free blocks made before the region: the CPU meter misreads those
    # frees, and on CUDA the peak above the opening level would fall by them. Holding the collector
    # off is enough for that; a collection first would only free old garbage, and costs a metered
    # step of a small model far more than the step (~0.4 s with torch and Lightning loaded)
    with garbage_collection_held():
        region = regions.open(result)
        try:
            yield result
        finally:
            regions.close(region)


def measure_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> AllocatorPeak:
    """Run ``fn`` once and return its exact allocator peak (see :func:`allocator_peak`)."""
    with allocator_peak(device) as result:
        fn()
    return result


@contextlib.contextmanager
def known_to_the_meter(device: torch.device | str) -> Iterator[None]:
    """Blocks allocated inside are known to every later exact CPU region, which then counts their
    frees (the profiler's size table outlives its sessions).

    For memory training holds outside any region that something frees inside one: DDP allocates
    its gradient buckets when it wraps the model and replaces them in the second step's forward
    (re-bucketed in the order of the first backward). Unknown to the meter, the new buckets
    would count and the old ones' free would not: every later step would read their size too
    high. Nothing on CUDA, whose allocator sees every free, nor under a profiler the meter
    cannot run beside."""
    if torch.device(device).type != "cpu" or foreign_profiler_active():
        yield
        return
    with allocator_peak(device):
        yield
