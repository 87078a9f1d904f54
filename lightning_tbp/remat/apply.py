"""Execute a plan: wrap planned blocks in non-reentrant ``torch.utils.checkpoint``.

Each planned module gets an instance-level ``forward`` that calls the class ``forward`` under a
checkpoint; deleting that attribute restores the module exactly (its parameters, buffers,
state_dict and hooks are never touched). A wrapper reads its option from a shared table at
call time, so switching between plans cached for different input shapes costs nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_tbp.remat.simulate import Option


def _keep_heavy_ops(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective policy: keep what is expensive to recompute, recompute the rest."""
    from lightning_tbp.remat.flops import flop_count

    if op._overloadpacket in _HEAVY_PACKETS or flop_count(op, args, kwargs, None) > 0:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _heavy_packets() -> set[Any]:
    from torch.utils.flop_counter import flop_registry

    from lightning_tbp.remat.flops import FLOP_FORMULAS

    return set(flop_registry) | set(FLOP_FORMULAS)


_HEAVY_PACKETS = _heavy_packets()
_selective_context = functools.partial(create_selective_checkpoint_contexts, _keep_heavy_ops)


def _checkpointed_forward(module: nn.Module, options: Mapping[str, Option], path: str) -> Callable[..., Any]:
    original = type(module).forward.__get__(module)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        option = options.get(path, Option.KEEP)
        if option == Option.KEEP or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        extra = {"context_fn": _selective_context} if option == Option.SELECTIVE else {}
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    return forward


class InstalledWrappers:
    """Checkpoint wrappers on a module tree; ``remove()`` restores every module.

    ``options`` is shared with the owner and read at call time; ``ensure`` wraps the modules a
    new plan needs, and modules whose path is absent from ``options`` behave as unwrapped.
    """

    def __init__(self, root: nn.Module, options: Mapping[str, Option]) -> None:
        self.root = root
        self.options = options
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
        module.forward = _checkpointed_forward(module, self.options, path)
        self._wrapped[path] = module

    def remove(self) -> None:
        for module in self._wrapped.values():
            del module.forward
        self._wrapped.clear()
