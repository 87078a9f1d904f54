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

    def normalise(self, module: nn.Module, x: Tensor) -> Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normalised = x * torch.rsqrt(variance + module.eps)
        if module.weight is not None and module.weight.dtype in (torch.float16, torch.bfloat16):
            normalised = normalised.to(module.weight.dtype)
        return normalised
