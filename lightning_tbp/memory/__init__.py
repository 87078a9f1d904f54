"""Memory meters: exact allocator peaks on CPU and CUDA, usable without Lightning."""

from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, measure_peak, profiler_active

__all__ = ["AllocatorPeak", "allocator_peak", "measure_peak", "profiler_active"]
