"""Lightning strategies that run the rematerialization plan; registered on ``import lightning_tbp``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_tbp.strategies.tiny_backprop import TinyBackpropStrategy


def register_strategies() -> None:
    """Make ``Trainer(strategy="tiny_backprop")`` work; idempotent."""
    if "tiny_backprop" not in StrategyRegistry:
        StrategyRegistry.register(
            TinyBackpropStrategy.strategy_name,
            TinyBackpropStrategy,
            description="One device; backward runs a planned rematerialization under a memory budget",
        )


__all__ = ["TinyBackpropStrategy", "register_strategies"]
