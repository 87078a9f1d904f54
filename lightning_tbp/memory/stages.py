"""Memory readings at named points of a training step: current and peak since the previous point.

One interface, :class:`StageMeter`, chosen by device with :func:`stage_meter_for`:

- CUDA reads the caching allocator's statistics at each mark (allocated and reserved, current
  and peak); each stage's allocated peak is its own (a region of the device's shared peak
  counter, :func:`lightning_tbp.memory.meters.allocator_peak`). Values are absolute. The
  reserved peak is the allocator's since its last reset, which another meter may have made.
- CPU has no allocator counters. A step is run inside one exact CPU region
  (:func:`lightning_tbp.memory.meters.allocator_peak`, profiler memory events); each stage is a
  mark of the region, which gives each stage's exact current and peak.
  Values are relative to the first mark; readings exist only after :meth:`end`. The profiler
  sees the free of a block only if the block was allocated under a profiler, so the session
  should begin a little before the first mark (``needs_preroll``): the callback starts it one
  training batch early, which makes the previous step's gradients and outputs visible when
  they are freed.

Both also read the process's resident set size through psutil at each mark.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import psutil
import torch

from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak


@dataclass
class StageReading:
    """Allocator state when a stage ended."""

    stage: str
    current_bytes: int
    """Bytes allocated at the mark (relative to ``begin`` where the meter is not absolute)."""
    peak_bytes: int
    """Highest allocation since the previous mark (or since ``begin``), same reference."""
    rss_bytes: int
    """Resident set size of the whole process at the mark."""
    reserved_bytes: int | None = None
    """CUDA only: bytes the caching allocator holds from the driver."""
    peak_reserved_bytes: int | None = None


def process_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


class StageMeter(ABC):
    """Marks stages of one region (a training step): ``begin``, ``mark`` per stage, ``end``."""

    name: str
    absolute: bool
    """Whether readings count every allocated byte (CUDA) or only those since the first mark (CPU)."""
    needs_preroll: bool
    """Whether ``begin`` should come well before the first mark (see the module docstring)."""

    @property
    @abstractmethod
    def active(self) -> bool:
        """Between ``begin`` and ``end``/``abort``."""

    @abstractmethod
    def begin(self) -> None: ...

    @abstractmethod
    def mark(self, stage: str) -> None: ...

    @abstractmethod
    def end(self) -> list[StageReading]:
        """Close the region and return one reading per mark, in order."""

    @abstractmethod
    def abort(self) -> None:
        """Close the region without readings (the step raised)."""


class CudaStageMeter(StageMeter):
    name = "cuda_caching_allocator"
    absolute = True
    needs_preroll = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._session: contextlib.ExitStack | None = None
        self._reading: AllocatorPeak | None = None
        self._base = 0
        self._stats: list[tuple[str, int, int, int]] = []

    @property
    def active(self) -> bool:
        return self._session is not None

    def begin(self) -> None:
        self._stats = []
        self._session = contextlib.ExitStack()
        self._base = torch.cuda.memory_allocated(self.device)
        # a region of the allocator's shared peak counter, so other meters' windows do not erase its own
        self._reading = self._session.enter_context(allocator_peak(self.device))

    def mark(self, stage: str) -> None:
        if self._reading is None:
            raise RuntimeError("CudaStageMeter.mark() outside begin()/end()")
        stats = torch.cuda.memory_stats(self.device)
        reserved = (stats["reserved_bytes.all.current"], stats["reserved_bytes.all.peak"])
        self._stats.append((stage, process_rss_bytes(), *reserved))
        self._reading.mark()

    def end(self) -> list[StageReading]:
        if self._session is None or self._reading is None:
            raise RuntimeError("CudaStageMeter.end() without begin()")
        self._session.close()
        marks, self._session, self._reading = self._reading.marks, None, None
        return [
            StageReading(stage, self._base + m.level_bytes, self._base + m.peak_before_bytes, rss, reserved, peak)
            for (stage, rss, reserved, peak), m in zip(self._stats, marks, strict=True)
        ]

    def abort(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = self._reading = None
        self._stats = []


class CpuStageMeter(StageMeter):
    name = "cpu_profiler_exact"
    absolute = False
    needs_preroll = True

    def __init__(self) -> None:
        self._session: contextlib.ExitStack | None = None
        self._reading: AllocatorPeak | None = None
        self._rss: list[tuple[str, int]] = []

    @property
    def active(self) -> bool:
        return self._session is not None

    def begin(self) -> None:
        if self._session is not None:
            raise RuntimeError("CpuStageMeter.begin() called twice without end()")
        self._rss = []
        self._session = contextlib.ExitStack()
        self._reading = self._session.enter_context(allocator_peak("cpu"))

    def mark(self, stage: str) -> None:
        if self._reading is None:
            raise RuntimeError("CpuStageMeter.mark() outside begin()/end()")
        self._rss.append((stage, process_rss_bytes()))
        self._reading.mark()

    def end(self) -> list[StageReading]:
        if self._session is None or self._reading is None:
            raise RuntimeError("CpuStageMeter.end() without begin()")
        self._session.close()
        marks, self._session, self._reading = self._reading.marks, None, None
        # the pre-roll before the first mark is the baseline
        base = marks[0].level_bytes if marks else 0
        readings = []
        for index, ((stage, rss), mark) in enumerate(zip(self._rss, marks, strict=True)):
            peak = 0 if index == 0 else mark.peak_before_bytes - base
            readings.append(StageReading(stage, mark.level_bytes - base, peak, rss))
        return readings

    def abort(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = self._reading = None
        self._rss = []


def stage_meter_for(device: torch.device | str) -> StageMeter:
    """The meter for ``device``: CUDA allocator statistics, or the exact CPU profiler replay."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaStageMeter(device)
    if device.type == "cpu":
        return CpuStageMeter()
    raise ValueError(f"no memory meter for device type {device.type!r}: cpu and cuda are supported")


__all__ = [
    "CpuStageMeter",
    "CudaStageMeter",
    "StageMeter",
    "StageReading",
    "process_rss_bytes",
    "stage_meter_for",
]
