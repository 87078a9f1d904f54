"""Optimizer steps planned with the rest of the training step (see ``in_backward.py``)."""

from lightning_tbp.optim.in_backward import OptimizerInBackward

__all__ = ["OptimizerInBackward"]
