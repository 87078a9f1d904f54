"""Class-conditional DiT on the bundled digits from Python, under a memory budget.

A small pixel-space DiT (patch 2 on 32x32 -> 256 tokens, 10 classes) trained with the
tiny_backprop strategy; the validation grid is sampled with classifier-free guidance, one
class per image.

    python recipes/train_dit_digits.py --max-steps 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L

from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.diffusion import DiffusionModule, DigitsDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--memory-budget", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=Path("outputs/dit_digits"))
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    dit = {
        "sample_size": 32,
        "in_channels": 1,
        "out_channels": 1,
        "patch_size": 2,
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "num_layers": 6,
        "num_embeds_ada_norm": 10,
    }
    model = DiffusionModule(
        family="dit", model_config=dit, lr=3e-4, ema_decay=0.999, guidance_scale=2.0, sample_images=20
    )
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=TinyBackpropStrategy(memory_budget=args.memory_budget),
        max_steps=args.max_steps,
        limit_val_batches=1,
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
    )
    trainer.fit(model, datamodule=DigitsDataModule(image_size=32, batch_size=32))
    print(f"samples: {model.last_sample_grid}; transformer: {model.exported_to}")


if __name__ == "__main__":
    main()
