"""GroupNorm, LayerNorm and RMSNorm with affine parameters.

The forward normalises without the affine part and applies it by hand: each sample's weight
gradient is ``Σ g ⊙ x̂`` and its bias gradient ``Σ g`` over the non-parameter dimensions.
Per-sample gradients have the (small) parameter shape, so they are always materialised.

The normalised input ``x̂`` is not kept: it is an activation the size of the input, and plain
autograd keeps only the input and the per-row statistics for a norm's backward (on a video U-Net
keeping ``x̂`` made the DP step's forward 27 MiB heavier than the plain one, at 155 MiB). The tap
saves the input and the statistics, the tensors the norm's own backward holds anyway, and the
norm and clipped-sum computations rebuild ``x̂`` from them, in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.privacy.layers.registry import Grads, LayerHandler, register, trainable


class AffineNormHandler(LayerHandler):
    """``out = x̂ · weight + bias`` with ``weight``/``bias`` broadcast by ``affine_view``."""

    def normalise(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``x̂`` (differentiable in ``x``) and what rebuilds it: the input as the norm ran on it
        (first) and its statistics, tensors the norm's own backward keeps."""
        raise NotImplementedError

    def rebuild(self, module: nn.Module, saved: tuple[Tensor, ...]) -> Tensor:
        """``x̂`` in float32 from what ``normalise`` saved."""
        raise NotImplementedError

    def workspace_bytes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int], flash: bool, device: torch.device
    ) -> tuple[int, int]:
        norms, summed = super().workspace_bytes(module, x, output, flash, device)
        rebuilt = 2 * 4 * math.prod(x)  # x̂ rebuilt in float32, and its product with the output gradient
        return norms + rebuilt, summed + rebuilt

    def affine_view(self, module: nn.Module, x: Tensor) -> tuple[int, ...]:
        """The shape that broadcasts a parameter against ``x``."""
        raise NotImplementedError

    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        out, saved = self.normalise(module, x)
        shape = self.affine_view(module, x)
        if module.weight is not None:
            out = out * module.weight.detach().view(shape)
        if getattr(module, "bias", None) is not None:
            out = out + module.bias.detach().view(shape)
        return out, saved

    def norm_methods(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[str, ...]:
        return ("materialise",)

    def per_sample_grads(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Grads:
        shape = self.affine_view(module, saved[0])
        # dims the parameter broadcasts over; none when its shape covers every non-batch dim
        summed = [d for d in range(1, grad_output.dim()) if shape[d] == 1]
        g = grad_output.float()
        params, grads = trainable(module), {}

        def per_sample(y: Tensor, param: Tensor) -> Tensor:
            return (y.sum(dim=summed) if summed else y).reshape(-1, *param.shape)

        if "weight" in params:
            grads["weight"] = per_sample(g * self.rebuild(module, saved), params["weight"])
        if "bias" in params:
            grads["bias"] = per_sample(g, params["bias"])
        return grads

    def norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        grads = self.per_sample_grads(module, saved, grad_output)
        return sum(grad.flatten(1).square().sum(dim=1) for grad in grads.values())

    def clipped_sum(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor) -> Grads:
        grads = self.per_sample_grads(module, saved, grad_output)
        return {name: torch.tensordot(coef, grad, dims=1) for name, grad in grads.items()}


@register(nn.GroupNorm)
class GroupNormHandler(AffineNormHandler):
    def normalise(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        x = x.contiguous()  # as ``F.group_norm`` runs it (a no-op for the usual layouts)
        batch, channels, positions = x.shape[0], x.shape[1], math.prod(x.shape[2:])
        # the op ``F.group_norm`` runs, called directly for the statistics it returns: [N, groups]
        out, mean, rstd = torch.native_group_norm(
            x, None, None, batch, channels, positions, module.num_groups, module.eps
        )
        return out, (x, mean, rstd)

    def rebuild(self, module: nn.Module, saved: tuple[Tensor, ...]) -> Tensor:
        x, mean, rstd = saved
        grouped = x.float().reshape(x.shape[0], module.num_groups, -1)
        return ((grouped - mean.float().unsqueeze(-1)) * rstd.float().unsqueeze(-1)).reshape(x.shape)

    def affine_view(self, module: nn.Module, x: Tensor) -> tuple[int, ...]:
        return (1, x.shape[1]) + (1,) * (x.dim() - 2)


class TrailingNormHandler(AffineNormHandler):
    """Norms whose parameters cover the trailing dimensions of the input."""

    def normalized_shape(self, module: nn.Module) -> tuple[int, ...]:
        return tuple(module.normalized_shape)

    def affine_view(self, module: nn.Module, x: Tensor) -> tuple[int, ...]:
        shape = self.normalized_shape(module)
        return (1,) * (x.dim() - len(shape)) + shape

    def row_features(self, module: nn.Module) -> tuple[int, int]:
        features = len(self.normalized_shape(module))  # the parameters cover these; all before are positions
        return features, features


@register(nn.LayerNorm)
class LayerNormHandler(TrailingNormHandler):
    def normalise(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        # the op ``F.layer_norm`` runs, for its statistics: mean and rstd shaped [..., 1, ...]
        out, mean, rstd = torch.native_layer_norm(x, module.normalized_shape, None, None, module.eps)
        return out, (x, mean, rstd)

    def rebuild(self, module: nn.Module, saved: tuple[Tensor, ...]) -> Tensor:
        x, mean, rstd = saved
        return (x.float() - mean.float()) * rstd.float()


@register(nn.RMSNorm)
class RMSNormHandler(TrailingNormHandler):
    def normalise(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        dims = tuple(range(-len(module.normalized_shape), 0))
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps  # ``F.rms_norm``'s default
        with torch.no_grad():  # ``F.rms_norm`` returns no statistics: its rstd again, [..., 1, ...]
            rstd = torch.rsqrt(x.float().square().mean(dims, keepdim=True) + eps)
        return F.rms_norm(x, module.normalized_shape, None, module.eps), (x, rstd)

    def rebuild(self, module: nn.Module, saved: tuple[Tensor, ...]) -> Tensor:
        x, rstd = saved
        return x.float() * rstd
