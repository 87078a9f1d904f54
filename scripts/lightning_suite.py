"""Lightning's own tests as the acceptance test of the tiny_backprop strategy.

    python scripts/lightning_suite.py PATH/TO/pytorch-lightning [--only default|tiny_backprop] [-k EXPR]

``PATH`` is a checkout (or ``git archive``) of Lightning's repository holding ``tests/tests_pytorch``,
ideally at the tag of the installed release. The script runs the modules below twice, each in
its own pytest process: with Lightning's default strategy, and with every default single-CPU
Trainer given ``strategy="tiny_backprop"`` (the pytest plugin
:mod:`lightning_tbp.testing.strategy_swap`). It prints the counts of both runs and every test
that passes with the default strategy and fails with ours, writes both junit files and a JSON
summary under ``--out`` and exits 1 where there is such a test. Lightning's test files are read
from the checkout, never copied here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: The parts of Lightning's suite that judge a strategy: the training loop, optimization, the
#: Trainer's flags, checkpointing, hooks and the tuner (paths under ``tests/``)
MODULES = (
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/loops",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/checkpointing",
    "tests_pytorch/trainer/connectors/test_callback_connector.py",
    "tests_pytorch/core/test_lightning_optimizer.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/tuner",
)
#: Left out: they download released checkpoints (no network here)
DESELECT = ("tests_pytorch/checkpointing/test_legacy_checkpoints.py",)

PLUGIN = "lightning_tbp.testing.strategy_swap"


def outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome in a junit file: passed, failed, error or skipped."""
    results: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = next((kind for kind in ("failure", "error", "skipped") if kind in kinds), "passed")
        results[name] = {"failure": "failed"}.get(outcome, outcome)
    return results


def run(checkout: Path, swapped: bool, junit: Path, extra: list[str]) -> float:
    """One pytest process over :data:`MODULES`; returns its wall time in seconds."""
    tests = checkout / "tests"
    command = [sys.executable, "-m", "pytest", *MODULES, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    command += [f"--ignore={path}" for path in DESELECT]
    if swapped:
        command += ["-p", PLUGIN]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    subprocess.run([*command, *extra], cwd=tests, env=env, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="Lightning's repository (holding tests/tests_pytorch)")
    parser.add_argument("--only", choices=("default", "tiny_backprop"), help="run one side only")
    parser.add_argument("--out", type=Path, default=Path("outputs/lightning_suite"))
    args, extra = parser.parse_known_args()
    if not (args.checkout / "tests" / "tests_pytorch").is_dir():
        parser.error(f"{args.checkout} holds no tests/tests_pytorch: pass the root of Lightning's repository")
    args.out.mkdir(parents=True, exist_ok=True)
    sides = [side for side in ("default", "tiny_backprop") if args.only in (None, side)]
    results, seconds = {}, {}
    for side in sides:
        junit = (args.out / f"{side}.xml").resolve()
        seconds[side] = run(args.checkout.resolve(), side == "tiny_backprop", junit, extra)
        results[side] = outcomes(junit)
    summary: dict[str, object] = {
        side: {
            "seconds": round(seconds[side], 1),
            "counts": {
                k: sum(v == k for v in results[side].values()) for k in ("passed", "failed", "error", "skipped")
            },
        }
        for side in sides
    }
    regressions: list[str] = []
    if len(sides) == 2:
        default, ours = results["default"], results["tiny_backprop"]
        regressions = sorted(
            name for name, outcome in default.items() if outcome == "passed" and ours.get(name) != "passed"
        )
        summary["passing_by_default_not_with_tiny_backprop"] = regressions
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for side in sides:
        print(f"{side}: {summary[side]}")  # type: ignore[index]
    if regressions:
        print(f"{len(regressions)} tests pass with the default strategy and not with tiny_backprop:")
        print("\n".join(f"  {name}" for name in regressions))
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
