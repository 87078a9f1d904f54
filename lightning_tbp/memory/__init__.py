"""Memory meters: exact allocator peaks on CPU and CUDA, usable without Lightning."""

from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, foreign_profiler_active, measure_peak

__all__ = ["AllocatorPeak", "allocator_peak", "foreign_profiler_active", "measure_peak"]
