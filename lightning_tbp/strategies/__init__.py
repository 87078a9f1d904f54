"""Lightning strategies that run the rematerialization plan; registered on ``import lightning_tbp``."""

from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_tbp.strategies.common import PlanAgreementError, TinyBackpropMixin
from lightning_tbp.strategies.distributed import (
    TinyBackpropDDPStrategy,
    TinyBackpropFSDP2Strategy,
    TinyBackpropFSDPStrategy,
)
from lightning_tbp.strategies.tiny_backprop import TinyBackpropStrategy

_STRATEGIES: tuple[tuple[str, type[Strategy], str, dict[str, Any]], ...] = (
    ("tiny_backprop", TinyBackpropStrategy, "One device", {}),
    ("tiny_backprop_ddp", TinyBackpropDDPStrategy, "DDP, processes started by re-running the script", {}),
    ("tiny_backprop_ddp_spawn", TinyBackpropDDPStrategy, "DDP, processes spawned", {"start_method": "spawn"}),
    ("tiny_backprop_fsdp", TinyBackpropFSDPStrategy, "FSDP (CUDA)", {}),
    ("tiny_backprop_fsdp2", TinyBackpropFSDP2Strategy, "FSDP2 fully_shard per block (CPU/gloo or GPUs)", {}),
)


def register_strategies() -> None:
    """Make ``Trainer(strategy="tiny_backprop")`` and the multi-device names work; idempotent."""
    for name, cls, where, defaults in _STRATEGIES:
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name, cls, description=f"{where}; backward runs a planned rematerialization", **defaults
            )


__all__ = [
    "PlanAgreementError",
    "TinyBackpropDDPStrategy",
    "TinyBackpropFSDP2Strategy",
    "TinyBackpropFSDPStrategy",
    "TinyBackpropMixin",
    "TinyBackpropStrategy",
    "register_strategies",
]
