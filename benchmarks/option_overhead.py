"""Wall-time cost of each block option on the reference U-Net, timed interleaved.

Every leaf block (ResNet, attention, resampler) is put under one option (full, selective, lazy)
and training steps of all configurations are timed in turns, so machine noise hits them alike.
This shows what the planner's FLOP-based cost model leaves out: memory-bound recomputation and
per-op Python dispatch (selective and lazy blocks run a dispatch mode on every op).

    python benchmarks/option_overhead.py --out docs/benchmarks --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remat_pareto import build

from lightning_tbp.environment import machine_info
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator

OPTIONS = {"naive": None, "full": Option.FULL, "selective": Option.SELECTIVE, "lazy": Option.LAZY}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be positive")
    model, step = build(torch.device("cpu"), 4, 64)
    trace = record_trace(model, (torch.randn(4, 3, 64, 64), torch.zeros(4, dtype=torch.long)), {})
    simulator = Simulator(trace)
    leaves = [n.index for n in trace.nodes[1:] if not n.children and n.has_events]
    limits = {trace.nodes[i].path: simulator.cache_limit(i) for i in leaves}
    times: dict[str, list[float]] = {name: [] for name in OPTIONS}
    for _ in range(args.rounds):
        for name, option in OPTIONS.items():
            options = {} if option is None else {trace.nodes[i].path: option for i in leaves}
            wrappers = InstalledWrappers(model, options, limits)
            wrappers.ensure(options)
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            wrappers.remove()
    naive = statistics.median(times["naive"])
    rows = [
        {"option": name, "median_step_seconds": statistics.median(t), "time_ratio": statistics.median(t) / naive}
        for name, t in times.items()
    ]
    for row in rows:
        print(f"{row['option']:<10} {row['median_step_seconds'] * 1e3:7.1f} ms  {row['time_ratio']:.3f}x naive")
    result = {
        "experiment": "option_overhead",
        "machine": machine_info(),
        "config": {"rounds": args.rounds},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "option_overhead.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
