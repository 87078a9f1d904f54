"""Lightning callbacks: observe training (memory, privacy) without changing it."""

from lightning_tbp.callbacks.memory_profiler import MemoryProfilerCallback

__all__ = ["MemoryProfilerCallback"]
