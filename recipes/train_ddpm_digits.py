"""DDPM on the bundled digits from Python: the main job's recipe without YAML.

Trains a small diffusers U-Net on scikit-learn's handwritten digits (no download) on CPU with
the tiny_backprop strategy and MemoryProfilerCallback, samples a grid after validation and
writes a DDPMPipeline folder. ``--no-plan`` trains the same with Lightning's default strategy.

    python recipes/train_ddpm_digits.py --max-steps 100 --memory-budget 0.5
    python recipes/train_ddpm_digits.py --no-plan --out outputs/naive
    tbp report outputs/naive/memory/memory_rank0.json outputs/main/memory/memory_rank0.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L

from lightning_tbp import MemoryProfilerCallback, TinyBackpropStrategy
from lightning_tbp.diffusion import DiffusionModule, DigitsDataModule, small_unet_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--memory-budget", type=float, default=0.5, help="fraction of the naive peak")
    parser.add_argument("--no-plan", action="store_true", help="train with Lightning's default strategy instead")
    parser.add_argument("--out", type=Path, default=Path("outputs/main"))
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    strategy = "auto" if args.no_plan else TinyBackpropStrategy(memory_budget=args.memory_budget)
    memory = MemoryProfilerCallback(
        every_n_steps=10,
        output_dir=args.out / "memory",
        experiment="naive" if args.no_plan else f"tiny_backprop (budget {args.memory_budget:g})",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=[memory],
        max_steps=args.max_steps,
        limit_val_batches=1,
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    model = DiffusionModule(
        model_config=small_unet_config(32), lr=args.lr, sample_steps=25, export_dir=str(args.out / "pretrained")
    )
    trainer.fit(model, datamodule=DigitsDataModule(image_size=32, batch_size=args.batch_size))
    print(f"final loss {float(trainer.callback_metrics['train/loss']):.4f}; model in {model.exported_to}")


if __name__ == "__main__":
    main()
