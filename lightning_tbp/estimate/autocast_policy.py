"""CUDA autocast's float32 list, applied to an estimate's step traced under CPU autocast.

An estimate traces on fake CPU tensors, so ``bf16-mixed`` runs CPU autocast. The two autocasts
agree on what runs in the low precision (matmuls, convolutions, attention) but not on what runs
in float32: CUDA's list widens normalisations, softmax, losses, reductions and pointwise
exponentials and powers, where CPU autocast runs them in the dtype they get. On a U-Net that is
every group norm: its float32 output (and the SiLU after it, and the convolution's bf16 copy
of that) is what a CUDA step holds, and a 128² DDPM U-Net at batch 64 measured 1.69x its
CPU-autocast estimate on an H100 and an H200.

:class:`CudaFloat32Ops` is a torch function mode that, while CPU autocast is on, runs the
functions of CUDA autocast's float32 list (torch's documented list, "CUDA Ops that can autocast
to float32") as CUDA's autocast does: floating tensor arguments narrower than float32 cast to
float32, the function run with autocast off. Everything else (the low-precision list, the
promoting ops) is the same on both devices and left to CPU autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_tbp.remat.op_args import map_op_leaves

_T = torch.Tensor

#: CUDA autocast's float32 list as the Python functions a module calls to reach those ops.
CUDA_FLOAT32_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        # normalisations and activations
        F.group_norm,
        F.layer_norm,
        F.softmax,
        F.log_softmax,
        F.softmin,
        F.softplus,
        F.normalize,
        F.cosine_similarity,
        torch.softmax,
        torch.log_softmax,
        _T.softmax,
        _T.log_softmax,
        torch.group_norm,
        torch.layer_norm,
        # losses
        F.binary_cross_entropy_with_logits,
        F.cosine_embedding_loss,
        F.cross_entropy,
        F.hinge_embedding_loss,
        F.kl_div,
        F.l1_loss,
        F.margin_ranking_loss,
        F.mse_loss,
        F.multilabel_margin_loss,
        F.multi_margin_loss,
        F.nll_loss,
        F.poisson_nll_loss,
        F.smooth_l1_loss,
        F.soft_margin_loss,
        F.triplet_margin_loss,
        # reductions, exponentials, powers and the rest of the list
        torch.acos,
        torch.asin,
        torch.cosh,
        torch.sinh,
        torch.tan,
        torch.erfinv,
        torch.exp,
        torch.expm1,
        torch.log,
        torch.log10,
        torch.log1p,
        torch.log2,
        torch.pow,
        torch.prod,
        torch.reciprocal,
        torch.rsqrt,
        torch.sum,
        torch.cumsum,
        torch.cumprod,
        torch.norm,
        torch.dist,
        torch.cdist,
        torch.renorm,
        _T.acos,
        _T.asin,
        _T.cosh,
        _T.sinh,
        _T.tan,
        _T.erfinv,
        _T.exp,
        _T.expm1,
        _T.log,
        _T.log10,
        _T.log1p,
        _T.log2,
        _T.pow,
        _T.__pow__,
        _T.__rpow__,
        _T.__rtruediv__,
        _T.prod,
        _T.reciprocal,
        _T.rsqrt,
        _T.sum,
        _T.cumsum,
        _T.cumprod,
        _T.norm,
        _T.dist,
        _T.renorm,
    }
)

_NARROW = (torch.bfloat16, torch.float16)


def _widened(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in _NARROW else value


class CudaFloat32Ops(TorchFunctionMode):
    """While CPU autocast is on, the functions of :data:`CUDA_FLOAT32_FUNCTIONS` run in float32
    (see the module's docstring); otherwise every function runs as called."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in CUDA_FLOAT32_FUNCTIONS or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        args, kwargs = map_op_leaves(_widened, (args, kwargs))
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)
