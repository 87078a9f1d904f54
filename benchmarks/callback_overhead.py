"""What MemoryProfilerCallback costs: step time and peak memory with and without it.

Each configuration trains the digits DDPM (the main job's model) in its own process, repeated
and interleaved, and reports the mean step time after a warm-up, the process's peak RSS and,
on CUDA, the allocator's peak. On CUDA the callback reads allocator counters (and collects
Python's garbage as a metered batch starts, as on CPU); on CPU every metered batch (and the batch
before it, from its backward on) runs inside torch's profiler, which is what the CPU figures show.

    python benchmarks/callback_overhead.py --out docs/benchmarks --steps 60 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = {
    "no_callback": None,
    "callback_every_10": {"every_n_steps": 10},
    "callback_every_1": {"every_n_steps": 1},
}


def run_one(config_name: str, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """Train once in this process and measure it."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_tbp import MemoryProfilerCallback
    from lightning_tbp.diffusion import DiffusionModule, DigitsDataModule, small_unet_config

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def _sync(self) -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        def on_train_batch_start(self, *args: Any) -> None:
            self._sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self._sync()
            self.times.append(time.perf_counter() - self._start)

    L.seed_everything(0, verbose=False)
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    options = CONFIGS[config_name]
    if options is not None:
        callbacks.append(MemoryProfilerCallback(**options, output_dir=tempfile.mkdtemp(), log_metrics=False))
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(
        DiffusionModule(model_config=small_unet_config(32), sample_images=0, export=False, compute_flops=False),
        datamodule=DigitsDataModule(image_size=32, batch_size=32),
    )
    timed = timer.times[warmup:]
    return {
        "config": config_name,
        "mean_step_ms": statistics.fmean(timed) * 1e3,
        "median_step_ms": statistics.median(timed) * 1e3,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/callback_overhead"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.steps, args.warmup, args.device)))
        return

    from lightning_tbp.environment import machine_info

    runs = []
    for repeat in range(args.repeats):
        for name in CONFIGS:  # interleaved, so slow drifts of the machine hit every configuration
            command = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
            command += ["--warmup", str(args.warmup), "--device", args.device]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs.append({"repeat": repeat, **json.loads(output.strip().splitlines()[-1])})
            print(runs[-1], flush=True)

    def mean(name: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["config"] == name and r[key] is not None]
        return statistics.fmean(values) if values else None

    base_time, base_rss, base_cuda = (mean("no_callback", k) for k in ("mean_step_ms", "max_rss_mb", "cuda_peak_mb"))
    rows = []
    for name in CONFIGS:
        step, rss, cuda = mean(name, "mean_step_ms"), mean(name, "max_rss_mb"), mean(name, "cuda_peak_mb")
        assert step is not None and rss is not None and base_time is not None and base_rss is not None
        rows.append(
            {
                "config": name,
                "mean_step_ms": step,
                "time_ratio": step / base_time,
                "max_rss_mb": rss,
                "rss_ratio": rss / base_rss,
                "cuda_peak_mb": cuda,
                "cuda_peak_ratio": cuda / base_cuda if cuda is not None and base_cuda else None,
            }
        )
    result = {
        "experiment": "memory_profiler_callback_overhead",
        "machine": machine_info(),
        "config": {"model": "DDPM small U-Net, digits 32x32, batch 32", **vars(args), "out": str(args.out)},
        "rows": rows,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "callback_overhead.json").write_text(json.dumps(result, indent=2))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
