"""lightning-tbp: train and fine-tune diffusion models in far less memory with PyTorch Lightning.

``import lightning_tbp`` registers the ``"tiny_backprop"`` strategies with Lightning (one device,
``_ddp``, ``_ddp_spawn``, ``_fsdp``, ``_fsdp2``);
``MemoryProfilerCallback`` reports where a training step's memory goes.
"""

from lightning_tbp.callbacks import MemoryProfilerCallback
from lightning_tbp.remat import InfeasibleBudgetError, NothingToPlanWarning, Plan, StallingPlanError, rematerialize
from lightning_tbp.strategies import (
    TinyBackpropDDPStrategy,
    TinyBackpropFSDP2Strategy,
    TinyBackpropFSDPStrategy,
    TinyBackpropStrategy,
    register_strategies,
)

register_strategies()

__all__ = [
    "InfeasibleBudgetError",
    "MemoryProfilerCallback",
    "NothingToPlanWarning",
    "Plan",
    "StallingPlanError",
    "TinyBackpropDDPStrategy",
    "TinyBackpropFSDP2Strategy",
    "TinyBackpropFSDPStrategy",
    "TinyBackpropStrategy",
    "rematerialize",
]
__version__ = "0.1.0"
