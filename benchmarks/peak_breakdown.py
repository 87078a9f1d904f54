"""What is alive at a whole fit's CUDA peak, by the Python line that allocated it, beside the estimate's parts.

Runs each config of ``estimate_check.py`` (a short ``Trainer.fit``) with CUDA's allocation history
recorded, replays the history to the moment the allocated bytes peaked, and groups the blocks alive
then by the innermost frame outside torch: where an estimate that misses bytes should look.

    python benchmarks/peak_breakdown.py --out DIR [--only ddpm_unet_tiny ddpm_unet_bf16]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimate_check import CASES, fit_args

from lightning_tbp.compat import cuda_memory_snapshot, record_cuda_memory_history, stop_cuda_memory_history
from lightning_tbp.environment import machine_info
from lightning_tbp.estimate.config import estimate_config


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch's own Python files (``torch/`` paths), with the innermost one."""
    names = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames]
    outside = next((n for n, f in zip(names, frames, strict=True) if "/torch/" not in f["filename"]), "?")
    return f"{outside} <- {names[0] if names else '?'}"


def alive_at_peak(snapshot: dict[str, Any]) -> tuple[int, Counter[str]]:
    """Replay the recorded allocations: the peak of allocated bytes and what was alive then, by place."""
    alive: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                alive[event["addr"]] = (event["size"], _where(event.get("frames", [])))
                total += event["size"]
                if total > peak:
                    peak, at_peak = total, dict(alive)
            elif event["action"] == "free_completed" and event["addr"] in alive:
                total -= alive.pop(event["addr"])[0]
    places: Counter[str] = Counter()
    for size, place in at_peak.values():
        places[place] += size
    return peak, places


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["ddpm_unet_tiny", "ddpm_unet_bf16"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from lightning_tbp.lightning_cli import run_lightning_cli

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for case in (c for c in CASES if c.name in args.only):
            arguments = fit_args(case, "cuda", args.steps, Path(scratch))
            estimate = estimate_config(arguments, minimum=False)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            record_cuda_memory_history(1_000_000, python_stacks_only=True)
            cli = run_lightning_cli(arguments, run=False)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            snapshot = cuda_memory_snapshot()
            stop_cuda_memory_history()
            peak, places = alive_at_peak(snapshot)
            rows[case.name] = {
                "max_memory_allocated": torch.cuda.max_memory_allocated(),
                "replayed_peak": peak,
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
                "estimate": {k: v for k, v in asdict(estimate).items() if isinstance(v, int | float | str | dict)},
                "alive_at_peak": dict(places.most_common(40)),
            }
            print(case.name, json.dumps({k: v for k, v in rows[case.name].items() if k != "estimate"}, indent=1))
            del cli, snapshot
            gc.collect()
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peak_breakdown.json").write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
