"""The ``tbp`` command.

``tbp report RUN_JSON... [--out DIR]`` compares run records written by
``MemoryProfilerCallback`` (or the benchmarks): plots and a ``summary.txt``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_tbp.memory.report import compare_runs


def _report(args: argparse.Namespace) -> int:
    try:
        files = compare_runs(args.runs, args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"tbp report: {error}", file=sys.stderr)
        return 2
    print(files.summary.read_text())
    print(f"written: {files.breakdown}, {files.timeline}, {files.tradeoff}, {files.summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tbp", description="lightning-tbp command line")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="compare memory run records (memory_rank*.json)")
    report.add_argument("runs", nargs="+", type=Path, help="run record JSON files; the first is the baseline")
    report.add_argument(
        "--out", type=Path, default=Path("memory_report"), help="output directory (default: %(default)s)"
    )
    report.set_defaults(handler=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
