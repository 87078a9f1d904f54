"""LoRA reward fine-tuning through the sampling chain (DRaFT-K), from Python.

A U-Net (a local diffusers folder with ``--pretrained``, else a fresh small one) samples each
batch with ``--steps`` DDIM steps; a reward model scores the samples and the loss, the negative
reward, is backpropagated through the last ``--grad-steps`` steps. The reward model here is
``ConvReward``, a seeded stand-in: put your own differentiable scorer in its place. The plan
covers the whole chain and the reward model (the strategy's default target, the module's
``scored``), each call of the U-Net planned on its own; the plan report is printed. The adapters
are written in diffusers' LoRA format.

    python recipes/reward_finetune.py --steps 8 --grad-steps 8 --memory-budget 0.3 --out outputs/reward
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.diffusion.models import small_unet_config
from lightning_tbp.diffusion.reward import ConvReward, NoiseBatches, RewardFineTuneModule


def main(argv: Sequence[str] | None = None) -> RewardFineTuneModule:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default=None, help="a local UNet2DModel or DDPMPipeline folder")
    parser.add_argument("--image-size", type=int, default=16, help="of the fresh U-Net (without --pretrained)")
    parser.add_argument("--steps", type=int, default=4, help="DDIM steps per sample")
    parser.add_argument("--grad-steps", type=int, default=None, help="backpropagate through the last K steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--memory-budget", default="0.5", help="'auto', a fraction such as 0.4, or '6GiB'")
    parser.add_argument("--out", type=Path, default=Path("outputs/reward"))
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    config = None if args.pretrained else small_unet_config(args.image_size, channels=3)
    model = RewardFineTuneModule(
        ConvReward(channels=3),
        model_config=config,
        pretrained=args.pretrained,
        sampling_steps=args.steps,
        grad_steps=args.grad_steps,
        lr=1e-4,
        lora_rank=4,
        export_dir=str(args.out / "lora"),
    )
    noises = NoiseBatches(args.batch_size * args.max_steps, model.sample_shape(1)[1:])
    strategy = TinyBackpropStrategy(memory_budget=args.memory_budget)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(noises, batch_size=args.batch_size))
    print(strategy.plan.report())
    print(f"LoRA adapters written to {args.out / 'lora'}")
    return model


if __name__ == "__main__":
    main()
