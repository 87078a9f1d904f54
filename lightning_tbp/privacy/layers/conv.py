"""``nn.Conv1d`` / ``nn.Conv2d`` with any stride, padding (mode), dilation and groups.

Unfolding the (padded) input turns a convolution into a grouped Linear over output positions:
per group, the patch vectors are the activations and the output channels the features.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.compat import conv_explicit_padding, conv_forward
from lightning_tbp.privacy.layers.linear import OuterProductHandler
from lightning_tbp.privacy.layers.registry import register


@register(nn.Conv1d, nn.Conv2d)
class ConvHandler(OuterProductHandler):
    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        bias = None if module.bias is None else module.bias.detach()
        return conv_forward(module, x, module.weight.detach(), bias), (x,)

    def operands(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        (x,) = saved
        one_d = isinstance(module, nn.Conv1d)
        padding: tuple[int, ...] = module.padding if not isinstance(module.padding, str) else (0,) * x.dim()
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            # The same explicit padding the layer's own forward applies (torch computes it for 'same').
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, conv_explicit_padding(module), mode=mode)
            padding = (0,) * len(module.kernel_size)
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
        if one_d:
            x = x.unsqueeze(-2)
            kernel, dilation, padding, stride = (1, *kernel), (1, *dilation), (0, *padding), (1, *stride)
        patches = F.unfold(x.float(), kernel, dilation=dilation, padding=padding, stride=stride)
        batch, groups = x.shape[0], module.groups
        a = patches.view(batch, groups, patches.shape[1] // groups, -1).transpose(2, 3)
        g = grad_output.float().reshape(batch, groups, module.out_channels // groups, -1).transpose(2, 3)
        return a, g
