"""Execute a plan: wrap planned blocks in non-reentrant ``torch.utils.checkpoint`` (or run them
lazily, ``lazy.py``, with their saves offloaded to host memory, ``host_tier.py``, or with
their frozen weights streamed from it, ``host_weights.py``).

Each planned module gets an instance-level ``forward`` that calls the class ``forward`` under a
checkpoint; deleting that attribute restores the module exactly (its parameters, buffers,
state_dict and hooks are never touched). A wrapper reads its option from a shared table at
call time, so switching between plans cached for different input shapes costs nothing.

Plans decide per call (``trace.call_key``): a module that a step calls several times (a U-Net
in an unrolled sampling chain) has a decision per call, and each wrapper counts its module's
calls since the step began (:class:`CallCounts`). A recomputation runs a block's forward again,
and with it the wrappers inside; it first sets the counts back to what they were when the
block was first called, so the calls inside get the same keys as in the forward.

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
from torch.utils.hooks import RemovableHandle

from lightning_tbp.compat import OpOverload, tree_flatten, tree_unflatten
from lightning_tbp.remat.host_tier import Resident, offloaded_saves
from lightning_tbp.remat.host_weights import HostWeights, with_weights
from lightning_tbp.remat.lazy import lazy_recompute
from lightning_tbp.remat.ops import traits_of
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.replay import CheckpointedCall, inside_planned_block, recorder_for, recording, watch_outputs
from lightning_tbp.remat.trace import call_key, module_path


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


class CallCounts:
    """How often each wrapped module has been called since the step began: the key of its next
    call (``trace.call_key``). ``begin_step`` starts a step; a recomputation restores the counts
    it started from (``restore``) so the calls it repeats get the keys they had."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def begin_step(self) -> None:
        self._counts.clear()

    def next_key(self, path: str) -> str:
        call = self._counts.get(path, 0)
        self._counts[path] = call + 1
        return call_key(path, call)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def restore(self, snapshot: Mapping[str, int]) -> None:
        self._counts.clear()
        self._counts.update(snapshot)


def _checkpointed_forward(module: nn.Module, wrappers: InstalledWrappers, path: str) -> Callable[..., Any]:
    original = type(module).forward.__get__(module)
    options, counts = wrappers.options, wrappers.counts

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        key = counts.next_key(path)  # every call counts, planned or not, with gradients or without
        option = options.get(key, Option.KEEP)
        if option == Option.KEEP or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if option == Option.LAZY:  # recomputes ops, never a module call: the counts need no care
            with lazy_recompute(), inside_planned_block():
                return original(*args, **kwargs)
        if option == Option.OFFLOAD:  # no recompute either
            with offloaded_saves(wrappers.resident), inside_planned_block():
                return original(*args, **kwargs)
        extra: dict[str, Any] = {}
        if option == Option.SELECTIVE:
            limit = wrappers.cache_limits[key]
            extra["context_fn"] = lambda: create_selective_checkpoint_contexts(_CacheFirstHeavyOps(limit))
        call, tensors = _positional_call(original, args, kwargs, counts)
        if option == Option.STREAM:
            call = with_weights(call, wrappers.weights, module, wrappers.streamed[key])
        # a streamed block is a full checkpoint too: a replay runs ``call``, which copies its weights in again
        recorder = recorder_for(module) if option in (Option.FULL, Option.STREAM) else None
        recorded = CheckpointedCall.capture(key, call, tensors) if recorder is not None else None
        if recorded is None or recorder is None or not recorder.record_checkpoint(recorded):
            return checkpoint(call, *tensors, use_reentrant=False, preserve_rng_state=True, **extra)
        with recording(recorded):
            outputs = checkpoint(call, *tensors, use_reentrant=False, preserve_rng_state=True)
        return watch_outputs(recorded, outputs, recorder)

    return forward


def _positional_call(
    function: Callable[..., Any], args: tuple, kwargs: dict, counts: CallCounts
) -> tuple[Callable[..., Any], list]:
    """``function(*args, **kwargs)`` as a call that takes every tensor positionally, and that
    starts from the call counts of now each time it runs (a recomputation, a replay).

    torch's non-reentrant checkpoint saves positional tensors as saved tensors (an enclosing
    checkpoint then drops them too), but its recomputation closure holds keyword arguments
    strongly until the block's backward, even under an enclosing checkpoint. diffusers calls
    attention blocks with keyword tensors, so nested plans would otherwise keep them all.

    Some blocks write into the containers they are given: a video VAE's blocks (diffusers'
    ``AutoencoderKLWan``) store each chunk's last frames in a feature-cache list and advance an
    index list, which the next chunk's call reads. The forward's own run gets the caller's
    containers, so those writes happen as without a plan; a recomputation gets copies rebuilt as
    they were at the call (the tensors in them included), so it reads what the forward read and
    its writes go nowhere.
    """
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]  # no tensor captured
    started = counts.snapshot()
    forward_call = [(args, kwargs)]  # taken by the first run, so no tensor stays captured

    def call(*tensors: torch.Tensor) -> Any:
        counts.restore(started)
        if forward_call:
            call_args, call_kwargs = forward_call.pop()
        else:
            filled = list(template)
            for position, tensor in zip(positions, tensors, strict=True):
                filled[position] = tensor
            call_args, call_kwargs = tree_unflatten(filled, spec)
        with inside_planned_block():  # also in the backward's recomputation, wherever it runs
            return function(*call_args, **call_kwargs)

    return call, [leaves[i] for i in positions]


class InstalledWrappers:
    """Checkpoint wrappers on a module tree; ``remove()`` restores every module.

    ``options`` (and, for selective blocks, ``cache_limits``: how many heavy-op outputs to cache;
    for streamed blocks, ``streamed``: their weights' names in the block) are keyed by call
    (``trace.call_key``), shared with the owner and read at call time;
    ``ensure`` wraps the modules a new plan's keys name, and calls whose key is absent from
    ``options`` behave as unwrapped. Each call of ``root`` begins a step (:meth:`begin_step`):
    the trace a plan is made from is one call of it.
    """

    def __init__(
        self,
        root: nn.Module,
        options: Mapping[str, Option],
        cache_limits: Mapping[str, int],
        streamed: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.root = root
        self.options = options
        self.cache_limits = cache_limits
        self.streamed = streamed if streamed is not None else {}
        self.counts = CallCounts()
        self.resident = Resident()  # what offloaded blocks leave on the device (``host_tier.py``)
        self.weights = HostWeights(root)  # what streamed blocks keep on the host (``host_weights.py``)
        self._wrapped: dict[str, nn.Module] = {}
        self._root_hook: RemovableHandle | None = None

    def begin_step(self, inputs: Iterable[torch.Tensor] = ()) -> None:
        """A step's forward starts: its calls are counted from the first again, and, if the plan
        offloads, what the step did not make (parameters, buffers, the call's ``inputs``) is noted
        to stay on the device. Each call of the root does this; a caller that runs a wrapped
        block alone calls it itself."""
        self.counts.begin_step()
        if Option.OFFLOAD in self.options.values():
            self.resident.reset([*self.root.parameters(), *self.root.buffers(), *inputs])

    @property
    def hooked(self) -> bool:
        """Whether each call of the root begins a step by itself (its pre-hook is in place)."""
        return self._root_hook is not None

    def ensure(self, keys: Iterable[str]) -> None:
        missing = {module_path(k) for k in keys} - self._wrapped.keys()
        if not missing:
            return
        if self._root_hook is None:
            self._root_hook = self.root.register_forward_pre_hook(self._before_root, with_kwargs=True)
        modules = dict(self.root.named_modules())
        for path in missing:
            self._wrap(modules[path], path)

    def _before_root(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.begin_step(leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor))

    def _wrap(self, module: nn.Module, path: str) -> None:
        if "forward" in module.__dict__:
            raise RuntimeError(
                f"module {path!r} already has an instance-level forward (another wrapper?); "
                "lightning_tbp wraps modules by setting one and cannot stack on top of it"
            )
        module.forward = _checkpointed_forward(module, self, path)
        self._wrapped[path] = module

    def place_weights(self) -> None:
        """Keep on the host the weights of the blocks the options stream, and only those."""
        self.weights.place(
            f"{module_path(key)}.{name}" if module_path(key) else name
            for key, option in self.options.items()
            if option == Option.STREAM
            for name in self.streamed[key]
        )

    def remove(self) -> None:
        self.weights.remove()
        for module in self._wrapped.values():
            del module.forward
        self._wrapped.clear()
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None
