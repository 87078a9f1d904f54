"""A sharded strategy on one device with a plan: a short ``Trainer.fit`` of the zoo's DiT (whose
forward reaches into its first block), its metered loop steps written as JSON. Run as a script
(its own process group, its own process).

python one_gpu_sharded.py STRATEGY OUT_JSON [ACCELERATOR]
    STRATEGY: tiny_backprop_fsdp (CUDA only), tiny_backprop_fsdp2, or tiny_backprop_fsdp2_host (at
    0.40 of naive with the host tier: on CPU the device alone reaches 0.436, the host tier 0.355);
    ACCELERATOR: gpu (default) or cpu
"""

import json
import sys
from pathlib import Path

from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_loop_truth import _fit

from lightning_tbp import TinyBackpropFSDP2Strategy, TinyBackpropFSDPStrategy
from lightning_tbp.testing.zoo_lightning import ZooModule


def main(name: str, out: Path, accelerator: str = "gpu") -> None:
    module = ZooModule("dit", batch=4)
    loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=4)
    strategy = {
        "tiny_backprop_fsdp": lambda: TinyBackpropFSDPStrategy(memory_budget=0.9),
        "tiny_backprop_fsdp2": lambda: TinyBackpropFSDP2Strategy(memory_budget=0.9),
        "tiny_backprop_fsdp2_host": lambda: TinyBackpropFSDP2Strategy(memory_budget=0.40, host_tier="on"),
    }[name]()
    run = _fit(module, loader, strategy, accelerator=accelerator, max_steps=4)
    options = sorted({option.name for option in run["plan"].options.values()})
    out.write_text(json.dumps({"loop_steps": run["loop_steps"], "options": options}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
