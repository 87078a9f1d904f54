"""The ``tbp`` command.

- ``tbp fit|validate|test|predict -c configs/X.yaml [--trainer.strategy=tiny_backprop]
  [--trainer.callbacks+=MemoryProfilerCallback] [--print_config]``: Lightning's CLI over any
  LightningModule and LightningDataModule (``class_path`` in the config), with lightning_tbp's
  strategies registered and its callbacks importable by short name.
- ``tbp estimate -c configs/X.yaml [--device-memory 24GiB] [--device cuda|cpu] [--json PATH]
  [any LightningCLI override]``: one training step's device memory under fake tensors (no data,
  no weights allocated), whether it fits and the plan that does (``lightning_tbp.estimate``).
- ``tbp report RUN_JSON... [--out DIR]``: compare run records written by
  ``MemoryProfilerCallback`` (or the benchmarks): plots and a ``summary.txt``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_tbp.lightning_cli import run_lightning_cli
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


def _estimate(argv: Sequence[str]) -> int:
    from lightning_tbp.estimate import (
        EstimateConfigError,
        StepNeedsValuesError,
        estimate_config,
        estimate_dict,
        format_estimate,
    )
    from lightning_tbp.remat.budget import parse_budget

    parser = argparse.ArgumentParser(
        prog="tbp estimate",
        description="estimate one training step's device memory; other arguments go to the LightningCLI config",
    )
    parser.add_argument("--device-memory", help="device size to fit: bytes or a size such as 24GiB or 80GB")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="device modelled (default: the config's trainer.accelerator: cpu for cpu, else cuda)",
    )
    parser.add_argument("--json", type=Path, help="also write the estimate as JSON here")
    parser.add_argument(
        "--no-minimum", action="store_true", help="skip the smallest device with a plan (a solver run; faster)"
    )
    args, config_args = parser.parse_known_args(argv)
    memory = None
    if args.device_memory is not None:
        budget = parse_budget(int(args.device_memory) if args.device_memory.isdigit() else args.device_memory)
        if budget.kind != "bytes":
            parser.error(f"--device-memory {args.device_memory!r}: give bytes or a size such as 24GiB")
        memory = int(budget.value)
    try:
        estimate = estimate_config(config_args, device=args.device, device_memory=memory, minimum=not args.no_minimum)
    except (EstimateConfigError, StepNeedsValuesError) as error:
        print(f"tbp estimate: {error}", file=sys.stderr)
        return 2
    print(format_estimate(estimate))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(estimate_dict(estimate), indent=2))
        print(f"written: {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "report":
        return _report(words[1:])
    if words and words[0] == "estimate":
        return _estimate(words[1:])
    run_lightning_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
