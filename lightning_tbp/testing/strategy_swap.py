"""A pytest plugin that runs a test suite with ``strategy="tiny_backprop"`` as the default strategy.

Lightning's own tests (``tests/tests_pytorch``) are the acceptance test of a strategy: they count
``Tensor.backward`` and optimizer calls through class-level mocks, wrap ``Strategy.backward``, pickle
the Trainer after fit. Loaded with ``pytest -p lightning_tbp.testing.strategy_swap``, this plugin
makes every Trainer that would get Lightning's default single-device CPU strategy get
``tiny_backprop`` instead (a strategy, accelerator or device count the test chose is left alone),
so any suite, a user's own included, can be run under it unchanged. ``scripts/lightning_suite.py``
runs Lightning's suite both ways and compares.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning.pytorch as pl
import pytest

#: Trainer flags that mean "whatever Lightning picks"
_DEFAULTS = (None, "auto")


def swaps(kwargs: dict[str, Any]) -> bool:
    """Whether a Trainer made with ``kwargs`` would run Lightning's default strategy on one CPU
    (flags given as ``PL_TRAINER_*`` environment variables are the test's choice too)."""
    if any(f"PL_TRAINER_{flag}" in os.environ for flag in ("STRATEGY", "ACCELERATOR", "DEVICES", "NUM_NODES")):
        return False
    if kwargs.get("strategy", "auto") != "auto":
        return False
    if kwargs.get("accelerator", "auto") not in (*_DEFAULTS, "cpu"):
        return False
    if kwargs.get("num_nodes", 1) != 1:
        return False
    return kwargs.get("devices", "auto") in (*_DEFAULTS, 1, "1", [0])


def install() -> None:
    """Wrap ``lightning.pytorch.Trainer.__init__`` (once) so a default single-CPU Trainer gets ours."""
    trainer_init = pl.Trainer.__init__
    if getattr(trainer_init, "_tiny_backprop_swap", False):
        return
    import lightning_tbp  # noqa: F401  # registers the strategy name

    @functools.wraps(trainer_init)
    def init(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if swaps(kwargs):
            kwargs["strategy"] = "tiny_backprop"
        trainer_init(self, *args, **kwargs)

    init._tiny_backprop_swap = True  # type: ignore[attr-defined]
    pl.Trainer.__init__ = init  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    install()
