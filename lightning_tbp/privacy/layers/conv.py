"""``nn.Conv1d`` / ``nn.Conv2d`` with any stride, padding (mode), dilation and groups.

Per-sample gradients come from the layer's own weight-gradient kernel, never from an unfolded
input (which is kernel-size times the input): the clipped sum is the ordinary weight gradient
with each sample's output gradient scaled by its coefficient, and per-sample gradients are that
kernel run with the batch folded into the groups. Only the ghost norm, chosen where positions
are few (2T² < p·d), unfolds: a convolution is then a grouped Linear over output positions.

A call on a video model's folded frames (``[batch·frames, C, ...]``) reaches the handler as
``[batch, frames, C, ...]`` (``row_features``): a sample's frames are more of its positions, so
per-sample gradients sum the kernel over frames one at a time and the ghost norm runs over
all its frames' positions.
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

    def row_features(self, module: nn.Module) -> tuple[int, int]:
        rank = len(module.kernel_size) + 1  # a row is channels by positions; rows are frames of a sample
        return rank, rank

    def operand_shapes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int]
    ) -> tuple[int, int, int, int, int]:
        batch, groups, frames = x[0], module.groups, _frames(module, x)
        patch = module.in_channels // groups * math.prod(module.kernel_size)
        positions = frames * math.prod(output[-len(module.kernel_size) :])
        return batch, groups, positions, patch, module.out_channels // groups

    def _by_frame(self, module: nn.Module, t: Tensor) -> Tensor:
        """``[batch, frames, C, *spatial]``: a call's tensor with each sample's frames in dim 1
        (one frame where the call's rows are the samples)."""
        return t if t.dim() == len(module.kernel_size) + 3 else t.unsqueeze(1)

    def per_sample_bias_grads(self, module: nn.Module, grad_output: Tensor) -> Tensor:
        g = self._by_frame(module, grad_output)
        return g.float().sum(dim=(1, *range(3, g.dim())))

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
        x, g = (self._by_frame(module, t) for t in (saved[0], grad_output))
        weighted = g.float() * coef.view(-1, *([1] * (g.dim() - 1)))  # one coefficient per sample
        shape = tuple(module.weight.shape)
        return self._weight_grad(module, x.flatten(0, 1), weighted.flatten(0, 1), module.groups, shape)

    def weight_per_sample(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Tensor:
        """The weight-gradient kernel with the batch folded into the groups, one frame at a time
        and summed: a sample's frames, like its positions, add to one gradient. Moving the frames
        into the kernel's batch instead would copy the whole input and output gradient; a frame at
        a time copies one frame (none where there is one), and per-row gradients would be
        ``frames`` times the per-sample ones."""
        x, g = (self._by_frame(module, t) for t in (saved[0], grad_output))
        batch = x.shape[0]
        shape = (batch * module.out_channels, *module.weight.shape[1:])
        total = None
        for frame in range(x.shape[1]):
            folded_x = x[:, frame].reshape(1, -1, *x.shape[3:])  # the batch folded into the channels
            folded_g = g[:, frame].reshape(1, -1, *g.shape[3:])
            grads = self._weight_grad(module, folded_x, folded_g, batch * module.groups, shape)
            total = grads if total is None else total.add_(grads)
            del grads
        return total.view(batch, *module.weight.shape)

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
        frames = _frames(module, x)
        # a folded call copies one frame of the input and output gradient for the kernel, and its
        # unfolded operands once more to put each sample's frames beside its positions
        frame_copy = 4 * (math.prod(x) + math.prod(output)) // frames if frames > 1 else 0
        if frames > 1:
            unfolded *= 2
        if flash:  # tiles of samples on CPU; the fused kernel reads the unfolded operands on CUDA
            norms = unfolded if device.type == "cuda" else 2 * min(outer.FLASH_TILE_BYTES, per_sample) + frame_copy
        elif self.ghost_cheaper(module, x, output):
            norms = unfolded + 3 * 4 * batch * groups * positions * positions
        else:
            norms = 2 * per_sample + frame_copy
        return norms, 4 * math.prod(output)  # the output gradient times the coefficients

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        x, g = (self._by_frame(module, t) for t in (saved[0], grad_output))
        batch, frames, groups = x.shape[0], x.shape[1], module.groups
        one_d = isinstance(module, nn.Conv1d)
        rows, padding = self._padded(module, x.flatten(0, 1))
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
        if one_d:
            rows = rows.unsqueeze(-2)
            kernel, dilation, padding, stride = (1, *kernel), (1, *dilation), (0, *padding), (1, *stride)
        patches = F.unfold(rows.float(), kernel, dilation=dilation, padding=padding, stride=stride)
        # [batch, groups, frames·positions, features]: a sample's frames are more of its positions
        a = patches.view(batch, frames, groups, -1, patches.shape[-1]).permute(0, 2, 1, 4, 3)
        g = g.float().reshape(batch, frames, groups, module.out_channels // groups, -1).permute(0, 2, 1, 4, 3)
        return a.flatten(2, 3), g.flatten(2, 3)


def _frames(module: nn.Module, shape: Sequence[int]) -> int:
    """How many frames of each sample a call holds: dim 1 of a merged folded call
    (``[batch, frames, C, *spatial]``, ``row_features``), else 1."""
    return shape[1] if len(shape) == len(module.kernel_size) + 3 else 1
