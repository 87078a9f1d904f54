"""Execute a plan: wrap planned blocks in non-reentrant ``torch.utils.checkpoint``.

Each planned module gets an instance-level ``forward`` that calls the class ``forward`` under a
checkpoint; deleting that attribute restores the module exactly (its parameters, buffers,
state_dict and hooks are never touched). A wrapper reads its option from a shared table at
call time, so switching between plans cached for different input shapes costs nothing.

A full checkpoint that no other planned block encloses is offered to the step's checkpoint
recorder, if one is registered for the module (a bookkeeping DP engine, ``replay.py``): the
recorder keeps the call to run it again after the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_tbp.compat import OpOverload, tree_flatten, tree_unflatten
from lightning_tbp.remat.lazy import lazy_recompute
from lightning_tbp.remat.ops import traits_of
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.replay import CheckpointedCall, inside_planned_block, recorder_for, recording, watch_outputs


class _CacheFirstHeavyOps:
    """Selective policy for one checkpointed call: cache the first ``limit`` heavy-op outputs.

    The recomputation stops at the block's last saved tensor (torch's early stop), which is often
    the *input* of the block's last conv, saved before that conv runs; heavy ops past that point
    are never re-run, so caching their outputs would only waste memory. The planner counts the
    heavy ops before the stop in its trace and passes that count here.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0

    def __call__(self, ctx: Any, op: OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if traits_of(op).heavy:
            self.seen += 1
            if self.seen <= self.limit:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(
    module: nn.Module, options: Mapping[str, Option], cache_limits: Mapping[str, int], path: str
) -> Callable[..., Any]:
    original = type(module).forward.__get__(module)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        option = options.get(path, Option.KEEP)
        if option == Option.KEEP or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if option == Option.LAZY:
            with lazy_recompute(), inside_planned_block():
                return original(*args, **kwargs)
        extra: dict[str, Any] = {}
        if option == Option.SELECTIVE:
            limit = cache_limits[path]
            extra["context_fn"] = lambda: create_selective_checkpoint_contexts(_CacheFirstHeavyOps(limit))
        call, tensors = _positional_call(original, args, kwargs)
        recorder = recorder_for(module) if option == Option.FULL else None
        recorded = CheckpointedCall.capture(path, call, tensors) if recorder is not None else None
        if recorded is None or recorder is None or not recorder.record_checkpoint(recorded):
            return checkpoint(call, *tensors, use_reentrant=False, preserve_rng_state=True, **extra)
        with recording(recorded):
            outputs = checkpoint(call, *tensors, use_reentrant=False, preserve_rng_state=True)
        return watch_outputs(recorded, outputs, recorder)

    return forward


def _positional_call(function: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Callable[..., Any], list]:
    """``function(*args, **kwargs)`` as a call that takes every tensor positionally.

    torch's non-reentrant checkpoint saves positional tensors as saved tensors (an enclosing
    checkpoint then drops them too), but its recomputation closure holds keyword arguments
    strongly until the block's backward, even under an enclosing checkpoint. diffusers calls
    attention blocks with keyword tensors, so nested plans would otherwise keep them all.
    """
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]  # no tensor captured

    def call(*tensors: torch.Tensor) -> Any:
        filled = list(template)
        for position, tensor in zip(positions, tensors, strict=True):
            filled[position] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        with inside_planned_block():  # also in the backward's recomputation, wherever it runs
            return function(*call_args, **call_kwargs)

    return call, [leaves[i] for i in positions]


class InstalledWrappers:
    """Checkpoint wrappers on a module tree; ``remove()`` restores every module.

    ``options`` (and, for selective blocks, ``cache_limits``: how many heavy-op outputs to cache)
    are shared with the owner and read at call time; ``ensure`` wraps the modules a new plan
    needs, and modules whose path is absent from ``options`` behave as unwrapped.
    """

    def __init__(self, root: nn.Module, options: Mapping[str, Option], cache_limits: Mapping[str, int]) -> None:
        self.root = root
        self.options = options
        self.cache_limits = cache_limits
        self._wrapped: dict[str, nn.Module] = {}

    def ensure(self, paths: Iterable[str]) -> None:
        missing = [p for p in paths if p not in self._wrapped]
        if not missing:
            return
        modules = dict(self.root.named_modules())
        for path in missing:
            self._wrap(modules[path], path)

    def _wrap(self, module: nn.Module, path: str) -> None:
        if "forward" in module.__dict__:
            raise RuntimeError(
                f"module {path!r} already has an instance-level forward (another wrapper?); "
                "lightning_tbp wraps modules by setting one and cannot stack on top of it"
            )
        module.forward = _checkpointed_forward(module, self.options, self.cache_limits, path)
        self._wrapped[path] = module

    def remove(self) -> None:
        for module in self._wrapped.values():
            del module.forward
        self._wrapped.clear()
