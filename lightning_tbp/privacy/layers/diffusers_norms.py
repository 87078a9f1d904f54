"""diffusers' own ``RMSNorm`` (the q/k norms of SD3, Flux and Sana, ``qk_norm="rms_norm"``).

It normalises over the last dimension in float32, casts to the weight's dtype when that is half
precision, then scales (and shifts); the handler repeats exactly those steps, so its normalised
input is the one the weight multiplies.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import RMSNorm
from torch import Tensor, nn

from lightning_tbp.privacy.layers.normalization import TrailingNormHandler
from lightning_tbp.privacy.layers.registry import register


@register(RMSNorm)
class DiffusersRMSNormHandler(TrailingNormHandler):
    def normalized_shape(self, module: nn.Module) -> tuple[int, ...]:
        return tuple(module.dim)

    def normalise(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + module.eps)
        return self._cast(module, x * rstd), (x, rstd)

    def rebuild(self, module: nn.Module, saved: tuple[Tensor, ...]) -> Tensor:
        x, rstd = saved
        return self._cast(module, x.float() * rstd.float()).float()

    @staticmethod
    def _cast(module: nn.Module, normalised: Tensor) -> Tensor:
        """The weight multiplies the normalised input cast to its dtype where that is half precision."""
        if module.weight is not None and module.weight.dtype in (torch.float16, torch.bfloat16):
            return normalised.to(module.weight.dtype)
        return normalised
