"""Part of the optimizer's state on the host: the least that a budget needs, largest first.

Keeping every parameter's state and step on the host (``optim/host_state.py``) frees the most
device memory, but every parameter then pays the host's step and copies, which on a slow host is
the "block swap" cliff. Where the budget needs only part of the state off the device, the
parameters with the most state go (the fewest steps for the bytes: each step has a fixed cost),
the others keep their state and step on the device, inside the backward. The plan weighs such
parts (the least, and larger ones) against the whole by predicted time (``Plan`` tries
``LoopAlternative.narrowed``): a part's step budget is smaller, so it may recompute more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_tbp.memory.held import HeldMemory, local_bytes, parameter_step_ratio
from lightning_tbp.optim.host_state import Hosting, fewest_to_host, hostings
from lightning_tbp.optim.step_cost import host_step_cost, in_backward_ns, in_backward_step_cost
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.remat.step import LoopAlternative, LoopModel


def part_on_host(
    optimizer: Optimizer,
    device: torch.device,
    planned: nn.Module,
    adopt: Callable[[list[torch.Tensor]], None],
    short: int,
) -> LoopAlternative | None:
    """The alternative that hosts the state of the fewest parameters of ``optimizer`` whose state
    takes ``short`` bytes off ``device``, the others stepped there; ``adopt(params)`` switches the
    run to it. None where only all of them would do (the whole alternative is that)."""
    candidates = hostings(optimizer)
    chosen = fewest_to_host(candidates, short)
    if chosen is None or len(chosen) == len(candidates):
        return None
    hosted = [h.param for h in chosen]
    chosen_ids = {id(p) for p in hosted}
    kept = [h.param for h in candidates if id(h.param) not in chosen_ids]
    names = {id(p): name for name, p in planned.named_parameters()}
    hosted_names = frozenset(names[id(p)] for p in hosted if id(p) in names)
    ratio = parameter_step_ratio([optimizer], device)
    host_ns = host_step_cost(optimizer, device).of(len(hosted), sum(local_bytes(p) for p in hosted))
    device_ns = in_backward_step_cost(optimizer, device).of(len(kept), sum(local_bytes(p) for p in kept))
    host_bytes = sum(h.host_bytes for h in chosen)
    freed, pending = _taken_off(chosen)

    def loop(base: LoopModel) -> LoopModel:
        return base.with_state_on_host(
            host_bytes, host_ns + device_ns, in_backward_ns(optimizer, device), hosted=(hosted_names, ratio)
        )

    def held(before: HeldMemory) -> HeldMemory:
        return dataclasses.replace(
            before,
            optimizer_state=before.optimizer_state - freed,
            optimizer_state_pending=max(0, before.optimizer_state_pending - pending),
        )

    return LoopAlternative(
        action=(
            f"the optimizer's state and step on the host for {len(hosted)} of its {len(candidates)} parameters, "
            f"those with the most state ({format_bytes(freed)} of it; host_tier)"
        ),
        loop=loop,
        adopt=lambda: adopt(hosted),
        held=held,
        host_tier=True,
    )


def _taken_off(chosen: list[Hosting]) -> tuple[int, int]:
    return sum(h.device_bytes for h in chosen), sum(h.pending_bytes for h in chosen)
