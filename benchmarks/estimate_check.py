"""``tbp estimate`` against the device peak of a whole ``Trainer.fit`` of the same config.

For each config: the estimate (Python API of ``tbp estimate``, the config's own device unless
``--device`` says), then a short fit of that config (``--steps`` optimizer steps, the first
included; no logger, callbacks or checkpoints) under the exact meter: on CUDA
``torch.cuda.max_memory_allocated`` from an empty device (the model starts on the host, so the
peak counts parameters, optimizer state and batch as the estimate does), on CPU the allocator
peak plus what the module held before the fit. Configs that read a folder of images get a
generated one (random PNGs), so nothing is downloaded.

    python benchmarks/estimate_check.py --device cuda --out DIR
    python benchmarks/estimate_check.py --device cpu --smoke --out DIR     # the main config only
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_tbp.environment import machine_info
from lightning_tbp.estimate.config import estimate_config

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ConfigCase:
    name: str
    config: str
    overrides: list[str] = field(default_factory=list)
    image_folder: int | None = None  # side of the generated images, for ImageFolderDataModule configs


CASES = [
    ConfigCase("ddpm_unet_tiny", "ddpm_unet_tiny.yaml", ["--trainer.strategy=auto"]),
    ConfigCase(
        "ddpm_unet_tiny_tiny_backprop", "ddpm_unet_tiny.yaml", ["--trainer.strategy.init_args.memory_budget=null"]
    ),
    ConfigCase("dit_s", "dit_s.yaml"),
    ConfigCase("ddpm_unet_bf16", "ddpm_unet.yaml", ["--data.init_args.num_workers=0"], image_folder=128),
]
SMOKE = ["ddpm_unet_tiny"]
WHOLE_FIT = [
    "--trainer.callbacks=[]",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
    "--model.init_args.export=false",
]


def image_folder(root: Path, side: int, count: int) -> Path:
    """``count`` random RGB PNGs of ``side`` pixels in ``root``."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        pixels = torch.randint(0, 256, (side, side, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(root / f"{index:04d}.png")
    return root


def measured_fit_peak(args: list[str], device: str) -> int:
    """Device peak of the whole fit of ``args``, held tensors included."""
    from lightning_tbp.lightning_cli import run_lightning_cli
    from lightning_tbp.memory.libraries import free_library_workspaces
    from lightning_tbp.memory.meters import allocator_peak

    gc.collect()
    if device == "cuda":
        free_library_workspaces(torch.device("cuda"))  # made again inside the fit, as in a fresh process
        before = torch.cuda.memory_allocated()  # what an earlier check in this process left
        torch.cuda.reset_peak_memory_stats()
        cli = run_lightning_cli(args, run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        peak = torch.cuda.max_memory_allocated() - before
    else:
        cli = run_lightning_cli(args, run=False)
        held = sum(t.numel() * t.element_size() for t in [*cli.model.parameters(), *cli.model.buffers()])
        gc.collect()  # the meter misreads frees of garbage made before its region
        with allocator_peak() as whole:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        peak = held + whole.peak_bytes
    del cli
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return peak


def fit_args(case: ConfigCase, device: str, steps: int, scratch: Path) -> list[str]:
    """LightningCLI arguments of a short whole fit of ``case`` on ``device`` (an image folder made
    in ``scratch`` where the config reads one)."""
    accelerator = "gpu" if device == "cuda" else "cpu"
    args = ["-c", str(ROOT / "configs" / case.config), *WHOLE_FIT, *case.overrides]
    args += [f"--trainer.max_steps={steps}", f"--trainer.accelerator={accelerator}", "--trainer.devices=1"]
    if case.image_folder:
        root = image_folder(scratch / case.name, case.image_folder, count=(steps + 1) * 64)
        args.append(f"--data.init_args.root={root}")
    return args


def check(case: ConfigCase, device: str, steps: int, scratch: Path) -> dict[str, object]:
    args = fit_args(case, device, steps, scratch)
    started = time.perf_counter()
    estimate = estimate_config(args, minimum=False)
    estimate_seconds = time.perf_counter() - started
    measured = measured_fit_peak(args, device)
    return {
        "config": case.config,
        "overrides": case.overrides,
        "estimate_device": estimate.device,
        "estimated_bytes": estimate.naive_peak_bytes,
        "measured_bytes": measured,
        "estimated_vs_measured": estimate.naive_peak_bytes / measured,
        "estimate_seconds": estimate_seconds,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the main job's config only")
    parser.add_argument("--only", nargs="*", help="config case names")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if (c.name in SMOKE if args.smoke else not args.only or c.name in args.only)]
    rows: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for case in chosen:
            try:
                rows[case.name] = check(case, args.device, args.steps, Path(scratch))
            except Exception as error:  # one config's failure is a result; the others still run
                rows[case.name] = {"error": f"{type(error).__name__}: {error}"}
            print(case.name, json.dumps(rows[case.name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "device": args.device, "rows": rows}
    (args.out / "estimate_check.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'estimate_check.json'}")
    return 1 if any("error" in row for row in rows.values()) else 0  # type: ignore[operator]


if __name__ == "__main__":
    sys.exit(main())
