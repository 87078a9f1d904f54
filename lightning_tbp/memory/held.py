"""What training holds on a device outside the step: parameters and optimizer state.

A per-device budget in bytes is a promise about the whole device, but the rematerialization
plan only shapes the step (forward, backward, gradients). So the strategies subtract what is held
anyway: this process's parameters (its shards under FSDP2, EMA copies included) and the
optimizer state, including the state that does not exist yet. Torch's optimizers create their
state at the first ``step()``, after the plan was made for the first batch, so that part is
predicted: a throwaway copy of the optimizer (same class, same defaults) takes one step on a
small probe parameter, and every state tensor of the probe's size is one more copy of each
parameter. This works for any optimizer that keeps per-parameter state the size of the
parameter, with no table of optimizer classes to keep up to date.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tbp.memory.breakdown import state_tensors, tensor_bytes

_PROBE_NUMEL = 7  # an odd size no scalar state (step counters) can be mistaken for


@dataclass(frozen=True)
class HeldMemory:
    """Bytes held on one device outside the planned step."""

    parameters: int = 0
    optimizer_state: int = 0  # existing plus predicted
    optimizer_state_pending: int = 0  # of which the first optimizer step has yet to create

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_state


def held_memory(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> HeldMemory:
    """Parameters and optimizer state of ``module`` on ``device``, predicting state not made yet."""
    optimizers = list(optimizers)
    existing = tensor_bytes(module, optimizers, device)
    pending = sum(_pending_state_bytes(optimizer, device) for optimizer in optimizers)
    return HeldMemory(existing.parameters, existing.optimizer_state + pending, pending)


def _pending_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes the optimizer's first step will allocate for parameters that have no state yet."""
    stateless = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and not optimizer.state.get(p) and p.device.type == device.type
    ]
    if not stateless:
        return 0
    copies = state_copies_per_parameter(optimizer)
    return copies * sum(local_bytes(p) for p in stateless)


def state_copies_per_parameter(optimizer: torch.optim.Optimizer) -> int:
    """How many parameter-sized tensors this optimizer keeps per parameter (Adam 2, SGD with momentum 1).

    The probe is a vector, so an optimizer that factors the state of matrices (Adafactor) is
    counted as if it kept a full copy: an overestimate, which errs on the safe side."""
    probe = torch.zeros(_PROBE_NUMEL, requires_grad=True)
    probe.grad = torch.ones(_PROBE_NUMEL)
    # only what the constructor takes (AdamW's defaults hold a key its __init__ refuses); device-only
    # switches would refuse a CPU probe and do not change what state is kept
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    defaults.update({k: False for k in ("fused", "capturable") if defaults.get(k)})
    try:
        twin = type(optimizer)([probe], **defaults)
        twin.step()
    except Exception as error:  # an optimizer we cannot imitate: say so rather than guess
        warnings.warn(
            f"lightning_tbp: cannot predict the state of {type(optimizer).__name__} ({error}); "
            "the memory budget leaves no room for the optimizer state its first step creates",
            stacklevel=3,
        )
        return 0
    return sum(1 for t in state_tensors(twin.state.get(probe, {})) if t.numel() == _PROBE_NUMEL)


def local_bytes(param: torch.Tensor) -> int:
    """Bytes of this process's part of ``param``: its shard when FSDP2 sharded it into a DTensor
    (its gradient and optimizer state are shards too), all of it otherwise."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()
