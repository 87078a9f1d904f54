"""Lazy recomputation of cheap op chains: the "lazy" block option.

Inside a lazy block, every tensor that autograd saves and that a cheap, deterministic op made
(a norm, an activation, an add, a copy, a view: ``ops.OpTraits.recomputable``) is stored as a *recipe*: the
op and its inputs, themselves recipes where possible, so a chain ``silu(group_norm(x))`` keeps
only ``x``. Unpacking (in the backward of the op that saved it) re-runs just that chain. Unlike a
checkpoint, nothing is recomputed ahead of time and no whole block is rebuilt at once: the
backward transient is one chain, not the block's saved set.

Recipes hold their leaf inputs (block inputs, matmul/conv outputs, parameters), so the block keeps
what a selective checkpoint keeps while dropping the large norm/activation outputs. In-place
changes to a leaf after it was recorded are detected through version counters, as autograd does.

``saved_tensors_hooks`` are innermost-wins: inside a torch checkpoint they would take the saves
the checkpoint needs to count, so the planner never puts a lazy block under a checkpoint.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_tbp.compat import TorchDispatchMode, tree_map, version_counter
from lightning_tbp.remat.ops import traits_of

#: Saved tensors smaller than this are kept as they are: rebuilding them would cost a whole op
#: (a group norm, to recover its per-group statistics) to save a few bytes.
MIN_LAZY_BYTES = 16 * 1024


class Recipe:
    """How to rebuild one tensor: ``func(*args, **kwargs)[index]`` with recipes resolved."""

    __slots__ = ("args", "func", "index", "kwargs", "versions")

    def __init__(self, func: Any, args: tuple, kwargs: dict, index: int) -> None:
        self.func, self.args, self.kwargs, self.index = func, args, kwargs, index
        self.versions = [(t, version_counter(t)) for t in _leaves((args, kwargs))]

    def materialise(self) -> torch.Tensor:
        for tensor, version in self.versions:
            if version_counter(tensor) != version:
                raise RuntimeError(
                    "lightning_tbp lazy recomputation: a tensor needed to rebuild a saved activation was "
                    "modified in place after the forward; plan this block as 'keep' or 'full' instead"
                )
        args, kwargs = tree_map(lambda a: a.materialise() if isinstance(a, Recipe) else a, (self.args, self.kwargs))
        with torch.no_grad():
            out = self.func(*args, **kwargs)
        return out[self.index] if isinstance(out, (tuple, list)) else out


def _leaves(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
        return x

    tree_map(visit, tree, is_leaf=lambda x: isinstance(x, Recipe))
    return found


class _RecipeRecorder(TorchDispatchMode):
    """Remembers, for each live output of a recomputable op, the recipe that rebuilds it."""

    def __init__(self) -> None:
        super().__init__()
        self.recipes: dict[int, tuple[weakref.ref, Recipe, int]] = {}

    def recipe_of(self, tensor: torch.Tensor) -> Recipe | None:
        """The recipe of ``tensor``, unless it (or a view of its storage) was changed in place since
        it was made: the recipe would rebuild the value before the change."""
        entry = self.recipes.get(id(tensor))
        if entry is None or entry[0]() is not tensor or version_counter(tensor) != entry[2]:
            return None
        return entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not traits_of(func).recomputable:
            return out
        # Inputs that are recipes themselves are referenced as recipes, so chains keep only leaves.
        rec_args, rec_kwargs = tree_map(
            lambda a: (self.recipe_of(a) or a) if isinstance(a, torch.Tensor) else a, (args, kwargs)
        )
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for index, tensor in enumerate(outputs):
            if isinstance(tensor, torch.Tensor):
                key = id(tensor)
                self.recipes[key] = (
                    weakref.ref(tensor),
                    Recipe(func, rec_args, rec_kwargs, index),
                    version_counter(tensor),
                )
                weakref.finalize(tensor, self.recipes.pop, key, None)
        return out


class lazy_recompute:
    """Context manager running a block's forward with lazily recomputed saved activations."""

    def __enter__(self) -> lazy_recompute:
        self._recorder = _RecipeRecorder()

        def pack(tensor: torch.Tensor) -> Any:
            if tensor.numel() * tensor.element_size() < MIN_LAZY_BYTES:
                return tensor
            return self._recorder.recipe_of(tensor) or tensor

        def unpack(saved: Any) -> torch.Tensor:
            return saved.materialise() if isinstance(saved, Recipe) else saved

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._recorder.__exit__(*exc)
        self._hooks.__exit__(*exc)
        # Packed recipes belong to autograd's saved variables now; the table would only keep the
        # inputs of the block's outputs (e.g. of its residual add) alive for no use.
        self._recorder.recipes.clear()
