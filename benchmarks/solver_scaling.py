"""How planning time grows with the number of blocks.

Residual MLP chains of N blocks (each block: LayerNorm, Linear, GELU, Linear; every block is a
candidate, so N blocks = N planner nodes) and a 28-layer DiT are traced and solved at a budget of
half the naive peak. Writes JSON and prints a table.

    python benchmarks/solver_scaling.py --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_tbp.environment import machine_info
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import Solver


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Linear(2 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def chain_case(blocks: int) -> tuple[str, nn.Module, tuple, dict]:
    return f"mlp_chain_{blocks}", nn.Sequential(*(Block(32) for _ in range(blocks))), (torch.randn(256, 32),), {}


def dit_case() -> tuple[str, nn.Module, tuple, dict]:
    model = DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=4,
        num_layers=28,
        patch_size=2,
        sample_size=32,
        num_embeds_ada_norm=1000,
    )
    kwargs = {"timestep": torch.arange(8) * 100, "class_labels": torch.arange(8)}
    return "dit_28_layers", model, (torch.randn(8, 4, 32, 32),), kwargs


def measure(name: str, model: nn.Module, args: tuple, kwargs: dict) -> dict:
    torch.manual_seed(0)
    start = time.perf_counter()
    trace = record_trace(model, args, kwargs)
    trace_seconds = time.perf_counter() - start
    solver = Solver(Simulator(trace))
    naive = solver.naive()
    solution = solver.solve(naive.peak_bytes // 2)
    row = {
        "case": name,
        "planner_nodes": len(trace.nodes) - 1,
        "ops": trace.num_events,
        "trace_seconds": trace_seconds,
        "solve_seconds": solution.solve_seconds,
        "replays": solution.simulations,
        "predicted_peak_ratio": solution.result.peak_bytes / naive.peak_bytes,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"))
    parser.add_argument("--blocks", type=int, nargs="+", default=[50, 100, 200, 400])
    args = parser.parse_args()
    if any(b < 1 for b in args.blocks):
        parser.error("--blocks must be positive")
    rows = [measure(*chain_case(b)) for b in args.blocks] + [measure(*dit_case())]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"experiment": "solver_scaling", "machine": machine_info(), "config": {"budget": 0.5}, "rows": rows}
    (args.out / "solver_scaling.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
