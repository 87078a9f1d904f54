"""Which calls can share a plan: shape signatures, with or without the batch dimension.

By default a plan belongs to one exact signature (shapes, dtypes, devices of every tensor in the
call). Under Poisson sampling (DP) every step has its own batch size, and profiling each one
would cost more than the plan saves; there a plan is keyed by the signature *without* the batch
dimension and made once for a batch ceiling: peak memory grows with the batch, so the plan for
the ceiling fits every smaller batch. The inputs for that profile are the call's own samples
repeated up to the ceiling (zeros for an empty batch).
"""

from __future__ import annotations

import torch

from lightning_tbp.compat import tree_flatten, tree_unflatten

Signature = tuple


def input_signature(args: tuple, kwargs: dict) -> Signature:
    """Shapes, dtypes and devices of the tensors in a call, plus the call's structure."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors = tuple((tuple(t.shape), t.dtype, t.device.type) for t in leaves if isinstance(t, torch.Tensor))
    return (str(spec), tensors)


def batch_size_of(args: tuple, kwargs: dict) -> int | None:
    """The leading size of the call's first tensor with a dimension (None if it has none)."""
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return None


def _is_batched(tensor: torch.Tensor, batch: int | None) -> bool:
    return batch is not None and tensor.dim() > 0 and tensor.shape[0] == batch


def batch_free_signature(args: tuple, kwargs: dict) -> Signature:
    """``input_signature`` with the batch dimension dropped from every tensor that leads with it."""
    batch = batch_size_of(args, kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = tuple(
        (tuple(t.shape[1:]) if _is_batched(t, batch) else tuple(t.shape), t.dtype, t.device.type, _is_batched(t, batch))
        for t in leaves
        if isinstance(t, torch.Tensor)
    )
    return (str(spec), tensors)


def expand_batch(args: tuple, kwargs: dict, size: int) -> tuple[tuple, dict]:
    """The call with every batched tensor grown (or cut) to ``size`` samples by repeating its own."""
    batch = batch_size_of(args, kwargs)
    if batch is None:  # no tensor with a batch dimension
        return args, kwargs
    leaves, spec = tree_flatten((args, kwargs))

    def grow(leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor) or not _is_batched(leaf, batch):
            return leaf
        if batch == 0:
            return leaf.new_zeros((size, *leaf.shape[1:]))
        return leaf[torch.arange(size, device=leaf.device) % batch]

    return tree_unflatten([grow(leaf) for leaf in leaves], spec)
