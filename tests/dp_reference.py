"""Reference per-sample clipping from ``torch.func`` (vmap of grad), for the DP exactness tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


def per_sample_grads(model: nn.Module, loss_fn: Callable[[nn.Module, dict], Tensor], batch: dict) -> dict[str, Tensor]:
    """``[B, *shape]`` per trainable parameter: ``loss_fn(model, one-sample batch)`` differentiated per sample."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def one(params: dict, sample: dict) -> Tensor:
        batched = {k: v.unsqueeze(0) for k, v in sample.items()}
        return loss_fn(lambda *a, **k: functional_call(model, (params, frozen, buffers), a, k), batched).squeeze(0)

    return vmap(grad(one), in_dims=(None, 0), randomness="same")(params, batch)


def per_sample_grads_looped(
    model: nn.Module, loss_fn: Callable[[nn.Module, dict], Tensor], batch: dict
) -> dict[str, Tensor]:
    """The same as :func:`per_sample_grads`, one backward per sample: for models ``vmap`` cannot
    run (Lumina 2 reads each caption's length from its mask with a data-dependent op). A parameter
    the sample's loss does not reach gets zeros."""
    size = len(next(iter(batch.values())))
    grads: dict[str, list[Tensor]] = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for i in range(size):
        model.zero_grad(set_to_none=True)
        loss_fn(model, {k: v[i : i + 1] for k, v in batch.items()}).sum().backward()
        for name, param in model.named_parameters():
            if param.requires_grad:
                grads[name].append(param.grad.clone() if param.grad is not None else torch.zeros_like(param))
    model.zero_grad(set_to_none=True)
    return {name: torch.stack(rows) for name, rows in grads.items()}


def clipped_sum(grads: dict[str, Tensor], max_grad_norm: float) -> tuple[dict[str, Tensor], Tensor]:
    """Opacus' clipping: ``Σ_i min(1, C / (‖∇_i‖ + 1e-6)) ∇_i``, and the per-sample norms."""
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    coef = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: torch.tensordot(coef, g, dims=1) for n, g in grads.items()}, norms


def clipped_at_median(grads: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor, float]:
    """Opacus' clipping with the threshold at the median per-sample norm, so that some samples are
    clipped and some not: the clipped sum, the per-sample norms, the threshold."""
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    threshold = float(norms.median())
    expected, _ = clipped_sum(grads, threshold)
    return expected, norms, threshold
