"""Differentially private training: per-sample clipping in four modes, noise, accounting.

``attach(module, mode=..., max_grad_norm=C, noise_multiplier=sigma)`` works on any plain PyTorch
module; the Lightning strategy builds on it.
"""

from lightning_tbp.privacy.engine import BACKWARD_PASSES, MODES, STEP_PASSES, BufferStats, DPEngine, attach
from lightning_tbp.privacy.errors import CoverageError, PerSampleLossError
from lightning_tbp.privacy.layers import LayerHandler, UnsupportedLayerError, register, supported_types

__all__ = [
    "BACKWARD_PASSES",
    "MODES",
    "STEP_PASSES",
    "BufferStats",
    "CoverageError",
    "DPEngine",
    "LayerHandler",
    "PerSampleLossError",
    "UnsupportedLayerError",
    "attach",
    "register",
    "supported_types",
]
