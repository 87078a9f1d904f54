"""Plans of FSDP2-sharded zoo models in one process (gloo, world size 1): each planned at a few
budgets, its step measured by ``Plan.verify``; one JSON row per plan. ``cold``: planned before
FSDP2 ever gathered the model (its gather buffers are made then), else after one plain step.

python fsdp2_plan.py OUT_JSON PORT
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from lightning_tbp import rematerialize
from lightning_tbp.compat import fsdp2_gather_buffers
from lightning_tbp.strategies.distributed import shard_blocks
from lightning_tbp.testing.zoo_models import ZOO

# the DiT's lowest budget plans most of its blocks lazily: its peak falls after the last block's
# backward, where FSDP2 keeps that block's reduce-scatter input
CASES = [
    ("dit", True, (0.8, 0.6, 0.55)),
    ("dit", False, (0.8, 0.6, 0.55)),
    ("sd3", False, (0.8, 0.6)),
    ("unet2d", False, (0.8, 0.6)),
]


def main(out: Path, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for name, cold, budgets in CASES:
        case = ZOO[name].case(batch=4)
        shard_blocks(case.model)
        if not cold:
            case.step()
            case.model.zero_grad(set_to_none=True)
        for budget in budgets:
            plan = rematerialize(case.model, *case.args, memory_budget=budget, **case.kwargs)
            root_left_gathered = any(t.untyped_storage().nbytes() for t, _ in fsdp2_gather_buffers(case.model))
            verdict = plan.verify(case.step)
            case.model.zero_grad(set_to_none=True)
            plan.remove()
            rows.append(
                {
                    "model": name,
                    "cold": cold,
                    "budget": budget,
                    "predicted": verdict.predicted_bytes,
                    "measured": verdict.measured_bytes,
                    "budget_bytes": verdict.budget_bytes,
                    "replanned": verdict.replanned,
                    "root_left_gathered": root_left_gathered,
                }
            )
    out.write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
