"""Optimizer steps planned with the rest of the training step (see ``in_backward.py``)."""

from lightning_tbp.optim.in_backward import PER_PARAMETER, OptimizerInBackward, steps_per_parameter

__all__ = ["PER_PARAMETER", "OptimizerInBackward", "steps_per_parameter"]
