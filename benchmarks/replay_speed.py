"""How fast the planner's inner loop runs: replays of plans, and the search for the lowest peak.

Each zoo architecture is traced once; a fixed, seeded set of plans (random sequences of the
solver's legal moves, and the uniform plans) is replayed, best of three passes, and the
cost-blind search for the lowest peak (``Solver.lowest``, what the tightest budgets run) is
timed the same way. A digest of every replay's predictions (peak, cost, FLOPs, peak step) goes
into the result, so two commits can be compared for speed *and* for identical predictions on
the same traces: ``--traces FILE`` saves the traces on the first run and loads them afterwards
(op times differ from one trace to the next, and they steer costs).

    python benchmarks/replay_speed.py --out docs/benchmarks/replay_speed [--traces traces.pkl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_tbp.environment import machine_info
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import Solver
from lightning_tbp.testing.zoo_models import BENCH_ONLY, ZOO

PLANS, MAX_MOVES, PASSES = 60, 12, 3


def traces_for(names: list[str], path: Path | None) -> dict[str, Any]:
    if path is not None and path.exists():
        return pickle.loads(path.read_bytes())
    traces = {}
    for name in names:
        case = {**ZOO, **BENCH_ONLY}[name].case(batch=4 if name in BENCH_ONLY else 2)
        torch.manual_seed(0)
        traces[name] = record_trace(case.model, case.args, case.kwargs)
    if path is not None:
        path.write_bytes(pickle.dumps(traces))
    return traces


def plans_for(solver: Solver) -> list[list[Option]]:
    rng = random.Random(0)
    plans = []
    for _ in range(PLANS):
        options = [Option.KEEP] * len(solver.nodes)
        for _ in range(rng.randint(1, MAX_MOVES)):
            moves = solver.legal_moves(options)
            if not moves:
                break
            options = solver.apply(options, *rng.choice(moves))
        plans.append(options)
    return plans + [options for options, _ in solver.uniform_plans()]


def measure(name: str, trace: Any) -> dict[str, Any]:
    simulator = Simulator(trace)
    plans = plans_for(Solver(simulator))
    replay_seconds, lowest_seconds = [], []
    for _ in range(PASSES):
        start = time.perf_counter()
        results = [simulator.run(options) for options in plans]
        replay_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        lowest = Solver(simulator).lowest(1)
        lowest_seconds.append(time.perf_counter() - start)
    predictions = [(r.peak_bytes, r.recompute_cost, r.recompute_flops, r.peak_step) for r in results]
    predictions.append((lowest[1].peak_bytes, [int(o) for o in lowest[0]]))
    row = {
        "architecture": name,
        "events": trace.num_events,
        "blocks": len(trace.nodes) - 1,
        "plans": len(plans),
        "replay_seconds": min(replay_seconds),
        "lowest_seconds": min(lowest_seconds),
        "predictions_digest": hashlib.sha256(repr(predictions).encode()).hexdigest()[:16],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", nargs="+", default=[*ZOO, *BENCH_ONLY], choices=[*ZOO, *BENCH_ONLY])
    parser.add_argument("--traces", type=Path, help="pickle of the traces: written if absent, else read")
    args = parser.parse_args()
    traces = traces_for(args.arch, args.traces)
    rows = [measure(name, traces[name]) for name in args.arch]
    result = {"experiment": "replay_speed", "machine": machine_info(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"replay_speed_{result['machine']['git_commit']}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
