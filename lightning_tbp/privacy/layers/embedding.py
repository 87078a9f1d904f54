"""``nn.Embedding``: per-sample gradients are the output gradients scattered to the looked-up rows.

The ghost norm needs only which positions share an index: ``Σ_{t,s} [i_t = i_s] g_t·g_s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tbp.privacy.layers.registry import Grads, LayerHandler, UnsupportedLayerError, register


@register(nn.Embedding)
class EmbeddingHandler(LayerHandler):
    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                f"{type(module).__name__} with max_norm, sparse or scale_grad_by_freq couples samples or "
                "rewrites its weight in forward; per-sample clipping does not support it"
            )
        return F.embedding(x, module.weight.detach(), module.padding_idx), (x,)

    @staticmethod
    def _operands(module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[Tensor, Tensor]:
        (indices,) = saved
        batch = indices.shape[0]
        indices = indices.reshape(batch, -1)
        g = grad_output.float().reshape(batch, indices.shape[1], -1)
        if module.padding_idx is not None:
            g = g * (indices != module.padding_idx).unsqueeze(-1)
        return indices, g

    def norm_methods(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[str, ...]:
        return ("ghost", "materialise")

    def norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        if method == "materialise":
            return self.per_sample_grads(module, saved, grad_output)["weight"].flatten(1).square().sum(dim=1)
        indices, g = self._operands(module, saved, grad_output)
        same = (indices.unsqueeze(2) == indices.unsqueeze(1)).float()
        return (same * torch.matmul(g, g.transpose(1, 2))).sum(dim=(1, 2))

    def per_sample_grads(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Grads:
        indices, g = self._operands(module, saved, grad_output)
        grads = g.new_zeros(g.shape[0], module.num_embeddings, g.shape[2])
        return {"weight": grads.scatter_add_(1, indices.unsqueeze(-1).expand_as(g), g)}

    def row_features(self, module: nn.Module) -> tuple[int, int]:
        return 0, 1  # every index is a position to a lookup

    def workspace_bytes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int], flash: bool, device: torch.device
    ) -> tuple[int, int]:
        batch = x[0]
        positions = math.prod(x) // max(batch, 1)
        return 2 * 4 * batch * positions * positions, 4 * math.prod(output)  # ghost Gram and index mask

    def clipped_sum(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor) -> Grads:
        indices, g = self._operands(module, saved, grad_output)
        weighted = (g * coef.view(-1, 1, 1)).reshape(-1, g.shape[2])
        return {"weight": g.new_zeros(module.num_embeddings, g.shape[2]).index_add_(0, indices.flatten(), weighted)}
