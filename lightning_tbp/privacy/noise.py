"""DP-SGD's Gaussian noise, from one stream per parameter.

Each logical batch draws one seed from the engine's generator; each parameter's noise comes from
a generator of its own seeded from it and the parameter's index. What a parameter gets thus does
not depend on the order parameters are noised in: noising each as its clipped sum completes,
inside the backward, adds exactly the noise that noising all of them after it adds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_tbp.compat import FakeTensor, unset_fake_temporarily


class NoiseStreams:
    """The per-parameter noise streams of ``params`` (their order fixes each one's stream)."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._index = {id(param): index for index, param in enumerate(params)}
        self._seed: int | None = None

    def draw_seed(self, generator: torch.Generator | None) -> None:
        """Seed a logical batch's noise: one draw from ``generator`` (the global one if None)."""
        with unset_fake_temporarily():  # a real draw also where ``tbp estimate`` runs the step on fake tensors
            self._seed = int(torch.randint(0, 2**62, (), generator=generator))

    def add(self, param: nn.Parameter, std: float) -> None:
        """Add this logical batch's N(0, std²) noise to ``param``'s gradient (made if absent)."""
        if std == 0:
            return
        if self._seed is None:
            raise RuntimeError("draw a seed first: each logical batch's noise is seeded once")
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if isinstance(param, FakeTensor):  # ``tbp estimate``: shapes only, perhaps of a device this machine lacks
            noise = torch.randn(param.shape, device=param.device, dtype=torch.float32)
        else:
            stream = torch.Generator(device=param.device)
            stream.manual_seed((self._seed + self._index[id(param)]) % 2**63)
            noise = torch.randn(param.shape, generator=stream, device=param.device, dtype=torch.float32)
        param.grad.add_(noise.to(param.grad.dtype), alpha=std)
