"""Main job: train a small diffusers U-Net (DDPM) on CPU with the tiny_backprop strategy.

Data: scikit-learn's bundled handwritten digits (no download). Prints the plan report (what is
kept, selectively or fully recomputed, nested how deep) with the predicted and the measured
peak, and the memory report of MemoryProfilerCallback (every stage of every 10th batch: current,
peak, parameters, gradients, optimizer state, activations). Writes ``--out``/summary.json and
``--out``/memory/memory_rank0.json.

    python recipes/train_ddpm_digits.py --max-steps 100 --memory-budget 0.5
    python recipes/train_ddpm_digits.py --no-plan --out outputs/naive   # the same without the plan
    tbp report outputs/naive/memory/memory_rank0.json outputs/main/memory/memory_rank0.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch

from lightning_tbp import MemoryProfilerCallback, TinyBackpropStrategy
from lightning_tbp.diffusion import DDPMModule, DigitsDataModule, small_unet_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--memory-budget", default="0.5", help="fraction, bytes, '512MiB' or 'auto'")
    parser.add_argument("--no-plan", action="store_true", help="train with Lightning's default strategy instead")
    parser.add_argument("--out", type=Path, default=Path("outputs/main"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def budget_from_cli(text: str) -> object:
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def main() -> None:
    args = parse_args()
    L.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = DDPMModule(small_unet_config(args.image_size))
    data = DigitsDataModule(image_size=args.image_size, batch_size=args.batch_size, seed=args.seed)
    strategy = "auto" if args.no_plan else TinyBackpropStrategy(memory_budget=budget_from_cli(args.memory_budget))
    memory = MemoryProfilerCallback(
        every_n_steps=10,
        output_dir=args.out / "memory",
        experiment="naive" if args.no_plan else f"tiny_backprop (budget {args.memory_budget})",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=[memory],
        max_steps=args.max_steps,
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start

    summary = {
        "experiment": "ddpm_digits_naive" if args.no_plan else "ddpm_digits_tiny_backprop",
        "steps": args.max_steps,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "train_seconds": seconds,
        "final_loss": float(trainer.callback_metrics["train/loss"]),
        "memory": memory.record,
    }
    if isinstance(strategy, TinyBackpropStrategy):
        assert strategy.plan is not None and strategy.plan.current is not None
        print("\n" + strategy.plan.report())
        summary["plan"] = strategy.plan.to_dict()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\nfinal loss {summary['final_loss']:.4f} after {args.max_steps} steps in {seconds:.0f}s; "
        f"summary written to {args.out / 'summary.json'}"
    )


if __name__ == "__main__":
    main()
