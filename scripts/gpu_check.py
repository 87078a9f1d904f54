"""The GPU check: every CUDA path and the headline figures in one command that fits a lent GPU's time.

    bash scripts/gpu_check.sh --out DIR                      # on a CUDA machine (see docs/gpu_runbook.md)
    python scripts/gpu_check.py --device cpu --smoke --out DIR   # the dry-run CI runs: same parts, tiny sizes

Parts run in order of value, each in its own process under its own time limit, so one that
fails or hangs costs only its own time and the others still run. After each part, everything
written so far is packed into ``DIR/gpu_check.tgz`` (the parts' JSON, plots and logs, and
``summary.json``: per part its command, exit status, seconds and whether it timed out), so a run
cut off by the lease still returns what it finished. ``--budget-s`` caps the whole run: a part
that would start with less time left than its limit is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@dataclass(frozen=True)
class Part:
    """One step of the check: ``gpu`` is its command on a GPU, ``smoke`` on CPU at tiny sizes;
    ``{out}`` in a command is the part's result folder."""

    name: str
    limit_s: int
    gpu: list[str]
    smoke: list[str]
    smoke_limit_s: int = 240


def _bench(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCH / script), *args]


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args]


ZOO_ARCHITECTURES = ("dit",)  # SD3 ran on an H100 and an H200 alike: docs/benchmarks.md
PARTS: list[Part] = [
    Part(
        "tests",
        limit_s=170,  # 32 tests: about 120 s on an H200; -v names each as it ends
        # new since: the FSDP2 host-tier fit and the main job under FSDP2 (each ~15 s on CPU)
        gpu=_pytest("-v", "--tb=short", "tests/test_compat.py", "tests/test_cuda.py", "--junitxml={out}/junit.xml"),
        smoke=_pytest("tests/test_cuda.py", "--junitxml={out}/junit.xml"),
    ),
    *(
        Part(
            f"zoo_{name}",
            limit_s=50,
            gpu=_bench("zoo.py", "--arch", name, "--device", "cuda", "--trials", "3", "--out", "{out}"),
            smoke=_bench("zoo.py", "--arch", name, "--trials", "1", "--out", "{out}"),
            smoke_limit_s=300,
        )
        for name in ZOO_ARCHITECTURES
    ),
    Part(
        "unet_bf16",
        limit_s=70,  # 69 s on an H200
        gpu=_bench(
            "unet_mem_bench.py",
            "--profile",
            "large",
            "--device",
            "cuda",
            "--trials",
            "5",
            "--modes",
            "naive",
            "diffusers",
            "tbp:0.7",
            "tbp:0.5",
            "tbp:lowest",
            "tbp:at:diffusers",
            "--out",
            "{out}",
        ),
        smoke=_bench(
            "unet_mem_bench.py",
            "--profile",
            "small",
            "--device",
            "cpu",
            "--trials",
            "1",
            "--warmup",
            "1",
            "--modes",
            "naive",
            "tbp:0.6",
            "--out",
            "{out}",
        ),
    ),
    Part(
        "estimate",
        limit_s=55,  # 51 s on an H200
        gpu=_bench("estimate_check.py", "--device", "cuda", "--out", "{out}"),
        smoke=_bench("estimate_check.py", "--device", "cpu", "--smoke", "--out", "{out}"),
    ),
    Part(
        "host_tier",
        limit_s=40,
        gpu=_bench("host_tier.py", "--device", "cuda", "--names", "flux", "--batch", "8", "--out", "{out}"),
        smoke=_bench("host_tier.py", "--names", "dit", "--batch", "2", "--rounds", "1", "--out", "{out}"),
    ),
    Part(
        "dp_dit_l",
        limit_s=80,
        gpu=_bench(
            "dit_dp_bench.py",
            "--all",
            "--profile",
            "dit_l",
            "--batch",
            "8",
            "--device",
            "cuda",
            "--trials",
            "3",
            "--modes",
            "vanilla",
            "ghost",
            "bookkeeping",
            "flash_bookkeeping",
            "flash",
            "--out",
            "{out}",
        ),
        smoke=_bench(
            "dit_dp_bench.py",
            "--all",
            "--profile",
            "small",
            "--layers",
            "2",
            "--batch",
            "4",
            "--trials",
            "1",
            "--warmup",
            "0",
            "--modes",
            "vanilla",
            "ghost",
            "--out",
            "{out}",
        ),
    ),
    Part(
        "metered_windows",
        limit_s=75,  # every meter region of the whole-fit, streamed and FSDP1 fits: what was alive at its peak
        gpu=_bench("metered_windows.py", "--out", "{out}"),
        smoke=[],
    ),
]


def pack(work: Path, archive: Path) -> None:
    """Everything under ``work`` into ``archive``, replaced atomically."""
    partial = archive.with_suffix(".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(work, arcname=".")
    partial.replace(archive)


def run_part(part: Part, command: list[str], limit_s: int, work: Path) -> dict[str, object]:
    out = work / part.name
    out.mkdir(parents=True, exist_ok=True)
    argv = [word.replace("{out}", str(out)) for word in command]
    started = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        try:
            completed = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s)
            status, timed_out = completed.returncode, False
        except subprocess.TimeoutExpired:
            status, timed_out = None, True
    seconds = time.perf_counter() - started
    tail = (out / "log.txt").read_text(errors="replace").splitlines()[-3:]
    return {"command": argv, "returncode": status, "timed_out": timed_out, "seconds": round(seconds, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="gpu_check.tgz is written here")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (with --device cpu: CI's dry-run)")
    parser.add_argument("--only", nargs="*", help="part names (default: all)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time limit")
    parser.add_argument("--work", type=Path, help="where the parts write (default: OUT/gpu_check)")
    parser.add_argument("--list", action="store_true", help="print the parts and their limits, and stop")
    args = parser.parse_args(argv)
    smoke = args.smoke or args.device == "cpu"
    parts = [p for p in PARTS if (not args.only or p.name in args.only) and (p.smoke if smoke else p.gpu)]
    if args.list:
        for part in parts:
            print(f"{part.name:16s} {part.smoke_limit_s if smoke else part.limit_s:4d} s")
        print(f"total            {sum(p.smoke_limit_s if smoke else p.limit_s for p in parts):4d} s")
        return 0
    work = args.work or args.out / "gpu_check"
    work.mkdir(parents=True, exist_ok=True)
    archive = args.out / "gpu_check.tgz"
    started = time.perf_counter()
    summary: dict[str, object] = {"device": args.device, "smoke": smoke, "parts": {}}
    machine = subprocess.run(
        [sys.executable, "-c", "import json, lightning_tbp.environment as e; print(json.dumps(e.machine_info()))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    summary["machine"] = json.loads(machine.stdout) if machine.returncode == 0 else {"error": machine.stderr[-2000:]}
    results: dict[str, object] = summary["parts"]  # type: ignore[assignment]
    failed = False
    for part in parts:
        limit = part.smoke_limit_s if smoke else part.limit_s
        left = args.budget_s - (time.perf_counter() - started)
        if left < min(limit, 30):
            results[part.name] = {"skipped": f"{left:.0f} s left of --budget-s, the part needs up to {limit} s"}
        else:
            results[part.name] = run_part(part, part.smoke if smoke else part.gpu, int(min(limit, left)), work)
            failed |= results[part.name]["returncode"] != 0  # type: ignore[index]
        print(part.name, json.dumps({k: v for k, v in results[part.name].items() if k != "command"}), flush=True)  # type: ignore[union-attr]
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        pack(work, archive)
    print(f"wrote {archive} in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
