"""Lightning's CLI over any LightningModule and LightningDataModule, with lightning_tbp's strategies registered.

One place builds it, so that ``tbp fit``, ``tbp estimate`` (which builds a config's objects
without fitting) and the tests read a config the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_tbp  # noqa: F401  (registers the strategies; makes the callbacks resolvable by name)


def run_lightning_cli(argv: Sequence[str] | None = None, *, run: bool = True) -> LightningCLI:
    """Lightning's CLI in subclass mode: the config names the module and data classes.

    ``argv=None`` reads ``sys.argv`` (the console script); a list runs from Python (tests).
    ``run=False``: build the Trainer, module and datamodule from the config (no subcommand) and stop.
    """
    with warnings.catch_warnings():
        # ``tbp estimate ARGS`` hands LightningCLI the words after its own subcommand, which
        # ``sys.argv`` also holds: Lightning's warning against giving both does not apply.
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        return LightningCLI(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if argv is None else list(argv),
            save_config_kwargs={"overwrite": True},
            run=run,
        )
