"""Two-process CPU DDP run with MemoryProfilerCallback (run as a script: Lightning's launcher re-runs argv).

python ddp_memory_profile.py OUT_DIR
"""

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import Denoiser

from lightning_tbp import MemoryProfilerCallback

if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    data = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=False,
        default_root_dir=out,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MemoryProfilerCallback(every_n_steps=1, warmup_steps=2, output_dir=out / "memory")],
    )
    trainer.fit(Denoiser(), DataLoader(TensorDataset(data), batch_size=2))
