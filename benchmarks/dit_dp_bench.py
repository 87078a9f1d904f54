"""DP-SGD on a class-conditional DiT: our four modes against non-private training and stock Opacus.

One training step = forward, per-sample MSE, backward with per-sample clipping and noise, and an
SGD step (stateless, so optimizer state does not blur the comparison). Each mode runs in its own
process (``--all``), so allocator caches and profiler state never leak between modes:

    python benchmarks/dit_dp_bench.py --all --profile small --out docs/benchmarks/dit_dp   # CPU
    python benchmarks/dit_dp_bench.py --all --profile dit_l --batch 8 --device cuda        # GPU
    python benchmarks/dit_dp_bench.py --mode bookkeeping --profile small                  # one mode

Modes: ``vanilla`` (no DP), ``ghost``, ``flash``, ``bookkeeping``, ``flash_bookkeeping`` (this
project's engine), ``opacus_hooks`` and ``opacus_ghost`` (Opacus's ``PrivacyEngine`` with
``grad_sample_mode="hooks"`` / ``"ghost"``, reference rows). Each writes ``<mode>.json``
(``experiment``, ``config``, ``peak_memory_mb``, ``avg_time_ms``, ``breakdown``, ``snapshots``);
``--all`` adds ``summary.json`` (ratios against vanilla) and ``dit_dp_comparison.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_tbp.environment import machine_info

OUR_MODES = ("ghost", "flash", "bookkeeping", "flash_bookkeeping")
MODES = ("vanilla", *OUR_MODES, "opacus_hooks", "opacus_ghost")
PROFILES: dict[str, dict[str, int]] = {
    # pixel-space DiT small enough for 2 CPU cores: 32x32, patch 4 -> 64 tokens
    "small": {"image_size": 32, "channels": 3, "patch": 4, "heads": 4, "head_dim": 32, "layers": 6, "classes": 10},
    # DiT-L/8: hidden 1024, 24 layers, 16 heads, patch 8, 256x256 -> 1024 tokens, 1000 classes
    "dit_l": {"image_size": 256, "channels": 3, "patch": 8, "heads": 16, "head_dim": 64, "layers": 24, "classes": 1000},
}


class PerSampleMSE(nn.Module):
    """MSE over every dimension but the batch; ``reduction`` as torch losses (Opacus ghost sets it)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = (prediction.float() - target.float()).square().flatten(1).mean(dim=1)
        if self.reduction == "none":
            return per_sample
        return per_sample.mean() if self.reduction == "mean" else per_sample.sum()


def build_dit(config: dict[str, Any]) -> nn.Module:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        sample_size=config["image_size"],
        in_channels=config["channels"],
        out_channels=config["channels"],
        patch_size=config["patch"],
        num_attention_heads=config["heads"],
        attention_head_dim=config["head_dim"],
        num_layers=config["layers"],
        num_embeds_ada_norm=config["classes"],
    )


def run_mode(mode: str, config: dict[str, Any], device: torch.device, trials: int, warmup: int) -> dict[str, Any]:
    """Measure ``trials`` training steps of ``mode`` in this process (under a rematerialization
    plan when ``config["plan_budget"]`` is set)."""
    from lightning_tbp.memory.breakdown import Breakdown
    from lightning_tbp.memory.stages import stage_meter_for

    torch.manual_seed(0)
    model = build_dit(config).to(device)
    batch, size, channels = config["batch"], config["image_size"], config["channels"]
    x = torch.randn(batch, channels, size, size, device=device)
    target = torch.randn_like(x)
    timesteps = torch.randint(0, 1000, (batch,), device=device)
    labels = torch.randint(0, config["classes"], (batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    criterion = PerSampleMSE()
    sigma, clip = config["noise_multiplier"], config["max_grad_norm"]
    plan = None
    if config.get("plan_budget") is not None:
        from lightning_tbp.privacy import BACKWARD_PASSES
        from lightning_tbp.remat import Plan

        # planned at the first forward, from a profile with the DP taps in place
        plan = Plan(model, config["plan_budget"], backward_passes=BACKWARD_PASSES.get(mode, 1))
    engine = None
    if mode in OUR_MODES:
        from lightning_tbp.privacy import attach

        engine = attach(model, mode=mode, max_grad_norm=clip, noise_multiplier=sigma)
    elif mode.startswith("opacus_"):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(x.cpu(), target.cpu()), batch_size=batch)
        made = PrivacyEngine(accountant="prv").make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=clip,
            poisson_sampling=False,
            grad_sample_mode=mode.removeprefix("opacus_"),
            **({"criterion": criterion} if mode == "opacus_ghost" else {}),
        )
        model, optimizer = made[0], made[1]
        if mode == "opacus_ghost":
            criterion = made[2]

    def forward() -> torch.Tensor:
        return model(x, timestep=timesteps, class_labels=labels).sample

    def step(meter=None) -> int:
        """One step; returns the DP buffer bytes held after the backward (Opacus's grad_sample)."""
        mark = meter.mark if meter is not None else (lambda stage: None)
        mark("batch_start")
        output = forward()
        mark("after_forward")
        if mode == "vanilla":
            criterion(output, target).backward()
        elif engine is not None:
            criterion.reduction = "none"
            engine.backward(criterion(output, target))
            for param in engine.parameters:
                param.grad.div_(batch)
        else:
            criterion(output, target).backward()
        held = sum(
            getattr(p, "grad_sample", None).numel() * p.element_size()
            for p in model.parameters()
            if getattr(p, "grad_sample", None) is not None
        )
        mark("after_backward")
        optimizer.step()
        mark("after_step")
        optimizer.zero_grad(set_to_none=True)
        return held

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(trials):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)

    if engine is not None:  # freed in the metered step, but allocated before the meter started
        engine.per_sample_norms = engine.clip_coefficients = None
    meter = stage_meter_for(device)
    meter.begin()
    dp_buffers = step(meter)
    readings = meter.end()
    baseline = readings[0].current_bytes  # relative to the batch start: parameters are not in it
    peak = max(r.peak_bytes for r in readings) - baseline
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # At the step's peak: the gradients, Opacus's per-sample gradients, and the rest
    # (saved activations, the engine's transients) above them.
    breakdown = Breakdown(
        parameters=parameter_bytes,
        gradients=gradient_bytes,
        dp_buffers=dp_buffers,
        activations=max(0, peak - gradient_bytes - dp_buffers),
    )
    return {
        "experiment": mode,
        "config": {**config, "device": str(device)},
        "peak_memory_mb": peak / 2**20,
        "peak_memory_with_model_mb": (peak + parameter_bytes) / 2**20,
        "avg_time_ms": statistics.fmean(times),
        "median_time_ms": statistics.median(times),
        "step_times_ms": times,
        "breakdown": breakdown.as_mib(),
        "plan": None
        if plan is None
        else {
            "budget": config["plan_budget"],
            "predicted_peak_mb": plan.current.predicted_peak_bytes / 2**20,
            "naive_peak_mb": plan.current.naive.peak_bytes / 2**20,
            "decisions": {path: option.name.lower() for path, option in plan.current.options.items()},
        },
        "snapshots": [
            {
                "stage": r.stage,
                "current_mb": (r.current_bytes - baseline) / 2**20,
                "peak_mb": (r.peak_bytes - baseline) / 2**20,
            }
            for r in readings
        ],
        "machine": machine_info(),
    }


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    vanilla = results.get("vanilla")
    rows = {}
    for mode, result in results.items():
        row = {"peak_memory_mb": result["peak_memory_mb"], "avg_time_ms": result["avg_time_ms"]}
        if vanilla is not None:
            row["peak_vs_vanilla"] = result["peak_memory_mb"] / vanilla["peak_memory_mb"]
            row["time_vs_vanilla"] = result["avg_time_ms"] / vanilla["avg_time_ms"]
        rows[mode] = row
    return rows


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottoms = [0.0] * len(modes)
    for category in ("parameters_mb", "gradients_mb", "dp_buffers_mb", "activations_mb"):
        values = [max(0.0, results[m]["breakdown"][category]) for m in modes]
        memory_axis.bar(modes, values, bottom=bottoms, label=category.removesuffix("_mb"))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    memory_axis.scatter(
        modes, [results[m]["peak_memory_with_model_mb"] for m in modes], color="black", marker="_", s=400, label="peak"
    )
    memory_axis.set_ylabel("MiB at the step peak (dash: peak incl. parameters)")
    memory_axis.legend(fontsize=8)
    time_axis.bar(modes, [results[m]["avg_time_ms"] for m in modes], color="tab:gray")
    time_axis.set_ylabel("mean step time, ms")
    for axis in (memory_axis, time_axis):
        axis.tick_params(axis="x", rotation=35)
    config = next(iter(results.values()))["config"]
    fig.suptitle(
        f"DiT ({config['layers']} layers, hidden {config['heads'] * config['head_dim']}, "
        f"{(config['image_size'] // config['patch']) ** 2} tokens, batch {config['batch']}) on {config['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--mode", choices=MODES)
    which.add_argument("--all", action="store_true", help="every mode, each in its own process")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="with --all")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, help="override the profile's layer count")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--plan", type=float, help="also install a rematerialization plan at this fraction of the naive peak"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/dit_dp_bench"))
    args = parser.parse_args(argv)
    if args.batch < 1 or args.trials < 1 or args.warmup < 0:
        parser.error("--batch and --trials must be at least 1, --warmup at least 0")
    if args.plan is not None and not 0 < args.plan <= 1:
        parser.error("--plan is a fraction of the naive peak, in (0, 1]")
    if args.plan is not None and args.warmup < 1:
        parser.error("--plan needs --warmup 1 or more: the plan is made in the first step")
    chosen = [args.mode] if args.mode is not None else args.modes
    if args.plan is not None and any(mode.startswith("opacus_") for mode in chosen):
        parser.error("--plan runs this project's modes only (vanilla and the engine's), not stock Opacus")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode is not None:
        config = {
            **PROFILES[args.profile],
            "profile": args.profile,
            "batch": args.batch,
            "noise_multiplier": args.noise_multiplier,
            "max_grad_norm": args.max_grad_norm,
            "plan_budget": args.plan,
        }
        if args.layers is not None:
            config["layers"] = args.layers
        result = run_mode(args.mode, config, torch.device(args.device), args.trials, args.warmup)
        (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=2))
        print(f"{args.mode}: peak {result['peak_memory_mb']:.1f} MiB, {result['avg_time_ms']:.1f} ms/step")
        return 0
    results = {}
    for mode in args.modes:
        command = [sys.executable, __file__, "--mode", mode, *_forwarded(args)]
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            error = completed.stderr.strip().splitlines()[-1] if completed.stderr.strip() else "no output"
            print(f"{mode}: failed: {error}", file=sys.stderr)
            results[mode] = {"error": error}
            continue
        print(completed.stdout.strip().splitlines()[-1])
        results[mode] = json.loads((args.out / f"{mode}.json").read_text())
    measured = {mode: result for mode, result in results.items() if "error" not in result}
    failed = {mode: result["error"] for mode, result in results.items() if "error" in result}
    summary = {"rows": summarise(measured), "failed": failed, "machine": machine_info()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if measured:
        plot(measured, args.out / "dit_dp_comparison.png")
    # a reference row (stock Opacus) may fail and is reported; this project's rows must not
    return 1 if set(failed) - {"opacus_hooks", "opacus_ghost"} else 0


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The options a single-mode child process needs."""
    forwarded = ["--profile", args.profile, "--batch", str(args.batch), "--trials", str(args.trials)]
    forwarded += ["--warmup", str(args.warmup), "--noise-multiplier", str(args.noise_multiplier)]
    forwarded += ["--max-grad-norm", str(args.max_grad_norm), "--device", args.device, "--out", str(args.out)]
    if args.layers is not None:
        forwarded += ["--layers", str(args.layers)]
    if args.plan is not None:
        forwarded += ["--plan", str(args.plan)]
    return forwarded


if __name__ == "__main__":
    sys.exit(main())
