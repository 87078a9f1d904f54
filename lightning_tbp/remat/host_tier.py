"""Host memory as a tier: a block's saved activations copied out of device memory in the forward
and brought back, one op's at a time, when the backward needs them (the plan's ``OFFLOAD``).

Autograd hands each tensor an op saves for its backward to ``saved_tensors_hooks``: the pack
hook copies the tensor's whole storage to host memory and returns a handle, so autograd holds
nothing on the device and the device copy goes as soon as the forward drops its last
reference; the unpack hook copies it back into a fresh device storage and rebuilds the view
(size, stride, offset). A whole storage, not the view, because the planner counts memory in
storages: a block offloaded costs, in the backward of each op, the bytes of the storages that
op saved, which is what the simulator charges (``simulated_step``).

What stays on the device: tensors below :data:`MIN_OFFLOAD_BYTES` (a copy's fixed cost exceeds
what it saves), tensors over storages the step did not make (parameters, buffers, the call's
inputs: :class:`Resident`), and tensor subclasses (a quantized weight's inner tensors).

The host is pinned memory on CUDA. On a CPU the device and the host are the same memory; the
tier is emulated by host buffers that numpy allocates, which the profiler's memory events (the
exact CPU meter, ``memory/cpu.py``) do not count, so a test on this CPU measures the
device-resident peak exactly. Copies are synchronous in this first form (no side stream): the
planner charges their measured time (``overheads.StepOverheads``: ``offload_ns_per_byte`` and
``offload_save_ns``) as the option's cost.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import psutil
import torch

from lightning_tbp.compat import storage_key, storage_weak_ref, version_counter

if TYPE_CHECKING:
    from lightning_tbp.remat.trace import Trace

#: Whether plans may use the host tier (``Plan(host_tier=...)``).
HostTier = Literal["off", "on", "auto"]
#: Saved tensors over smaller storages stay on the device.
MIN_OFFLOAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class _Offloaded:
    """A saved tensor whose storage lives on the host: what rebuilds it on the device."""

    host: torch.Tensor  # uint8, the whole storage
    device: torch.device
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class Resident:
    """Storages a step did not make (parameters, buffers, the inputs of the planned call): never
    offloaded, as the planner's trace counts them outside the step. Set at each step's start."""

    def __init__(self) -> None:
        self._keys: set[int] = set()

    def reset(self, tensors: Iterable[torch.Tensor]) -> None:
        self._keys = {key for t in tensors if (key := storage_key(t)) is not None}

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self._keys


def offloaded(trace: Trace, sid: int) -> bool:
    """Whether an offloaded block's save of storage ``sid`` goes to the host (:func:`offloadable`,
    as the planner's trace knows it: made by the step, and large enough)."""
    return trace.storage_is_activation[sid] and trace.storage_bytes[sid] >= MIN_OFFLOAD_BYTES


#: The share of the host's available memory the host tier may take by default.
HOST_SHARE = 0.8


def default_host_budget(processes_per_host: int = 1) -> int:
    """What the host tier may hold by default: a share of the memory the host has available now,
    split between the training processes on it (ranks of one node share its memory)."""
    return int(psutil.virtual_memory().available * HOST_SHARE) // max(processes_per_host, 1)


class _HostUse:
    """Bytes of live host-tier buffers, and their peak since the last reset (``host_use``)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def allocated(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def freed(self, nbytes: int) -> None:
        self.live -= nbytes


#: What the host tier holds in this process (the plan report predicts its peak per step).
host_use = _HostUse()


def host_buffer(nbytes: int, device: torch.device, like: torch.Tensor | None = None) -> torch.Tensor:
    """``nbytes`` of host memory for a copy of ``device`` memory: pinned for CUDA (copies can run
    at full bandwidth), numpy's for a CPU (memory the exact CPU meter does not count); bytes, or
    with ``like``, a contiguous tensor of its dtype and shape (the tensor returned is the one
    whose life ``host_use`` follows)."""
    if device.type == "cuda":
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        buffer = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
    if like is not None:
        buffer = buffer.view(like.dtype).view(like.shape)
    host_use.allocated(nbytes)
    weakref.finalize(buffer, host_use.freed, nbytes)
    return buffer


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``tensor`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def offloadable(tensor: torch.Tensor, resident: Resident) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and tensor.untyped_storage().nbytes() >= MIN_OFFLOAD_BYTES
        and tensor not in resident
    )


class HostCopies:
    """The host copies one offloaded call made, by storage: a storage saved by several ops (an
    input two layers read) is copied once while it lives on the device and nothing wrote to it
    since (its version counter, shared by every view, is unchanged), as the simulator counts."""

    def __init__(self, resident: Resident) -> None:
        self.resident = resident
        self._copies: dict[int, tuple[Any, int, torch.Tensor]] = {}  # key -> (weak ref, version, copy)

    def host_of(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        assert key is not None  # offloadable tensors are strided
        known = self._copies.get(key)
        if known is not None and not known[0].expired() and known[1] == version_counter(tensor):
            return known[2]
        source = _storage_bytes(tensor)
        host = host_buffer(source.numel(), tensor.device)
        host.copy_(source)
        self._copies[key] = (storage_weak_ref(tensor), version_counter(tensor), host)
        return host


def pack(tensor: torch.Tensor, copies: HostCopies) -> torch.Tensor | _Offloaded:
    """Copy ``tensor``'s storage to the host (or keep the tensor, if it stays on the device)."""
    if not offloadable(tensor, copies.resident):
        return tensor
    layout = (tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset()))
    return _Offloaded(copies.host_of(tensor), tensor.device, tensor.dtype, *layout)


def unpack(packed: torch.Tensor | _Offloaded) -> torch.Tensor:
    """A device tensor equal to what was packed, over a fresh copy of its storage."""
    if isinstance(packed, torch.Tensor):
        return packed
    storage = torch.empty(packed.host.numel(), dtype=torch.uint8, device=packed.device)
    storage.copy_(packed.host)
    tensor = torch.empty(0, dtype=packed.dtype, device=packed.device)
    tensor.set_(storage.untyped_storage(), packed.offset, packed.size, packed.stride)
    return tensor


@contextlib.contextmanager
def offloaded_saves(resident: Resident) -> Iterator[None]:
    """Run the block inside with its saved activations offloaded to the host."""
    copies = HostCopies(resident)  # dropped as the block's forward ends: the saves keep what they use
    with torch.autograd.graph.saved_tensors_hooks(lambda t: pack(t, copies), unpack):
        yield
