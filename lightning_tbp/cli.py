"""The ``tbp`` command.

- ``tbp fit|validate|test|predict -c configs/X.yaml [--trainer.strategy=tiny_backprop]
  [--trainer.callbacks+=MemoryProfilerCallback] [--print_config]``: Lightning's CLI over any
  LightningModule and LightningDataModule (``class_path`` in the config), with lightning_tbp's
  strategies registered and its callbacks importable by short name.
- ``tbp report RUN_JSON... [--out DIR]``: compare run records written by
  ``MemoryProfilerCallback`` (or the benchmarks): plots and a ``summary.txt``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_tbp  # noqa: F401  (registers the strategies; makes the callbacks resolvable by name)
from lightning_tbp.memory.report import compare_runs


def _report(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tbp report", description="compare memory run records (memory_rank*.json)")
    parser.add_argument("runs", nargs="+", type=Path, help="run record JSON files; the first is the baseline")
    parser.add_argument(
        "--out", type=Path, default=Path("memory_report"), help="output directory (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        files = compare_runs(args.runs, args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"tbp report: {error}", file=sys.stderr)
        return 2
    print(files.summary.read_text())
    print(f"written: {files.breakdown}, {files.timeline}, {files.tradeoff}, {files.summary}")
    return 0


def run_lightning_cli(argv: Sequence[str] | None = None) -> LightningCLI:
    """Lightning's CLI in subclass mode: the config names the module and data classes.

    ``argv=None`` reads ``sys.argv`` (the console script); a list runs from Python (tests).
    """
    return LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if argv is None else list(argv),
        save_config_kwargs={"overwrite": True},
    )


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "report":
        return _report(words[1:])
    run_lightning_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
