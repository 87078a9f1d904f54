"""Memory, time, FLOPs and gradient agreement of one U-Net training step under each method.

    python benchmarks/unet_mem_bench.py --profile small --trials 5 --out docs/benchmarks/verify/unet_mem_bench
    python benchmarks/unet_mem_bench.py --profile large --device cuda --trials 10
    python benchmarks/unet_mem_bench.py --profile small --modes naive diffusers tbp:0.5

Profiles are in ``cases.py`` and modes in ``methods.py``. One model instance runs every mode in
turn, starting each measured step without gradients. For each mode the benchmark records:
``peak_bytes`` (exact allocator peak above the step's start: profiler events on CPU,
``max_memory_allocated`` on CUDA), ``activation_peak_bytes`` (the same minus the parameter
gradients the step allocates), ``step_seconds`` (median of ``--trials`` after ``--warmup``; on CPU timed in turns, see
:func:`time_in_turns`),
``flops`` (torch's FlopCounter, recomputation included) and ``grad_max_rel_diff`` (per
parameter max |g - g_naive| / max |g_naive|, the worst parameter). A mode that fails (out of
memory, say) gets an ``error`` and the others still run.
"""

from __future__ import annotations

import argparse
import sys
from copy import deepcopy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import PROFILES, Case, build_case, get_profile
from common import device_label, grads_of, median_times_in_turns, pyplot, timed_step, write_result
from methods import Mode, install, measure_mode, parse_modes

from lightning_tbp.environment import machine_info

#: The GPU profiles reach further down in budget than the CPU one.
_GPU_PROFILE_MODES = [
    "naive",
    "diffusers",
    "diffusers_every:2",
    "compile:0.5",
    "tbp:0.7",
    "tbp:0.5",
    "tbp:0.4",
    "tbp:lowest",
    "tbp:at:diffusers",
]
DEFAULT_MODES = {
    "small": [
        "naive",
        "diffusers",
        "diffusers_every:2",
        "compile:0.5",
        "tbp:0.8",
        "tbp:0.7",
        "tbp:0.6",
        "tbp:lowest",
        "tbp:at:diffusers",
    ],
    "medium": _GPU_PROFILE_MODES,
    "large": _GPU_PROFILE_MODES,
    "conditioned_small": ["naive", "diffusers", "tbp:0.7", "tbp:lowest", "tbp:at:diffusers"],
}
RATIOS = {
    "peak_ratio": "peak_bytes",
    "activation_ratio": "activation_peak_bytes",
    "time_ratio": "step_seconds",
    "flop_ratio": "flops",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--modes", nargs="+", help="default: the profile's list (see DEFAULT_MODES)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--size", type=int, help="override the profile's image size")
    parser.add_argument("--batch", type=int, help="override the profile's batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        help="time the modes in turns, each on a copy of the model (default: on CPU; on CUDA, off)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/unet_mem"))
    args = parser.parse_args(argv)
    if args.interleave is None:
        args.interleave = not args.device.startswith("cuda")
    if args.trials < 1 or args.warmup < 1:
        parser.error("--trials and --warmup must be at least 1")
    try:
        args.profile = get_profile(args.profile, args.size, args.batch)
        args.modes = parse_modes(args.modes or DEFAULT_MODES[args.profile.name])
    except ValueError as error:
        parser.error(str(error))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    case = build_case(args.profile, device)
    model = case.model
    model.zero_grad(set_to_none=True)
    case.step()
    reference = grads_of(model)
    grad_bytes = sum(g.numel() * g.element_size() for g in reference.values())
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        row = measure_mode(mode, case, args.trials, reference, warmup=args.warmup, earlier_rows=rows)
        if "error" not in row:
            row["activation_peak_bytes"] = row["peak_bytes"] - grad_bytes
        rows.append(row)
        print(describe(row), flush=True)
    if args.interleave:
        time_in_turns(args.modes, case, rows, args)
    add_ratios(rows)
    return {
        "experiment": "unet_mem_bench",
        "machine": machine_info(),
        "config": {
            **args.profile.describe(),
            "trials": args.trials,
            "warmup": args.warmup,
            "device": str(device),
            "parameter_grad_bytes": grad_bytes,
        },
        "rows": rows,
    }


def time_in_turns(modes: list[Mode], case: Case, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Re-time the modes that ran, round-robin, each on its own copy of the model.

    Timed one after another, modes on a shared CPU see different background load (medians moved
    by up to 30% between runs); in turns they see the same. Compiled modes keep their sequential
    time: their compile budget is a process-wide setting, so two cannot be installed at once."""
    entries = []
    for mode, row in zip(modes, rows, strict=True):
        if "error" in row or mode.kind == "compile":
            continue
        if mode.kind == "tbp":  # the budget this row was planned at ("lowest" and "at:" resolved)
            mode = Mode(mode.spec, mode.kind, row["memory_budget"])
        copy = replace(case, model=deepcopy(case.model))
        installed = install(mode, copy)
        entries.append((row, copy, installed))
    runs = [(c.model, lambda c=c, i=i: c.step(i.forward)) for _, c, i in entries]
    for model, step in runs:
        for _ in range(args.warmup):
            timed_step(model, step, case.device)
    for (row, _, installed), seconds in zip(
        entries, median_times_in_turns(runs, args.trials, case.device), strict=True
    ):
        row["step_seconds"], row["timing"] = seconds, "in turns"
        installed.remove()


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each measured row's figures over the naive row's (when naive ran)."""
    naive = next((r for r in rows if r["mode"] == "naive" and "error" not in r), None)
    if naive is None:
        return
    for row in rows:
        if "error" in row:
            continue
        for ratio, key in RATIOS.items():
            row[ratio] = row[key] / naive[key] if naive[key] else None


def describe(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['mode']:<18} failed: {row['error'][:200]}"
    return (
        f"{row['mode']:<18} peak {row['peak_bytes'] / 2**20:9.1f} MiB  activations "
        f"{row['activation_peak_bytes'] / 2**20:9.1f} MiB  GFLOP {row['flops'] / 1e9:8.2f}  "
        f"step {row['step_seconds'] * 1e3:8.1f} ms  grad diff {row['grad_max_rel_diff']:.1e}"
    )


def plot(result: dict[str, Any]) -> Any:
    """Peak memory against step time, one point per mode, both over naive."""
    plt = pyplot()
    rows = [r for r in result["rows"] if "time_ratio" in r]
    fig, ax = plt.subplots(figsize=(7, 5))
    colors = {
        "naive": "black",
        "diffusers": "tab:orange",
        "diffusers_every": "tab:red",
        "compile": "tab:green",
        "tbp": "tab:blue",
    }
    for row in rows:
        ax.scatter(row["time_ratio"], row["peak_ratio"], color=colors[row["kind"]], s=40)
        ax.annotate(
            row["mode"], (row["time_ratio"], row["peak_ratio"]), fontsize=8, xytext=(4, 3), textcoords="offset points"
        )
    ax.set_xlabel("step time / naive")
    ax.set_ylabel("peak memory / naive")
    ax.grid(alpha=0.3)
    config, machine = result["config"], result["machine"]
    ax.set_title(
        f"{config['profile']} profile: {config['family']} {config['size']}x{config['size']}, batch {config['batch']}, "
        f"{config['precision']}\n{device_label(machine)}, torch {machine['torch']}",
        fontsize=9,
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_result(run(args), args.out, f"unet_mem_{args.profile.name}", plot)


if __name__ == "__main__":
    main()
