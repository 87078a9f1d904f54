"""Per-sample gradient algebra of layers whose weight gradient is a sum of outer products.

A Linear layer's (and, after unfolding, a convolution's) per-sample weight gradient is
``G_i = Σ_t g_it a_itᵀ`` over the T positions of sample i. Everything here works on operands
shaped ``a: [B, K, T, d]`` and ``g: [B, K, T, p]``, where K independent groups (a grouped
convolution's groups; 1 otherwise) share the batch. Three ways to get ``‖G_i‖²``:

- ghost: ``Σ_{t,s} (a_it·a_is)(g_it·g_is)`` from two TxT Gram matrices, cost ~ 2T² per sample;
- materialise: build ``G_i`` ([K, p, d] per sample), cost ~ p·d per sample;
- flash: build ``G_i`` a tile of output features at a time and keep only the running squared
  norm, so neither a TxT Gram nor a whole per-sample gradient ever exists.

All three return the same numbers up to float rounding; they differ in memory and time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

FLASH_TILE_BYTES = 16 * 2**20
"""Bytes of one flash tile of per-sample gradients (all samples together)."""


def ghost_is_cheaper(a: Tensor, g: Tensor) -> bool:
    """The per-layer choice: ghost norm when 2T² < p·d, else the materialised gradient."""
    positions, in_features, out_features = a.shape[2], a.shape[3], g.shape[3]
    return 2 * positions * positions < in_features * out_features


def per_sample_weight_grads(a: Tensor, g: Tensor) -> Tensor:
    """``[B, K, p, d]``: each sample's weight gradient."""
    return torch.einsum("bktp,bktd->bkpd", g, a)


def ghost_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    """``[B]``: squared norms of the weight gradients from Gram matrices, without building them."""
    if a.shape[2] == 1:
        return (a.square().sum(dim=(2, 3)) * g.square().sum(dim=(2, 3))).sum(dim=1)
    a_gram = torch.matmul(a, a.transpose(-1, -2))
    g_gram = torch.matmul(g, g.transpose(-1, -2))
    return (a_gram * g_gram).sum(dim=(1, 2, 3))


@functools.cache
def _triton_kernel() -> Callable[[Tensor, Tensor], Tensor] | None:
    try:
        from lightning_tbp.privacy.kernels.flash_norm import triton_flash_norm_sq
    except ImportError:
        return None
    return triton_flash_norm_sq


def flash_norm_sq(a: Tensor, g: Tensor, tile_bytes: int = FLASH_TILE_BYTES) -> Tensor:
    """``[B]``: squared norms of the weight gradients, one tile at a time.

    On CUDA with Triton, the fused kernel (tiles live in registers); elsewhere, tiles of output
    features of at most ``tile_bytes`` for all samples together.
    """
    kernel = _triton_kernel() if a.is_cuda else None
    if kernel is not None:
        return kernel(a, g)
    return chunked_flash_norm_sq(a, g, tile_bytes)


def chunked_flash_norm_sq(a: Tensor, g: Tensor, tile_bytes: int = FLASH_TILE_BYTES) -> Tensor:
    """The PyTorch path of ``flash_norm_sq``: per-sample gradient tiles over output features."""
    batch, groups, _, in_features = a.shape
    out_features = g.shape[3]
    per_feature = batch * groups * in_features * a.element_size()
    tile = max(1, min(out_features, tile_bytes // max(per_feature, 1)))
    total = a.new_zeros(batch)
    for start in range(0, out_features, tile):
        block = torch.einsum("bktp,bktd->bkpd", g[..., start : start + tile], a)
        total += block.square().sum(dim=(1, 2, 3))
    return total


def weight_norm_sq(a: Tensor, g: Tensor, method: str) -> Tensor:
    """``[B]`` squared per-sample weight-gradient norms by ``method`` (ghost/materialise/flash)."""
    if method == "ghost":
        return ghost_norm_sq(a, g)
    if method == "flash":
        return flash_norm_sq(a, g)
    return per_sample_weight_grads(a, g).square().sum(dim=(1, 2, 3))


def clipped_weight_sum(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """``[K, p, d]``: ``Σ_i coef_i G_i`` as one matmul, never per sample."""
    return torch.einsum("bktp,bktd->kpd", g * coef.view(-1, 1, 1, 1), a)


def per_sample_bias_grads(g: Tensor) -> Tensor:
    """``[B, K·p]``: each sample's bias gradient (the output gradient summed over positions)."""
    return g.sum(dim=2).flatten(1)
