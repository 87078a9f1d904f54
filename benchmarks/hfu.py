"""FLOPs per training step and hardware/model FLOPs utilisation of the DDPM U-Net.

    python benchmarks/hfu.py --profile small --out docs/benchmarks/verify/hfu            # this CPU
    python benchmarks/hfu.py --profile medium --batches 64 72 --device cuda        # the target

For each batch and mode, one training step is measured (median time of ``--trials`` after a
warm-up) and its FLOPs counted with torch's FlopCounter:
- ``hardware_flops``: the FLOPs the step executes, recomputation included;
- ``model_flops``: the naive step's FLOPs at the same batch (what the model needs);
- ``hfu`` = hardware_flops / time / peak and ``mfu`` = model_flops / time / peak.
A plan's recomputation raises HFU but not MFU. Under ``torch.compile`` FlopCounter sees the
traced graph, not Inductor's kernels, so its count is the eager graph's.

The peak: ``--peak-tflops`` if given; on a GPU in ``GPU_PEAK_TFLOPS`` the vendor's dense figure
for the step's precision; otherwise measured here as the best rate of a large matmul in that
precision (the JSON says which).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import build_case, build_model, get_profile
from common import device_label, grads_of, pyplot, write_result
from methods import measure_mode, parse_modes

from lightning_tbp.environment import machine_info

# vendor datasheet peaks, TFLOP/s: bf16 dense tensor cores; fp32 without TF32 (torch's default for matmul)
GPU_PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "fp32": 66.9},
    "NVIDIA H200": {"bf16": 989.4, "fp32": 66.9},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "fp32": 19.5},
}
PROFILE_SIZES = {"small": 32, "medium": 128}
DEFAULT_BATCHES = {"small": [4, 8], "medium": [64, 72]}
DEFAULT_MODES = ["naive", "compile:1.0", "tbp:0.7", "tbp:lowest"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILE_SIZES), default="small")
    parser.add_argument("--batches", type=int, nargs="+", help="default: small 4 8, medium 64 72")
    parser.add_argument("--size", type=int, help="default: small 32, medium 128")
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 elsewhere")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak in the step's precision")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/hfu"))
    args = parser.parse_args(argv)
    args.batches = args.batches or DEFAULT_BATCHES[args.profile]
    args.size = args.size or PROFILE_SIZES[args.profile]
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.trials < 1 or min(args.batches) < 1:
        parser.error("--trials and every batch must be positive")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error("--peak-tflops must be positive")
    try:
        args.modes = parse_modes(args.modes)
    except ValueError as error:
        parser.error(str(error))
    if "naive" not in [m.spec for m in args.modes]:
        parser.error("--modes must include naive: it defines the model FLOPs")
    return args


def peak_flops(device: torch.device, precision: str, given_tflops: float | None) -> tuple[float, str]:
    """FLOP/s the utilisation is taken against, and where the figure comes from."""
    if given_tflops is not None:
        return given_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if name in GPU_PEAK_TFLOPS:
            return GPU_PEAK_TFLOPS[name][precision] * 1e12, f"vendor dense peak for {name}, {precision}"
    return measured_matmul_flops(device, precision), f"measured: best {precision} matmul rate on this device"


def measured_matmul_flops(device: torch.device, precision: str, n: int = 2048, repeats: int = 10) -> float:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    base = replace(get_profile(args.profile, size=args.size), bf16=args.precision == "bf16")
    peak, peak_source = peak_flops(device, args.precision, args.peak_tflops)
    model = build_model(base, device)
    rows = []
    for batch in args.batches:
        case = build_case(replace(base, batch=batch), device, model)
        model.zero_grad(set_to_none=True)
        case.step()
        reference = grads_of(model)
        batch_rows = [measure_mode(mode, case, args.trials, reference) | {"batch": batch} for mode in args.modes]
        naive = next(r for r in batch_rows if r["mode"] == "naive")
        for row in batch_rows:
            if "error" in row:
                print(f"batch {batch:>3} {row['mode']:<12} failed: {row['error'][:200]}", flush=True)
                continue
            row["hardware_flops"] = row["flops"]
            row["model_flops"] = naive.get("flops")
            row["achieved_tflops"] = row["hardware_flops"] / row["step_seconds"] / 1e12
            row["hfu"] = row["hardware_flops"] / row["step_seconds"] / peak
            row["mfu"] = row["model_flops"] / row["step_seconds"] / peak if row["model_flops"] else None
            mfu = "n/a (naive failed)" if row["mfu"] is None else f"{row['mfu']:.3f}"
            print(
                f"batch {batch:>3} {row['mode']:<12} step {row['step_seconds'] * 1e3:8.1f} ms  "
                f"GFLOP {row['hardware_flops'] / 1e9:8.1f}  HFU {row['hfu']:.3f}  MFU {mfu}",
                flush=True,
            )
        rows += batch_rows
    return {
        "experiment": "hfu",
        "machine": machine_info(),
        "config": {**base.describe(), "batches": args.batches, "trials": args.trials, "device": str(device)},
        "peak_flops": peak,
        "peak_source": peak_source,
        "rows": rows,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(modes)
    for ax, key in zip(axes, ("hfu", "mfu"), strict=True):
        for i, mode in enumerate(modes):
            values = [
                next((r.get(key) or 0 for r in rows if r["batch"] == b and r["mode"] == mode), 0) for b in batches
            ]
            ax.bar([j + i * width for j in range(len(batches))], values, width, label=mode)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel(key.upper())
    axes[0].legend(fontsize=8)
    machine = result["machine"]
    fig.suptitle(
        f"{result['config']['profile']} U-Net {result['config']['size']}px, {result['config']['precision']}: "
        f"{device_label(machine)}; peak {result['peak_flops'] / 1e12:.2f} TFLOP/s "
        f"({result['peak_source']})",
        fontsize=9,
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_result(run(args), args.out, f"hfu_{args.profile}", plot)


if __name__ == "__main__":
    main()
