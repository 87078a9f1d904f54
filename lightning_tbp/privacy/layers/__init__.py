"""Per-layer per-sample gradient handlers, registered by layer type (one module per family)."""

from lightning_tbp.privacy.layers import conv, diffusers_norms, embedding, linear, normalization  # noqa: F401 (registers)
from lightning_tbp.privacy.layers.registry import (
    Grads,
    LayerHandler,
    UnsupportedLayerError,
    handler_for,
    register,
    supported_types,
    trainable,
)

__all__ = [
    "Grads",
    "LayerHandler",
    "UnsupportedLayerError",
    "handler_for",
    "register",
    "supported_types",
    "trainable",
]
