"""One command for a reviewer: lint, the tests, the small-profile benchmarks, thresholds.

    bash scripts/dev.sh verify                          # all of it, on CPU or GPU
    python benchmarks/verify.py --skip-tests            # lint and benchmarks only
    python benchmarks/verify.py --config my_limits.yaml --out outputs/verify

``verify.yaml`` (next to this file) says which benchmarks run, with which arguments, and which
checks their JSON must pass. A check selects rows of one benchmark's result (``select``: every
key must match, e.g. ``{mode: tbp:lowest}``), takes ``metric`` from each, optionally divides it
by the same metric of the row of mode ``relative_to`` at the same batch and size, and
compares with ``max`` and/or ``min``. Every selected row must pass, at least one must exist,
and an errored row fails. ``summary.json`` in ``--out`` records each step (command, exit code,
seconds) and each check (values, limits, verdict); the exit code is 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lightning_tbp.environment import machine_info  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "verify.yaml"
SETTING_KEYS = ("batch", "size")  # a row and its relative_to reference share these


@dataclass
class CheckResult:
    name: str
    benchmark: str
    select: dict[str, Any]
    metric: str
    relative_to: str | None
    max: float | None
    min: float | None
    values: list[float | None] = field(default_factory=list)
    passed: bool = False
    reason: str = ""


def load_config(path: Path) -> dict[str, Any]:
    """The YAML, with its structure checked so a typo fails before anything runs."""
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict) or not isinstance(config.get("benchmarks"), dict):
        raise ValueError(f"{path}: needs a 'benchmarks' mapping of script name to argument list")
    for name, arguments in config["benchmarks"].items():
        if not (Path(__file__).parent / f"{name}.py").exists():
            raise ValueError(f"{path}: no benchmark script benchmarks/{name}.py")
        if not isinstance(arguments, list):
            raise ValueError(f"{path}: the arguments of {name} must be a list")
    for check in config.get("checks", []):
        missing = {"name", "benchmark", "select", "metric"} - set(check)
        if missing:
            raise ValueError(f"{path}: check {check.get('name', check)!r} lacks {sorted(missing)}")
        if check["benchmark"] not in config["benchmarks"]:
            raise ValueError(f"{path}: check {check['name']!r} reads {check['benchmark']!r}, which is not run")
        if "max" not in check and "min" not in check:
            raise ValueError(f"{path}: check {check['name']!r} needs max and/or min")
        unknown = set(check) - {"name", "benchmark", "select", "metric", "relative_to", "max", "min"}
        if unknown:
            raise ValueError(f"{path}: check {check['name']!r} has unknown keys {sorted(unknown)}")
    return config


def evaluate(check: dict[str, Any], result: dict[str, Any] | None) -> CheckResult:
    """Apply one check to one benchmark's JSON result (None: the benchmark produced none)."""
    outcome = CheckResult(
        check["name"],
        check["benchmark"],
        check["select"],
        check["metric"],
        check.get("relative_to"),
        check.get("max"),
        check.get("min"),
    )
    if result is None:
        outcome.reason = f"{check['benchmark']} wrote no result"
        return outcome
    rows = [r for r in result["rows"] if all(r.get(k) == v for k, v in check["select"].items())]
    if not rows:
        outcome.reason = f"no row matches {check['select']}"
        return outcome
    failures = []
    for row in rows:
        value = _metric(row, check["metric"])
        if value is not None and outcome.relative_to is not None:
            reference = next((r for r in result["rows"] if _same_setting(r, row, outcome.relative_to)), None)
            base = None if reference is None else _metric(reference, check["metric"])
            value = None if not base else value / base
        outcome.values.append(value)
        if value is None:
            failures.append(f"{row['mode']}: {row.get('error') or 'no value'}")
        elif outcome.max is not None and value > outcome.max:
            failures.append(f"{row['mode']}: {value:.4g} > {outcome.max}")
        elif outcome.min is not None and value < outcome.min:
            failures.append(f"{row['mode']}: {value:.4g} < {outcome.min}")
    outcome.passed = not failures
    outcome.reason = "; ".join(failures)
    return outcome


def _metric(row: dict[str, Any], metric: str) -> float | None:
    return None if "error" in row else row.get(metric)


def _same_setting(candidate: dict[str, Any], row: dict[str, Any], mode: str) -> bool:
    """``candidate`` is the reference for ``row``: mode ``mode`` at the same batch and size."""
    return candidate.get("mode") == mode and all(candidate.get(k) == row.get(k) for k in SETTING_KEYS)


def run_step(name: str, command: list[str]) -> dict[str, Any]:
    print(f"== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    returncode = subprocess.run(command, cwd=ROOT).returncode
    step = {"name": name, "command": command, "returncode": returncode, "seconds": time.perf_counter() - start}
    print(f"== {name}: {'ok' if returncode == 0 else f'FAILED (exit {returncode})'} in {step['seconds']:.0f}s")
    return step


def read_result(directory: Path) -> dict[str, Any] | None:
    files = sorted(directory.glob("*.json"))
    return json.loads(files[0].read_text()) if len(files) == 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--out", type=Path, default=Path("outputs/verify"))
    parser.add_argument("--skip-lint", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except (OSError, ValueError, yaml.YAMLError) as error:
        parser.error(str(error))
    python = sys.executable
    steps = []
    if not args.skip_lint:
        steps.append(run_step("lint", [python, "-m", "ruff", "check", "."]))
        steps.append(run_step("format", [python, "-m", "ruff", "format", "--check", "."]))
    if not args.skip_tests:
        steps.append(run_step("tests", [python, "-m", "pytest", "-q", "-p", "no:warnings"]))
    results = {}
    for name, arguments in config["benchmarks"].items():
        out = (args.out / name).resolve()
        for stale in out.glob("*.json"):
            stale.unlink()
        steps.append(run_step(name, [python, f"benchmarks/{name}.py", *map(str, arguments), "--out", str(out)]))
        results[name] = read_result(out)
    checks = [evaluate(check, results[check["benchmark"]]) for check in config.get("checks", [])]
    passed = all(s["returncode"] == 0 for s in steps) and all(c.passed for c in checks)
    summary = {
        "experiment": "verify",
        "machine": machine_info(),
        "config": str(args.config),
        "steps": steps,
        "checks": [asdict(c) for c in checks],
        "passed": passed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    for check in checks:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}  {check.reason}")
    print(f"{'passed' if passed else 'FAILED'}; wrote {args.out / 'summary.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
