"""``nn.Linear`` on inputs of any rank: every leading dimension after the batch is a position."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.privacy.layers import outer
from lightning_tbp.privacy.layers.registry import Grads, LayerHandler, register, trainable


class OuterProductHandler(LayerHandler):
    """Shared by layers whose weight gradient is ``Σ_t g_t a_tᵀ``: subclasses give the operands."""

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        """``a: [B, K, T, d]`` and ``g: [B, K, T, p]`` (K groups) in float32."""
        raise NotImplementedError

    def norm_methods(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[str, ...]:
        a, g = self.operands(module, saved, grad_output)
        cheaper = ("ghost", "materialise") if outer.ghost_is_cheaper(a, g) else ("materialise", "ghost")
        return (*cheaper, "flash")

    def norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        a, g = self.operands(module, saved, grad_output)
        params = trainable(module)
        total = a.new_zeros(a.shape[0])
        if "weight" in params:
            total += outer.weight_norm_sq(a, g, method)
        if "bias" in params:
            total += outer.per_sample_bias_grads(g).square().sum(dim=1)
        return total

    def per_sample_grads(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Grads:
        a, g = self.operands(module, saved, grad_output)
        params, grads = trainable(module), {}
        if "weight" in params:
            grads["weight"] = outer.per_sample_weight_grads(a, g).reshape(a.shape[0], *params["weight"].shape)
        if "bias" in params:
            grads["bias"] = outer.per_sample_bias_grads(g)
        return grads

    def clipped_sum(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor) -> Grads:
        a, g = self.operands(module, saved, grad_output)
        params, grads = trainable(module), {}
        if "weight" in params:
            grads["weight"] = outer.clipped_weight_sum(a, g, coef).reshape(params["weight"].shape)
        if "bias" in params:
            grads["bias"] = coef @ outer.per_sample_bias_grads(g)
        return grads


@register(nn.Linear)
class LinearHandler(OuterProductHandler):
    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        bias = None if module.bias is None else module.bias.detach()
        return F.linear(x, module.weight.detach(), bias), (x,)

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        (x,) = saved
        batch = x.shape[0]
        a = x.reshape(batch, 1, -1, x.shape[-1]).float()
        g = grad_output.reshape(batch, 1, -1, grad_output.shape[-1]).float()
        return a, g
