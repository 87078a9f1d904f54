"""Live bytes of fake tensors: the allocator peak of a step that never allocates.

Under fake tensors nothing reaches an allocator, so there is no meter to read. This dispatch
mode stands in for one: every op output on a storage that none of the op's inputs views is an
allocation of that storage's bytes, freed when the last tensor viewing it is garbage collected
(a fake tensor's Python object lives exactly as long as the tensor does, autograd's saved
tensors included). Storages made before the meter started (parameters, the batch) are the
baseline and are not counted.

``rounding``: the granularity of the modelled allocator. CUDA's caching allocator rounds every
block up to 512 bytes and ``torch.cuda.max_memory_allocated`` counts the rounded sizes; CPU
allocations are counted as requested (1).
"""

from __future__ import annotations

import weakref

from lightning_tbp.compat import TorchDispatchMode, storage_key
from lightning_tbp.remat.op_args import op_tensors


def rounded(nbytes: int, rounding: int) -> int:
    """``nbytes`` rounded up to a multiple of ``rounding``."""
    return -(-nbytes // rounding) * rounding


class LiveBytes(TorchDispatchMode):
    """Counts bytes of storages created while it is active; ``peak`` is their running maximum."""

    def __init__(self, rounding: int = 1) -> None:
        super().__init__()
        self.rounding = rounding
        self.current = 0
        self.peak = 0
        self._views: dict[int, int] = {}  # storage key -> live tensors viewing it
        self._sizes: dict[int, int] = {}

    def count(self, tensors: object) -> None:
        """Count these existing tensors' storages as live from now (the last step's gradients,
        alive as a step starts): their bytes join ``current`` and leave it when they are freed."""
        for tensor in op_tensors(tensors):
            key = storage_key(tensor)
            if key is None or key in self._views:
                continue
            self._sizes[key] = rounded(tensor.untyped_storage().nbytes(), self.rounding)
            self._views[key] = 1
            self.current += self._sizes[key]
            self.peak = max(self.peak, self.current)
            weakref.finalize(tensor, self._dropped, key)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (the next phase of the step)."""
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in op_tensors((args, kwargs))}
        for tensor in op_tensors(out):
            key = storage_key(tensor)
            if key is None or (key in inputs and key not in self._views):
                continue  # no storage, or a view or in-place result of a baseline storage
            if key not in self._views:
                self._sizes[key] = rounded(tensor.untyped_storage().nbytes(), self.rounding)
                self._views[key] = 0
                self.current += self._sizes[key]
                self.peak = max(self.peak, self.current)
            self._views[key] += 1
            weakref.finalize(tensor, self._dropped, key)
        return out

    def _dropped(self, key: int) -> None:
        self._views[key] -= 1
        if self._views[key] == 0:  # the storage's key may now be reused by a new storage
            del self._views[key]
            self.current -= self._sizes.pop(key)
