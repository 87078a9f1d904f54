"""Where parameters whose data the host tier holds were loaded: the device their bytes count on;
and which optimizers' parameters keep their state on the host (it counts on no device).

A plan that streams a block's frozen weights (``remat/host_weights.py``) moves their data to
host memory, yet budgets stay against the parameters as loaded (a plan's peaks are counted
from there, its streamed bytes below it), so what training holds on a device
(``held.held_memory``) still counts them there. The registry is weak: a parameter that goes
away leaves it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

# by ``id``: tensors compare element-wise, so they cannot key a ``WeakKeyDictionary``
_HOMES: dict[int, tuple[weakref.ref[nn.Parameter], torch.device]] = {}


def set_home(param: nn.Parameter, device: torch.device) -> None:
    """``param``'s data moved to the host from ``device``."""
    key = id(param)
    _HOMES[key] = (weakref.ref(param, lambda _: _HOMES.pop(key, None)), device)


def take_home(param: nn.Parameter) -> torch.device:
    """``param``'s data goes back: the device it came from (it must have moved)."""
    device = home_of(param)
    assert device is not None, "the parameter's data is not on the host"
    del _HOMES[id(param)]
    return device


def loaded_device(param: torch.Tensor) -> torch.device:
    """The device ``param`` counts on: where it was loaded, also while the host tier holds its
    data (a step with streamed weights runs there, not on the host that holds them)."""
    return home_of(param) or param.device


def home_of(param: torch.Tensor) -> torch.device | None:
    """The device ``param`` was loaded on, if the host tier holds its data now (else None)."""
    entry = _HOMES.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


# per optimizer, the parameters (masters) whose state the host tier holds (``optim/host_state.py``)
_STATE_ON_HOST: dict[int, tuple[weakref.ref[torch.optim.Optimizer], frozenset[int]]] = {}


def set_state_home(optimizer: torch.optim.Optimizer, hosted: frozenset[int]) -> None:
    """The state of ``optimizer``'s parameters whose ids are ``hosted`` (their masters on the host)
    moved there with their step: it counts on no device."""
    key = id(optimizer)
    _STATE_ON_HOST[key] = (weakref.ref(optimizer, lambda _: _STATE_ON_HOST.pop(key, None)), hosted)


def take_state_home(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s parameters are the device's again."""
    _STATE_ON_HOST.pop(id(optimizer), None)


def hosted_state(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """Ids of ``optimizer``'s parameters whose state the host tier holds (none on a device)."""
    entry = _STATE_ON_HOST.get(id(optimizer))
    return entry[1] if entry is not None and entry[0]() is optimizer else frozenset()
