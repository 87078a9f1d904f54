"""GroupNorm, LayerNorm and RMSNorm with affine parameters.

The forward normalises without the affine part and applies it by hand, so the normalised input
``x̂`` is what gets saved: each sample's weight gradient is ``Σ g ⊙ x̂`` and its bias gradient
``Σ g`` over the non-parameter dimensions. Per-sample gradients have the (small) parameter
shape, so they are always materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.privacy.layers.registry import Grads, LayerHandler, register, trainable


class AffineNormHandler(LayerHandler):
    """``out = x̂ · weight + bias`` with ``weight``/``bias`` broadcast by ``affine_view``."""

    def normalise(self, module: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    def affine_view(self, module: nn.Module, x: Tensor) -> tuple[int, ...]:
        """The shape that broadcasts a parameter against ``x``."""
        raise NotImplementedError

    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        normalised = self.normalise(module, x)
        shape = self.affine_view(module, x)
        out = normalised
        if module.weight is not None:
            out = out * module.weight.detach().view(shape)
        if getattr(module, "bias", None) is not None:
            out = out + module.bias.detach().view(shape)
        return out, (normalised,)

    def norm_methods(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[str, ...]:
        return ("materialise",)

    def per_sample_grads(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Grads:
        (normalised,) = saved
        shape = self.affine_view(module, normalised)
        # dims the parameter broadcasts over; none when its shape covers every non-batch dim
        summed = [d for d in range(1, grad_output.dim()) if shape[d] == 1]
        g = grad_output.float()
        params, grads = trainable(module), {}

        def per_sample(x: Tensor, param: Tensor) -> Tensor:
            return (x.sum(dim=summed) if summed else x).reshape(-1, *param.shape)

        if "weight" in params:
            grads["weight"] = per_sample(g * normalised.float(), params["weight"])
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
    def normalise(self, module: nn.Module, x: Tensor) -> Tensor:
        return F.group_norm(x, module.num_groups, None, None, module.eps)

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
    def normalise(self, module: nn.Module, x: Tensor) -> Tensor:
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)


@register(nn.RMSNorm)
class RMSNormHandler(TrailingNormHandler):
    def normalise(self, module: nn.Module, x: Tensor) -> Tensor:
        return F.rms_norm(x, module.normalized_shape, None, module.eps)
