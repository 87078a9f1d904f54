"""The tiny_backprop strategies for several devices: DDP, FSDP (CUDA) and FSDP2.

Each is Lightning's own strategy with :class:`TinyBackpropMixin` in front, so sharding,
launching, checkpoints and the fault handling of Lightning's launchers (a rank that raises takes
the others down) stay Lightning's. What changes:

* every rank plans its own shard of the batch and all adopt rank 0's plan (one
  ``all_gather_object`` per new input shape, which also reports an infeasible budget on any rank
  to all of them); the budget is per device, and memory held before the forward (sharded
  parameters, DDP buckets, optimizer state after the first step) is outside it;
* with ``dp=...`` under DDP the model is not wrapped in ``DistributedDataParallel``: the privacy
  engine writes each rank's clipped per-sample sum into ``.grad`` itself, so DDP's reducer would
  wait for gradients autograd never accumulates. The sums are all-reduced once per logical batch
  instead, after rank 0 alone added the noise, and divided by the global expected batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_tbp.compat import (
    broadcast_module_states,
    flatten_dense_tensors,
    make_data_parallel_only,
    unflatten_dense_tensors,
)
from lightning_tbp.memory.held import HeldMemory, local_bytes
from lightning_tbp.memory.meters import known_to_the_meter
from lightning_tbp.optim import OptimizerInBackward
from lightning_tbp.strategies.common import TinyBackpropMixin


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over all processes in place, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = flatten_dense_tensors(group)
        dist.all_reduce(flat)
        for tensor, summed in zip(group, unflatten_dense_tensors(flat, group), strict=True):
            tensor.copy_(summed)


class TinyBackpropDDPStrategy(TinyBackpropMixin, DDPStrategy):
    """DDP (one process per device) with the plan and, optionally, DP-SGD across ranks.

    Takes the options of :class:`~lightning_tbp.strategies.common.TinyBackpropMixin` and those of
    Lightning's ``DDPStrategy`` (``start_method``, ``find_unused_parameters``, ...).
    """

    strategy_name = "tiny_backprop_ddp"
    _gradients_final_when_accumulated = False  # each rank's local sums, before DDP's all-reduce

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.optimizer_in_backward is True and not self._ddp_kwargs.get("gradient_as_bucket_view"):
            # gradients as views of DDP's buckets (see _fused_step_blockers). LightningCLI passes
            # each of DDP's options at its default, so a False here is not necessarily the user's
            if "gradient_as_bucket_view" in self._ddp_kwargs:
                rank_zero_info(
                    "tiny_backprop_ddp: gradient_as_bucket_view=True, which optimizer_in_backward=True needs "
                    "(DDP would otherwise copy every bucket back into new gradients after the backward)"
                )
            self._ddp_kwargs["gradient_as_bucket_view"] = True

    @override
    def configure_ddp(self) -> None:
        if self.privacy is None:
            with known_to_the_meter(self.root_device):  # the buckets it makes, freed when it re-buckets
                super().configure_ddp()
            return
        assert self.model is not None
        broadcast_module_states(self.model)  # what DDP's constructor does: every rank starts from rank 0's weights

    @override
    def held_memory(self) -> HeldMemory:
        """DDP's gradient buckets besides (:meth:`communication_buffer_bytes`)."""
        return dataclasses.replace(super().held_memory(), gradient_buckets=self.communication_buffer_bytes())

    @override
    def communication_buffer_bytes(self) -> int:
        """DDP's gradient buckets: one flat copy of every gradient it reduces, made as it wraps the
        model and kept for the run. With ``gradient_as_bucket_view=True`` the gradients are views
        of them, and the step's gradients, which the plan counts too, make its prediction an upper
        bound by up to their size."""
        if not isinstance(self.model, DistributedDataParallel):
            return 0
        return reduced_gradient_bytes(self.model)

    @override
    def _gradient_sum(self) -> Callable[[list[torch.Tensor]], None] | None:
        return all_reduce_sum

    @override
    def _reduction_kind(self) -> str | None:
        return "ddp"

    @override
    def _fused_step_blockers(self) -> list[str]:
        if self.privacy is None and not self._ddp_kwargs.get("gradient_as_bucket_view", False):
            return [
                "DDP copies every bucket back into new gradients after the backward unless "
                "gradient_as_bucket_view=True (optimizer_in_backward=True sets it; with 'auto' pass it yourself)"
            ]
        return []

    @override
    def _announce_reduced_gradients(self, stepper: OptimizerInBackward) -> None:
        """DDP's communication hook: each bucket all-reduced as DDP's own hook does, then its
        parameters stepped on the reduced sums (views of the bucket) before the backward goes on."""
        if self._ddp_comm_hook is not None:
            raise ValueError(
                "optimizer_in_backward under tiny_backprop_ddp steps each bucket in its own communication hook, "
                "and DDP takes one: drop ddp_comm_hook, or train with optimizer_in_backward=False"
            )
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(stepper, _reduce_then_step)


def reduced_gradient_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of the gradients DDP reduces, which its buckets hold: those of its trainable
    parameters that it was not told to ignore."""
    ignored = ddp.parameters_to_ignore
    return sum(local_bytes(p) for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored)


def _reduce_then_step(stepper: OptimizerInBackward, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the bucket's mean over the processes, formed as DDP's default
    hook forms it, then each of its parameters stepped on its reduced gradient (a view of the
    bucket). The reduction is waited for here, in the backward's thread (on CUDA the wait orders
    the current stream after it; the host goes on), so the step runs where the backward does,
    never beside it in a communication thread. While the stepper is idle (``"auto"`` before it
    takes the step) this is DDP's own default hook, overlapped as usual."""
    if not stepper.enabled:
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default process group
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
        param.grad = grad
        stepper.gradient_done(param)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


# DDP checks a hook's annotations against the objects themselves; this module's are strings
_reduce_then_step.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class TinyBackpropFSDPStrategy(TinyBackpropMixin, FSDPStrategy):
    """FSDP (``FullyShardedDataParallel``, CUDA only) with the plan; use FSDP2 or DDP for DP."""

    strategy_name = "tiny_backprop_fsdp"
    host_tier_supported = False
    state_on_host_supported = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dp") is not None:
            raise ValueError("dp is not available with tiny_backprop_fsdp; use tiny_backprop_ddp")
        super().__init__(*args, **kwargs)

    @override
    def setup_environment(self) -> None:
        if self.root_device.type != "cuda":
            raise ValueError(
                f"tiny_backprop_fsdp (FSDP1) runs on CUDA devices only, not {self.root_device.type}; "
                "use tiny_backprop_fsdp2 (CPU with gloo, or GPUs) or tiny_backprop_ddp"
            )
        super().setup_environment()


def fsdp2_units(module: nn.Module) -> list[str]:
    """Paths of the units :func:`shard_blocks` shards besides ``module`` itself: the entries of
    its outermost ``ModuleList`` s, except an entry that the list's owner reaches into by index in
    its ``forward`` (diffusers' DiT computes its conditioning with
    ``self.transformer_blocks[0].norm1.emb`` before any block runs). FSDP2 unshards a unit's
    weights only around the unit's own forward, so a submodule called from outside it would meet
    sharded weights; such an entry stays in the root's unit."""
    paths: list[str] = []
    for name, child in module.named_modules():
        inside = any(name.startswith(f"{p}.") for p in paths)
        if isinstance(child, nn.ModuleList) and not inside:
            owner_path, _, attribute = name.rpartition(".")
            reached = _indices_reached_from_forward(module.get_submodule(owner_path), attribute, len(child))
            paths += [f"{name}.{i}" if name else str(i) for i in range(len(child)) if i not in reached]
    return paths


def _indices_reached_from_forward(owner: nn.Module, attribute: str, length: int) -> set[int]:
    """Entries of ``owner.<attribute>`` that ``owner``'s forward indexes with a literal
    (``self.blocks[0]``, ``self.blocks[-1]``); none where the source cannot be read."""
    try:
        source = inspect.getsource(type(owner).forward)
    except (OSError, TypeError):
        return set()
    found = re.findall(rf"self\.{re.escape(attribute)}\[\s*(-?\d+)\s*\]", source)
    return {int(index) % length for index in found if -length <= int(index) < length}


def shard_blocks(module: nn.Module, **fully_shard_kwargs: Any) -> list[str]:
    """FSDP2: ``fully_shard`` each entry of the outermost ``ModuleList`` s of ``module`` (the
    down/up stages of a U-Net, the blocks of a DiT), then ``module`` itself; returns the paths.

    One unit per stage or block keeps only one unsharded at a time (plus the root's small layers)."""
    from torch.distributed.fsdp import fully_shard

    paths = fsdp2_units(module)
    for path in paths:
        fully_shard(module.get_submodule(path), **fully_shard_kwargs)
    fully_shard(module, **fully_shard_kwargs)
    return paths


class _ShardingModelParallel(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` used for pure data parallelism, with FSDP2 applied by
    the strategy in the place Lightning gives parallelisation: the LightningModule's
    ``configure_model`` hook.

    Lightning calls ``configure_model`` after the process group and device mesh exist, inside the
    strategy's init contexts, and ``ModelParallelStrategy.setup`` then materialises, converts and
    moves the sharded model as usual. So at ``connect`` the module gets an instance-level
    ``configure_model`` that runs its own (if any) and then :meth:`apply_fsdp2`; ``teardown``
    removes it. Nothing of Lightning's set-up is repeated or replaced.
    """

    @override
    def setup_environment(self) -> None:
        make_data_parallel_only(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        own = model.configure_model

        def configure_model_then_shard() -> None:
            own()
            self.apply_fsdp2()

        # a plain function (not functools.wraps): Lightning calls the hook only when it sees it overridden
        model.configure_model = configure_model_then_shard  # type: ignore[method-assign]  # this instance's hook

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and "configure_model" in vars(module):
            del module.configure_model
        super().teardown()

    def apply_fsdp2(self) -> None:
        raise NotImplementedError


class TinyBackpropFSDP2Strategy(TinyBackpropMixin, _ShardingModelParallel):
    """FSDP2 (``fully_shard``) data parallelism with the plan, on GPUs or on CPU with gloo.

    The plan's target module is sharded per stage/block (see :func:`shard_blocks`) unless the
    LightningModule's ``configure_model`` already applied ``fully_shard``. Every trainable
    parameter must live in the target (parameters outside it would not be synchronised).
    ``reshard_after_forward``: FSDP2's option (True frees the unsharded weights after each
    unit's forward, at the cost of a second all-gather in the backward).
    """

    strategy_name = "tiny_backprop_fsdp2"
    # each rank's offloaded activations are its own; frozen weights are FSDP2's sharded DTensors,
    # which no plan streams (``host_weights.streamable``), and the host optimizer state steps
    # plain parameters
    state_on_host_supported = False

    def __init__(self, *args: Any, reshard_after_forward: bool = True, **kwargs: Any) -> None:
        if kwargs.get("dp") is not None:
            raise ValueError(
                "dp is not available with tiny_backprop_fsdp2 yet (the privacy engine needs plain "
                "parameters, FSDP2 shards them into DTensors); use tiny_backprop_ddp"
            )
        super().__init__(*args, **kwargs)
        self.reshard_after_forward = reshard_after_forward

    @override
    def _reduction_kind(self) -> str | None:
        return "fsdp2"

    @override
    def apply_fsdp2(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # the user's configure_model sharded it
        target, path = self.target_module()
        outside = [
            name
            for name, param in module.named_parameters()
            if param.requires_grad and not any(param is p for p in target.parameters())
        ]
        if outside:
            raise ValueError(
                f"tiny_backprop_fsdp2 shards {path or 'the LightningModule'} only, but these trainable "
                f"parameters live outside it and would not be synchronised: {', '.join(outside[:8])}; "
                "set target= to a module holding all of them, or shard in configure_model"
            )
        mesh = self.device_mesh["data_parallel"]
        shard_blocks(target, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
