"""A sharded strategy on one GPU with a plan: a short ``Trainer.fit`` of the zoo's DiT, its metered
loop steps written as JSON. Run as a script (its own process group, its own process).

python one_gpu_sharded.py STRATEGY OUT_JSON     (STRATEGY: tiny_backprop_fsdp or tiny_backprop_fsdp2)
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import TinyBackpropFSDP2Strategy, TinyBackpropFSDPStrategy
from lightning_tbp.testing.zoo_lightning import ZooModule


def main(name: str, out: Path) -> None:
    torch.manual_seed(0)
    module = ZooModule("dit", batch=4)
    loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=4)
    kind = {"tiny_backprop_fsdp": TinyBackpropFSDPStrategy, "tiny_backprop_fsdp2": TinyBackpropFSDP2Strategy}[name]
    strategy = kind(memory_budget=0.9)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    plan = strategy.plan
    assert plan is not None and plan.current is not None
    options = {path: option.name for path, option in plan.current.options.items()}
    out.write_text(json.dumps({"loop_steps": strategy.loop_steps(), "options": options}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
