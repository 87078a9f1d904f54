"""Frozen weights streamed from host memory: a block's weights live on the host and are copied
to the device for each run of the block (the plan's ``STREAM``), as community trainers' "block
swap" does by hand.

A streamed block runs under a full non-reentrant checkpoint, so nothing it saves is held past
its forward. Its function copies each frozen weight the block owns into a fresh device tensor
and shadows the parameter with it for the call (an instance attribute of the owning module, which
Python finds before the module's parameter table), then drops the shadows: in the forward the
copies go as the block returns; in the backward the recompute copies them in again, and what its
ops saved (a linear's weight) stays until that op's backward has run, as any recomputed save.
The parameter itself, its name, its place in ``state_dict`` and in the optimizer are untouched:
only its data moves to the host (:class:`HostWeights`), and comes back when the plan stops
streaming it. Gradients are exact: the copies are bit-for-bit the weights.

Streamable weights (:func:`streamable`): parameters without a gradient, plain dense tensors that
fill their storage, large enough to be worth a copy, under one name in the module. A trainable
adapter inside the block (a LoRA's) stays resident and trains as it would.

The host is pinned memory on CUDA. On a CPU, where host and device are the same memory, the
weights stay in the storages they were loaded in: the exact CPU meter never counts memory
allocated before the step it meters, so a test measures the device-resident peak exactly, as
with the host tier's buffers (``host_tier.host_buffer``). Moving them would free storages made
before the meter started, whose frees the profiler counts or not depending on whether an
earlier profiling session saw their addresses.

The planner counts a streamed block's weights as off the device for the whole step except
inside the block's forward and its recompute-and-backward (``simulated_step``), and its budget
is against the parameters as loaded: the bytes the stream moved out come off a measured peak
(:attr:`HostWeights.moved_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_tbp.compat import FakeTensor
from lightning_tbp.memory.homes import home_of, set_home, take_home
from lightning_tbp.remat.host_tier import MIN_OFFLOAD_BYTES, host_buffer, host_use


def streamable(param: nn.Parameter) -> bool:
    """Whether a plan may stream ``param`` from the host: frozen, plain, dense, filling its storage."""
    return (
        not param.requires_grad
        # a plain parameter, or one a fake trace made (``tbp estimate``): not a quantized subclass
        and (type(param) is nn.Parameter or isinstance(param, FakeTensor))
        and param.layout == torch.strided
        and param.is_contiguous()
        and param.storage_offset() == 0
        and param.untyped_storage().nbytes() == param.numel() * param.element_size()
        and param.untyped_storage().nbytes() >= MIN_OFFLOAD_BYTES
        and param.device.type in ("cpu", "cuda")
    )


def frozen_weights(module: nn.Module, storage_id: Callable[[torch.Tensor], int | None]) -> dict[int, str]:
    """Streamable parameters of ``module`` by storage id (``storage_id``), with their names; a
    storage reached under two names (tied weights) is left out."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        sid = storage_id(param)
        if sid is not None:
            names.setdefault(sid, []).append(name)
            params[sid] = param
    return {sid: found[0] for sid, found in names.items() if len(found) == 1 and streamable(params[sid])}


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return root.get_submodule(path), attribute


class HostWeights:
    """The frozen weights of one module tree that live on the host: :meth:`place` moves a set
    there (and those no longer in it back), :meth:`shadow` copies a block's in for a call."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._placed: dict[str, nn.Parameter] = {}

    @property
    def moved_bytes(self) -> int:
        """Bytes of weights on the host now: off the device, against the parameters as loaded."""
        return sum(p.numel() * p.element_size() for p in self._placed.values())

    def place(self, names: Iterable[str]) -> None:
        """Keep exactly the weights ``names`` (relative to the root) on the host."""
        wanted = set(names)
        for name in [n for n in self._placed if n not in wanted]:
            self._bring_back(name)
        for name in wanted - self._placed.keys():
            owner, attribute = _owner(self.root, name)
            param = owner._parameters[attribute]
            assert isinstance(param, nn.Parameter)
            device = param.device
            nbytes = param.numel() * param.element_size()
            if device.type == "cpu":  # the weights stay where they were loaded (module doc), held by the tier
                host_use.allocated(nbytes)
            else:
                host = host_buffer(nbytes, device).view(param.dtype).view(param.shape)
                host.copy_(param.detach())
                param.data = host
            set_home(param, device)
            self._placed[name] = param

    def _bring_back(self, name: str) -> None:
        param = self._placed.pop(name)
        device = take_home(param)
        if device.type == "cpu":
            host_use.freed(param.numel() * param.element_size())
        else:
            param.data = param.detach().to(device, copy=True)

    def remove(self) -> None:
        for name in list(self._placed):
            self._bring_back(name)

    def shadow(self, block: nn.Module, names: Iterable[str]) -> list[tuple[nn.Module, str]]:
        """Copy the weights ``names`` (relative to ``block``) to the device they came from, each
        shadowing its parameter (an instance attribute of its module); returns what to unshadow."""
        shadowed: list[tuple[nn.Module, str]] = []
        try:
            for name in names:
                owner, attribute = _owner(block, name)
                param = owner._parameters[attribute]
                assert param is not None
                copy = torch.empty(param.shape, dtype=param.dtype, device=home_of(param) or param.device)
                copy.copy_(param.detach())
                owner.__dict__[attribute] = copy
                shadowed.append((owner, attribute))
        except BaseException:
            unshadow(shadowed)
            raise
        return shadowed


def unshadow(shadowed: list[tuple[nn.Module, str]]) -> None:
    """Drop the copies :meth:`HostWeights.shadow` put in place (whatever autograd saved of them stays)."""
    for owner, attribute in shadowed:
        owner.__dict__.pop(attribute, None)


def with_weights(
    call: Callable[..., Any], weights: HostWeights, block: nn.Module, names: tuple[str, ...]
) -> Callable[..., Any]:
    """``call`` run with ``block``'s streamed weights in (:meth:`HostWeights.shadow`): the
    function a streamed block's checkpoint runs, in the forward and again in its recompute (a
    recompute's early stop raises through it: the shadows go all the same)."""

    def streamed(*args: Any) -> Any:
        shadowed = weights.shadow(block, names)
        try:
            return call(*args)
        finally:
            unshadow(shadowed)

    return streamed
