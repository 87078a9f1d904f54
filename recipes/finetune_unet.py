"""Fine-tune a local diffusers UNet2DModel on a folder of images, from Python.

``--pretrained`` is a model folder (config.json + weights) or a DDPMPipeline folder; nothing is
downloaded. The result is a DDPMPipeline folder that ``DDPMPipeline.from_pretrained`` loads.

    python recipes/finetune_unet.py --pretrained pretrained/ddpm-cifar10-32 --images /data/cats \
        --image-size 32 --out outputs/finetune
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
from diffusers import DDPMPipeline

from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.diffusion import DiffusionModule, ImageFolderDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--image-size", type=int, required=True, help="the model's sample_size")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--memory-budget", default="auto", help="'auto', a fraction such as 0.4, or '6GiB'")
    parser.add_argument("--out", type=Path, default=Path("outputs/finetune"))
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    model = DiffusionModule(
        pretrained=args.pretrained, lr=2e-5, ema_decay=0.999, export_dir=str(args.out / "pretrained")
    )
    data = ImageFolderDataModule(args.images, image_size=args.image_size, batch_size=16, val_fraction=0.05)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=TinyBackpropStrategy(memory_budget=args.memory_budget),
        max_epochs=args.epochs,
        limit_val_batches=1,
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
    )
    trainer.fit(model, datamodule=data)
    pipeline = DDPMPipeline.from_pretrained(model.exported_to)  # the round trip users rely on
    print(f"fine-tuned {type(pipeline.unet).__name__} written to {model.exported_to}")


if __name__ == "__main__":
    main()
