"""The table of layer types the DP engine can clip per sample, filled by ``@register``.

Each supported layer type gets one ``LayerHandler`` (one module per family, as Opacus lays out
``grad_sample/``). A handler knows three things about its layer: how to run the forward with
detached parameters and which tensors its per-sample gradients need, how to get per-sample
squared gradient norms (by the cheapest method its mode allows), and how to form the clipped
sum ``Σ_i c_i ∇_i`` directly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

Grads = dict[str, Tensor]
"""Parameter name (as in ``module.named_parameters(recurse=False)``) to a gradient tensor."""


class UnsupportedLayerError(TypeError):
    """A layer is used in a way per-sample clipping cannot support (it couples the samples of a
    batch, or rewrites its own weight in the forward)."""


class LayerHandler(ABC):
    """Per-sample clipping for one layer type. Stateless: one instance serves every module."""

    param_names: tuple[str, ...] = ("weight", "bias")
    """The layer's parameters this handler clips; any other trainable parameter the module owns
    is clipped through the ops that use it (see ``tracked.py``)."""

    @abstractmethod
    def forward(self, module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The layer's output computed with detached parameters, and the tensors to save.

        Parameters are detached so autograd computes only input gradients; the engine forms
        the parameter gradients itself. Saved tensors go through ``ctx.save_for_backward``, so
        checkpointing and saved-tensor hooks treat them like any other activation.
        """

    @abstractmethod
    def norm_methods(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> tuple[str, ...]:
        """The ways this layer can compute norms, preferred first ('ghost', 'materialise', 'flash')."""

    @abstractmethod
    def norm_sq(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, method: str) -> Tensor:
        """``[B]``: the squared norm of each sample's gradient over the layer's trainable parameters."""

    @abstractmethod
    def per_sample_grads(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor) -> Grads:
        """``[B, *shape]`` per trainable parameter: each sample's gradient."""

    @abstractmethod
    def clipped_sum(self, module: nn.Module, saved: tuple[Tensor, ...], grad_output: Tensor, coef: Tensor) -> Grads:
        """``Σ_i coef_i ∇_i`` per trainable parameter, in the parameter's shape."""

    def row_features(self, module: nn.Module) -> tuple[int, int] | None:
        """How many trailing dimensions of the saved input and of the output gradient make one row,
        where the layer's weight gradient sums over every dimension before them (a Linear's
        positions, a convolution's batch); None (the default) where the rows of dim 0 are not
        summed alike (a group norm's statistics are per row).

        A call whose dim 0 holds each sample's rows folded in (``k·batch`` rows, sample-major:
        ``coverage.rows_per_sample``) is then taken as ``[batch, k, ...rows]`` merged over the
        dimensions before the row, each sample's rows becoming more of its positions: the layer's
        usual norm (a ghost norm, or ``batch`` materialised gradients) instead of per-row
        gradients, ``k`` times larger, summed per sample. A Linear reads the merged call as it
        reads any input; a convolution takes the extra dimension as frames. Handlers that give it
        save tensors laid out as the input (statistics with size-1 feature dimensions), each
        merged alike."""
        return None

    def workspace_bytes(
        self, module: nn.Module, x: Sequence[int], output: Sequence[int], flash: bool, device: torch.device
    ) -> tuple[int, int]:
        """Transient bytes of (the per-sample norms, the clipped sum) for a call whose input and
        output have the shapes ``x`` and ``output`` (shapes, not tensors: the planner's profile
        must not run ops to price a layer), for the planner's model of a DP step. Default:
        per-sample gradients materialised, twice (the gradients and their squares), and the
        output gradient weighted by the coefficients."""
        per_sample = x[0] * sum(p.numel() * 4 for p in trainable(module).values())
        return 2 * per_sample, math.prod(output) * 4


_HANDLERS: dict[type[nn.Module], LayerHandler] = {}


def register(*layer_types: type[nn.Module]) -> Callable[[type[LayerHandler]], type[LayerHandler]]:
    """Class decorator: use this handler for ``layer_types`` (and subclasses that keep their forward)."""

    def decorate(handler_class: type[LayerHandler]) -> type[LayerHandler]:
        for layer_type in layer_types:
            _HANDLERS[layer_type] = handler_class()
        return handler_class

    return decorate


def supported_types() -> list[str]:
    return sorted(t.__name__ for t in _HANDLERS)


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The handler for ``module``, or None: no handler is registered for its type, or its class
    overrides the registered type's forward (the handler's derivation would not be its forward's)."""
    for layer_type in type(module).__mro__:
        handler = _HANDLERS.get(layer_type)
        if handler is not None:
            return handler if type(module).forward is getattr(layer_type, "forward", None) else None
    return None


def trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's own trainable parameters (not its children's)."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
