"""The FSDP2 layout's estimate against the planner's simulation of the same step sharded for
real, on two gloo ranks: each rank records the trace of a zoo model sharded by ``shard_blocks``
(its units' real spans) and simulates its unplanned step, and estimates the same step from the
unsharded model under fake tensors (``Layout("fsdp2", 2)``: the spans the units would have). The
planner's simulation of a sharded step is checked against the exact meter across processes in
``fsdp2_plan.py``; this checks that the estimate's spans stand for the real ones.

python fsdp2_estimate.py OUT_JSON PORT    (OUT_JSON: one {case: [estimated, simulated]} per rank)
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_tbp.estimate import CPU, Layout, TrainingStep, estimate_step
from lightning_tbp.memory.held import parameter_step_ratio
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.step import PLAIN_LOOP
from lightning_tbp.strategies.distributed import shard_blocks
from lightning_tbp.testing.zoo_models import ZOO

NAMES = ("dit", "sdxl_unet")
WORLD = 2


def _fake_step(name: str):
    def build() -> TrainingStep:
        torch.manual_seed(0)
        case = ZOO[name].case(batch=2)
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4)

        def forward_backward() -> torch.Tensor:
            loss = case.loss()
            loss.backward()
            return loss

        step = TrainingStep({"model": case.model}, case.model, case.args, forward_backward, optimizer.step, [optimizer])
        step.layout = Layout("fsdp2", WORLD)
        return step

    return build


def _sharded_peak(name: str, fused: bool) -> int:
    torch.manual_seed(0)
    case = ZOO[name].case(batch=2)
    shard_blocks(case.model)
    trace = record_trace(case.model, case.args, case.kwargs, measure=False)
    assert trace.fsdp.world == WORLD and trace.fsdp.spans
    loop = PLAIN_LOOP
    if fused:
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
        loop = loop.with_step_in_backward(parameter_step_ratio([optimizer], torch.device("cpu")))
    return Simulator(trace, loop=loop).run([Option.KEEP] * len(trace.nodes)).peak_bytes


def _rank(rank: int, port: str, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)  # two processes on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        pairs = {}
        for name in NAMES:
            for fused in (False, True):
                estimate = estimate_step(_fake_step(name), device=CPU, minimum=False, step_in_backward=fused)
                pairs[f"{name} fused={fused}"] = [estimate.target_naive_peak_bytes, _sharded_peak(name, fused)]
    finally:
        dist.destroy_process_group()
    (out.parent / f"{out.name}.rank{rank}").write_text(json.dumps(pairs))


def main(out: Path, port: str) -> None:
    mp.spawn(_rank, args=(port, out), nprocs=WORLD)
    out.write_text(json.dumps([json.loads((out.parent / f"{out.name}.rank{r}").read_text()) for r in range(WORLD)]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
