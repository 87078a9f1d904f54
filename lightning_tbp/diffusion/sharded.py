"""What a LightningModule does differently with weights FSDP2 sharded into DTensors.

Under ``tiny_backprop_fsdp2`` each rank holds a shard of every weight, and anything that reads
whole weights is a collective every rank must join: a forward (sampling a grid), a full state
dict (export). A copy of the weights kept beside them (an EMA) is kept as shards too, laid out
like the weights it follows, so its update stays elementwise and local.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters is a DTensor (FSDP2 sharded it)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def shard_like(copy: nn.Module, weights: nn.Module) -> None:
    """Make each plain parameter of ``copy`` whose namesake in ``weights`` is a DTensor a DTensor
    of that layout (a collective: every rank calls it, rank 0's values are kept). ``copy`` holds
    the same values on every rank (a copy made before sharding, from the same seed)."""
    live = dict(weights.named_parameters())
    for name, param in list(copy.named_parameters()):
        like = live.get(name)
        if not isinstance(like, DTensor) or isinstance(param, DTensor):
            continue
        owner_path, _, attribute = name.rpartition(".")
        owner = copy.get_submodule(owner_path)
        sharded = distribute_tensor(param.detach(), like.device_mesh, like.placements)
        setattr(owner, attribute, nn.Parameter(sharded, requires_grad=param.requires_grad))


def gathered_copy(model: nn.Module, build: Callable[[], nn.Module], is_writer: bool) -> nn.Module | None:
    """A plain module with ``model``'s whole weights (from ``build()``, the same structure
    unsharded) on the rank that writes, None on the others; every rank must call it (the weights
    are all-gathered), and the gathered state is on the CPU."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_writer:
        return None
    plain = build()
    plain.load_state_dict(state, assign=True)  # the gathered tensors themselves, in their dtype
    return plain
