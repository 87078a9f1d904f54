"""An aten op's arguments and results, walked without torch's pytree.

The recorder looks at every op of the profiled forward several times (its tensors, what needs a
gradient, a stand-in of its arguments for timing): through ``torch.utils._pytree`` that was
half of the recording's time, since pytree dispatches on registered node types at every level.
An op's arguments are only ever tensors, scalars, and tuples, lists and dicts of them, and its
results tuples (``torch.return_types`` included), so three cases cover them. Module-level
inputs and outputs (user types, diffusers' output dataclasses) still go through pytree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def op_leaves(tree: object, into: list[Any] | None = None) -> list[Any]:
    """The leaves of an op's arguments or results, in pytree's order."""
    leaves: list[Any] = [] if into is None else into
    if isinstance(tree, tuple | list):
        for item in tree:
            op_leaves(item, leaves)
    elif isinstance(tree, dict):
        for item in tree.values():
            op_leaves(item, leaves)
    else:
        leaves.append(tree)
    return leaves


def op_tensors(tree: object) -> list[torch.Tensor]:
    """The tensors among :func:`op_leaves`."""
    return [leaf for leaf in op_leaves(tree) if isinstance(leaf, torch.Tensor)]


def map_op_leaves(function: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``function`` applied to each leaf, in :func:`op_leaves`' order; tuples,
    lists and dicts are rebuilt as their plain types (an op's arguments hold no others)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(map_op_leaves(function, item) for item in tree)
    if kind is dict:
        return {key: map_op_leaves(function, value) for key, value in tree.items()}
    return function(tree)
