"""What the callbacks read from a strategy: a declared interface, checked with ``isinstance``.

The tiny_backprop strategies implement it; any other strategy simply does not, and the callbacks
then record no plan and no DP buffers. A test asserts that every registered tiny_backprop
strategy satisfies it, so a rename on either side fails loudly instead of reading a default.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning_tbp.privacy import BufferStats


@runtime_checkable
class MemoryReportingStrategy(Protocol):
    """A strategy that tells the memory report about its plan and its DP engine."""

    def memory_report_config(self) -> dict[str, Any]:
        """The plan in force and the DP settings, as JSON-able dicts (``plan``, ``dp``)."""
        ...

    def dp_buffer_stats(self) -> BufferStats | None:
        """The DP engine's held bytes (now, and the peak of its last backward); None without DP."""
        ...

    def communication_buffer_bytes(self) -> int:
        """Bytes it holds on the device for communication that no parameter, gradient or
        optimizer state accounts for (DDP's gradient buckets)."""
        ...
