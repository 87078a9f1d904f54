"""Fine-tune a video VAE (diffusers' ``AutoencoderKLWan``) on reconstruction, from Python.

The VAE (a local folder with ``--pretrained``, the VAE's or a Wan pipeline's, else a fresh tiny
one) encodes each clip chunk by chunk over time and decodes it; the loss is the mean absolute
reconstruction error (plus a small KL term with ``--train all``). By default only the decoder
trains, so the latents a diffusion model was trained on stay as they were. The clips are
``MovingSquares``, made from a seed: put your own dataset of ``[C, T, H, W]`` clips in [-1, 1]
in its place. The plan covers the whole autoencoding, each call of each block of the encoder's
and decoder's chunks planned on its own; the plan report is printed, and the fine-tuned VAE is
written with ``save_pretrained``.

    python recipes/finetune_video_vae.py --frames 9 --size 64 --memory-budget 0.4 --out outputs/video_vae
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from lightning_tbp import TinyBackpropStrategy
from lightning_tbp.diffusion.video_vae import MovingSquares, VideoVAEFineTuneModule


def main(argv: Sequence[str] | None = None) -> VideoVAEFineTuneModule:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default=None, help="a local AutoencoderKLWan (or Wan pipeline) folder")
    parser.add_argument("--train", choices=["decoder", "all"], default="decoder")
    parser.add_argument("--frames", type=int, default=5, help="frames per clip (Wan's VAE takes 1 + 4k)")
    parser.add_argument("--size", type=int, default=32, help="clip height and width")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--memory-budget", default="0.5", help="'auto', a fraction such as 0.4, or '6GiB'")
    parser.add_argument("--out", type=Path, default=Path("outputs/video_vae"))
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    model = VideoVAEFineTuneModule(
        pretrained=args.pretrained, train=args.train, lr=1e-4, export_dir=str(args.out / "vae")
    )
    channels = model.vae.config["in_channels"]
    clips = MovingSquares(args.batch_size * args.max_steps, frames=args.frames, size=args.size, channels=channels)
    strategy = TinyBackpropStrategy(memory_budget=args.memory_budget)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(clips, batch_size=args.batch_size))
    print(strategy.plan.report())
    print(f"the fine-tuned VAE written to {args.out / 'vae'}")
    return model


if __name__ == "__main__":
    main()
