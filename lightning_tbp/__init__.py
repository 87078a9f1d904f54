"""lightning-tbp: train and fine-tune diffusion models in far less memory with PyTorch Lightning.

``import lightning_tbp`` registers the ``"tiny_backprop"`` strategy with Lightning.
"""

from lightning_tbp.remat import InfeasibleBudgetError, NothingToPlanWarning, Plan, rematerialize
from lightning_tbp.strategies import TinyBackpropStrategy, register_strategies

register_strategies()

__all__ = ["InfeasibleBudgetError", "NothingToPlanWarning", "Plan", "TinyBackpropStrategy", "rematerialize"]
__version__ = "0.1.0"
