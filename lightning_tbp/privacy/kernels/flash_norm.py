"""Triton kernel: per-sample squared norms of outer-product weight gradients, tile by tile.

For operands ``a: [B, K, T, d]`` and ``g: [B, K, T, p]`` each program owns one (sample, group)
and one ``BLOCK_P x BLOCK_D`` tile of that sample's weight gradient ``Σ_t g_t a_tᵀ``. It
accumulates the tile over T in registers, squares and sums it, and atomically adds the result
to the sample's norm: no TxT Gram matrix and no per-sample gradient ever reaches memory, and the
extra memory is the [B] output. On CPU the same kernel runs under ``TRITON_INTERPRET=1`` (the
tests check it there against the PyTorch paths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _flash_norm_kernel(
    a_ptr,
    g_ptr,
    out_ptr,
    groups,
    positions,
    in_features,
    out_features,
    stride_ab,
    stride_ak,
    stride_at,
    stride_ad,
    stride_gb,
    stride_gk,
    stride_gt,
    stride_gp,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    sample_group = tl.program_id(0)
    sample = sample_group // groups
    group = sample_group % groups
    rows = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    a_base = a_ptr + sample * stride_ab + group * stride_ak
    g_base = g_ptr + sample * stride_gb + group * stride_gk
    tile = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for start in range(0, positions, BLOCK_T):
        steps = start + tl.arange(0, BLOCK_T)
        g_tile = tl.load(
            g_base + steps[:, None] * stride_gt + rows[None, :] * stride_gp,
            mask=(steps[:, None] < positions) & (rows[None, :] < out_features),
            other=0.0,
        ).to(tl.float32)
        a_tile = tl.load(
            a_base + steps[:, None] * stride_at + cols[None, :] * stride_ad,
            mask=(steps[:, None] < positions) & (cols[None, :] < in_features),
            other=0.0,
        ).to(tl.float32)
        tile += tl.dot(tl.trans(g_tile), a_tile, input_precision="ieee")
    tl.atomic_add(out_ptr + sample, tl.sum(tile * tile))


def triton_flash_norm_sq(a: Tensor, g: Tensor, block_t: int = 32, block_p: int = 32, block_d: int = 32) -> Tensor:
    """``[B]`` squared norms of ``Σ_t g_t a_tᵀ`` per sample (summed over groups), by the fused kernel.

    Low-precision operands are read as they are and widened to fp32 tile by tile, so no fp32 copy
    of the activations is made.
    """
    batch, groups, positions, in_features = a.shape
    out_features = g.shape[3]
    out = torch.zeros(batch, dtype=torch.float32, device=a.device)
    grid = (batch * groups, triton.cdiv(out_features, block_p), triton.cdiv(in_features, block_d))
    _flash_norm_kernel[grid](
        a,
        g,
        out,
        groups,
        positions,
        in_features,
        out_features,
        *a.stride(),
        *g.stride(),
        BLOCK_T=block_t,
        BLOCK_P=block_p,
        BLOCK_D=block_d,
    )
    return out
