"""Where parameters whose data the host tier holds were loaded: the device their bytes count on;
and which optimizers keep their state on the host (it counts on no device).

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


def home_of(param: torch.Tensor) -> torch.device | None:
    """The device ``param`` was loaded on, if the host tier holds its data now (else None)."""
    entry = _HOMES.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


# optimizers whose state the host tier holds (``optim/host_state.py``), by ``id`` as above
_STATE_ON_HOST: dict[int, weakref.ref[torch.optim.Optimizer]] = {}


def set_state_home(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s state and step moved to the host: none of it counts on a device."""
    key = id(optimizer)
    _STATE_ON_HOST[key] = weakref.ref(optimizer, lambda _: _STATE_ON_HOST.pop(key, None))


def take_state_home(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s parameters are the device's again."""
    _STATE_ON_HOST.pop(id(optimizer), None)


def state_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the host tier holds ``optimizer``'s state (then no device holds any of it)."""
    entry = _STATE_ON_HOST.get(id(optimizer))
    return entry is not None and entry() is optimizer
