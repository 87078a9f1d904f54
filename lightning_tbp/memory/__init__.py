"""Memory meters: exact allocator peaks on CPU and CUDA, usable without Lightning."""

from lightning_tbp.memory.meters import AllocatorPeak, measure_peak

__all__ = ["AllocatorPeak", "measure_peak"]
