"""``nn.Linear`` on inputs of any rank: every leading dimension after the batch is a position."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.privacy.layers import outer
from lightning_tbp.privacy.layers.registry import Grads, LayerHandler, register, trainable


class OuterProductHandler(LayerHandler):
    """Shared by layers whose weight gradient is ``Σ_t g_t a_tᵀ``: subclasses give the operands.

    The weight's per-sample algebra goes through ``weight_*`` methods a subclass may replace with
    kernels of its own layer (a convolution's weight-gradient kernel needs no unfolded input);
    the bias gradient is the output gradient summed over positions, for every such layer.
    """

    copies_operands = False
    """Whether building the operands copies the activations (a convolution unfolds its input)."""

    def operand_shapes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int]
    ) -> tuple[int, int, int, int, int]:
        """``(B, K, T, d, p)`` of the operands ``a: [B, K, T, d]``, ``g: [B, K, T, p]`` of a call
        whose input and output have the shapes ``x`` and ``output``."""
        batch = x[0]
        return batch, 1, math.prod(output) // (batch * output[-1]), x[-1], output[-1]

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        """``a: [B, K, T, d]`` and ``g: [B, K, T, p]`` (K groups) in float32."""
        raise NotImplementedError

    def per_sample_bias_grads(self, module: nn.Module, grad_output: Tensor) -> Tensor:
        """``[B, out]``: the output gradient summed over every position."""
        return grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1]).float().sum(dim=1)

    def ghost_cheaper(self, module: nn.Module, x: Sequence[int], output: Sequence[int]) -> bool:
        """The per-layer choice: ghost norm when 2T² < p·d, else the materialised gradient."""
        _, _, positions, in_features, out_features = self.operand_shapes(module, x, output)
        return 2 * positions * positions < in_features * out_features

    def workspace_bytes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int], flash: bool, device: torch.device
    ) -> tuple[int, int]:
        batch, groups, positions, in_features, out_features = self.operand_shapes(module, x, output)
        operands = 4 * batch * groups * positions * (in_features + out_features) if self.copies_operands else 0
        if flash:
            norms = operands + 2 * min(outer.FLASH_TILE_BYTES, 4 * batch * groups * in_features * out_features)
        elif self.ghost_cheaper(module, x, output):  # two Gram matrices and their product
            norms = operands + 3 * 4 * batch * groups * positions * positions
        else:  # materialised per-sample gradients and their squares
            norms = 2 * 4 * batch * groups * in_features * out_features
        return norms, 4 * batch * groups * positions * out_features  # the output gradient times the coefficients

    def norm_methods(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[str, ...]:
        ghost_first = self.ghost_cheaper(module, saved[0].shape, grad_output.shape)
        return (*(("ghost", "materialise") if ghost_first else ("materialise", "ghost")), "flash")

    def weight_norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        return outer.weight_norm_sq(*self.operands(module, saved, grad_output), method)

    def weight_per_sample(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Tensor:
        a, g = self.operands(module, saved, grad_output)
        return outer.per_sample_weight_grads(a, g).reshape(a.shape[0], *module.weight.shape)

    def weight_clipped_sum(
        self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor
    ) -> Tensor:
        a, g = self.operands(module, saved, grad_output)
        return outer.clipped_weight_sum(a, g, coef).reshape(module.weight.shape)

    def norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        params = trainable(module)
        total = grad_output.new_zeros(grad_output.shape[0], dtype=torch.float32)
        if "weight" in params:
            total += self.weight_norm_sq(module, saved, grad_output, method)
        if "bias" in params:
            total += self.per_sample_bias_grads(module, grad_output).square().sum(dim=1)
        return total

    def per_sample_grads(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Grads:
        params, grads = trainable(module), {}
        if "weight" in params:
            grads["weight"] = self.weight_per_sample(module, saved, grad_output)
        if "bias" in params:
            grads["bias"] = self.per_sample_bias_grads(module, grad_output)
        return grads

    def clipped_sum(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor) -> Grads:
        params, grads = trainable(module), {}
        if "weight" in params:
            grads["weight"] = self.weight_clipped_sum(module, saved, grad_output, coef)
        if "bias" in params:
            grads["bias"] = coef @ self.per_sample_bias_grads(module, grad_output)
        return grads


@register(nn.Linear)
class LinearHandler(OuterProductHandler):
    def row_features(self, module: nn.Module) -> tuple[int, int]:
        return 1, 1

    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        bias = None if module.bias is None else module.bias.detach()
        return F.linear(x, module.weight.detach(), bias), (x,)

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        (x,) = saved
        batch = x.shape[0]
        a = x.reshape(batch, 1, -1, x.shape[-1]).float()
        g = grad_output.reshape(batch, 1, -1, grad_output.shape[-1]).float()
        return a, g
