"""The optimizers a recipe can name, low-bit state included.

Low-bit optimizer state (torchao's ``AdamW8bit``/``AdamW4bit``: codes and a scale per block for
each parameter large enough to quantize) changes the numerics of training, so it is the user's
choice, never the planner's; the planner counts what the chosen optimizer keeps as it is
(``memory.held``). torchao is imported only when one of its optimizers is named, and its absence
is an error that says how to install it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch

from lightning_tbp.compat import step_unobserved, unset_fake_temporarily
from lightning_tbp.optional_imports import import_torchao

OptimizerName = Literal["adamw", "adamw8bit", "adamw4bit", "adafactor"]
OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "adamw8bit", "adamw4bit", "adafactor")

#: torchao's low-bit optimizers by recipe name: each keeps Adam's two moments per parameter.
_TORCHAO = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}


def make_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZER_NAMES`) over ``params``."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    if name in _TORCHAO:
        try:
            optim = import_torchao("torchao.optim")
        except ImportError as error:
            raise ImportError(
                f"optimizer={name!r} is torchao's {_TORCHAO[name]}, and torchao is not installed ({error}): "
                "pip install 'lightning-tbp[lowbit]' (or torchao), or choose optimizer='adamw'"
            ) from None
        cls = getattr(optim, _TORCHAO[name])
        _warm_code_books(cls)
        optimizer: torch.optim.Optimizer = cls(params, lr=lr, weight_decay=weight_decay)
        return optimizer
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_NAMES)}; got {name!r}")


def _warm_code_books(cls: Callable[..., torch.optim.Optimizer]) -> None:
    """One real eager step of ``cls`` on a probe large enough to quantize. torchao builds its
    quantization code book on first use with ``.tolist()`` and caches it; under ``tbp estimate``'s
    fake tensors, which have no values, that first use would fail, so it happens here on real ones."""
    with unset_fake_temporarily(), torch.compiler.set_stance("force_eager"):
        probe = torch.zeros(4096, requires_grad=True)
        probe.grad = torch.zeros(4096)
        step_unobserved(cls([probe]))


def is_low_bit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torchao's low-bit optimizers (per parameter, like AdamW)."""
    cls = type(optimizer)
    return cls.__module__.startswith("torchao.optim") and cls.__name__ in _TORCHAO.values()
