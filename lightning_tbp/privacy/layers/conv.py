"""``nn.Conv1d`` / ``nn.Conv2d`` with any stride, padding (mode), dilation and groups.

Per-sample gradients come from the layer's own weight-gradient kernel, never from an unfolded
input (which is kernel-size times the input): the clipped sum is the ordinary weight gradient
with each sample's output gradient scaled by its coefficient, and per-sample gradients are that
kernel run with the batch folded into the groups. Only the ghost norm, chosen where positions
are few (2T² < p·d), unfolds: a convolution is then a grouped Linear over output positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.compat import conv_explicit_padding, conv_forward
from lightning_tbp.privacy.layers import outer
from lightning_tbp.privacy.layers.linear import OuterProductHandler
from lightning_tbp.privacy.layers.registry import register

_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight}


@register(nn.Conv1d, nn.Conv2d)
class ConvHandler(OuterProductHandler):
    copies_operands = True  # the ghost norm's unfold

    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        bias = None if module.bias is None else module.bias.detach()
        return conv_forward(module, x, module.weight.detach(), bias), (x,)

    def operand_shapes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int]
    ) -> tuple[int, int, int, int, int]:
        batch, groups = x[0], module.groups
        patch = module.in_channels // groups * math.prod(module.kernel_size)
        return batch, groups, math.prod(output[2:]), patch, module.out_channels // groups

    def bias_features(self, grad_output: Tensor) -> int:
        return grad_output.shape[1]

    def features_last(self, grad_output: Tensor) -> Tensor:
        return grad_output.flatten(2).transpose(1, 2)

    def _padded(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """The input with the padding the layer's own forward applies by hand, and what is left to the kernel."""
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            # The same explicit padding the layer's own forward applies (torch computes it for 'same').
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            return F.pad(x, conv_explicit_padding(module), mode=mode), (0,) * len(module.kernel_size)
        return x, module.padding

    def _weight_grad(self, module: nn.Module, x: Tensor, grad_output: Tensor, groups: int, shape: tuple) -> Tensor:
        x, padding = self._padded(module, x)
        kernel = _WEIGHT_GRAD[len(module.kernel_size)]
        return kernel(x.float(), shape, grad_output.float(), module.stride, padding, module.dilation, groups)

    def weight_clipped_sum(
        self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor
    ) -> Tensor:
        (x,) = saved
        weighted = grad_output.float() * coef.view(-1, *([1] * (grad_output.dim() - 1)))
        return self._weight_grad(module, x, weighted, module.groups, tuple(module.weight.shape))

    def weight_per_sample(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Tensor:
        (x,) = saved
        batch = x.shape[0]
        folded_x = x.reshape(1, -1, *x.shape[2:])  # the batch folded into the channels, one group per sample
        folded_g = grad_output.reshape(1, -1, *grad_output.shape[2:])
        shape = (batch * module.out_channels, *module.weight.shape[1:])
        grads = self._weight_grad(module, folded_x, folded_g, batch * module.groups, shape)
        return grads.view(batch, *module.weight.shape)

    def weight_norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        if method == "ghost" or (method == "flash" and grad_output.is_cuda):  # Gram matrices / the fused kernel
            return outer.weight_norm_sq(*self.operands(module, saved, grad_output), method)
        # materialised per-sample gradients; flash (elsewhere) keeps a tile of samples at a time
        (x,) = saved
        batch = x.shape[0]
        per_sample = module.weight.numel() * 4
        chunk = batch if method != "flash" else max(1, min(batch, outer.FLASH_TILE_BYTES // per_sample))
        norms = [
            self.weight_per_sample(module, (x[s : s + chunk],), grad_output[s : s + chunk]).flatten(1).square().sum(1)
            for s in range(0, batch, chunk)
        ]
        return torch.cat(norms)

    def workspace_bytes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int], flash: bool, device: torch.device
    ) -> tuple[int, int]:
        batch, groups, positions, in_features, out_features = self.operand_shapes(module, x, output)
        unfolded = 4 * batch * groups * positions * (in_features + out_features)
        per_sample = 4 * batch * module.weight.numel()
        if flash:  # tiles of samples on CPU; the fused kernel reads the unfolded operands on CUDA
            norms = unfolded if device.type == "cuda" else 2 * min(outer.FLASH_TILE_BYTES, per_sample)
        elif self.ghost_cheaper(module, x, output):
            norms = unfolded + 3 * 4 * batch * groups * positions * positions
        else:
            norms = 2 * per_sample
        return norms, 4 * math.prod(output)  # the output gradient times the coefficients

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        (x,) = saved
        one_d = isinstance(module, nn.Conv1d)
        x, padding = self._padded(module, x)
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
        if one_d:
            x = x.unsqueeze(-2)
            kernel, dilation, padding, stride = (1, *kernel), (1, *dilation), (0, *padding), (1, *stride)
        patches = F.unfold(x.float(), kernel, dilation=dilation, padding=padding, stride=stride)
        batch, groups = x.shape[0], module.groups
        a = patches.view(batch, groups, patches.shape[1] // groups, -1).transpose(2, 3)
        g = grad_output.float().reshape(batch, groups, module.out_channels // groups, -1).transpose(2, 3)
        return a, g
