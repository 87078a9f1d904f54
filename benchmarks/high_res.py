"""The largest resolution (and batch) whose U-Net training step fits a memory cap, per method.

    python benchmarks/high_res.py --profile small --cap 64MiB --out docs/benchmarks/verify/high_res
    python benchmarks/high_res.py --profile medium --device cuda --cap 78GiB --max-size 4096

A step fits when it runs and its exact allocator peak above its start (parameters and inputs
excluded, gradients included) is at most ``--cap``; on CUDA a step that runs out of memory does
not fit either. For each mode the benchmark searches, by doubling and then bisection over
multiples of the U-Net's downsampling factor, the largest square size at the profile's batch,
and the largest batch at the profile's size. ``tbp`` plans with the cap as its budget; the other
modes are those of ``methods.py`` (``naive``, ``diffusers``, ``diffusers_every:K``,
``compile:B``). The peak grows with size and batch, which is what makes bisection valid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import PROFILES, Profile, build_case, build_model, get_profile
from common import device_label, pyplot, write_result
from methods import Mode, install, parse_mode

from lightning_tbp import InfeasibleBudgetError
from lightning_tbp.environment import machine_info
from lightning_tbp.memory import measure_peak
from lightning_tbp.remat import parse_budget

DEFAULT_MODES = ["naive", "diffusers", "tbp"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, help="tbp (the cap as budget) or methods.py modes")
    parser.add_argument("--cap", required=True, help='bytes or a size such as "96MiB", "78GiB"')
    parser.add_argument("--max-size", type=int, default=1024, help="stop the size search here")
    parser.add_argument("--max-batch", type=int, default=256, help="stop the batch search here")
    parser.add_argument("--search", choices=["size", "batch", "both"], default="both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/high_res"))
    args = parser.parse_args(argv)
    try:
        budget = parse_budget(int(args.cap) if args.cap.isdigit() else args.cap)
        if budget.kind != "bytes":
            raise ValueError(f"--cap must be bytes or a size such as 96MiB, got {args.cap!r}")
        args.cap_bytes = int(budget.value)
        args.profile = get_profile(args.profile)
        args.modes = [parse_high_res_mode(spec, args.cap_bytes) for spec in args.modes]
    except ValueError as error:
        parser.error(str(error))
    if len({m.spec for m in args.modes}) != len(args.modes):
        parser.error(f"a mode is listed twice: {[m.spec for m in args.modes]}")
    if args.max_size < size_step(args.profile) or args.max_batch < 1:
        parser.error(f"--max-size must be at least {size_step(args.profile)} and --max-batch positive")
    return args


def parse_high_res_mode(spec: str, cap_bytes: int) -> Mode:
    """``tbp`` alone plans at the cap; anything else is a ``methods.py`` mode."""
    if spec == "tbp":
        return Mode("tbp", "tbp", cap_bytes)
    mode = parse_mode(spec)
    if mode.kind == "tbp":
        raise ValueError(f"write tbp without a budget here ({spec!r}): high_res plans at the cap")
    return mode


def size_step(profile: Profile) -> int:
    """Sizes must divide through every downsampling of the U-Net."""
    return 2 ** (len(profile.config()["block_out_channels"]) - 1)


def largest_fitting(fits: Callable[[int], bool], step: int, limit: int) -> int:
    """The largest multiple of ``step`` up to ``limit`` for which ``fits`` holds (0: none).

    Doubling from ``step`` finds a bracket, bisection narrows it; ``fits`` must be monotone."""
    if not fits(step):
        return 0
    good = step
    bad = None
    while bad is None:
        trial = min(good * 2, limit // step * step)
        if trial <= good:
            return good
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


class Prober:
    """Runs one training step of a mode at a size and batch and says whether it fit the cap."""

    def __init__(self, profile: Profile, device: torch.device, cap_bytes: int) -> None:
        self.profile, self.device, self.cap_bytes = profile, device, cap_bytes
        self.model = build_model(profile, device)
        self.probes: list[dict[str, Any]] = []

    def fits(self, mode: Mode, size: int, batch: int) -> bool:
        case = build_case(replace(self.profile, size=size, batch=batch), self.device, self.model)
        probe: dict[str, Any] = {"mode": mode.spec, "size": size, "batch": batch}
        try:
            installed = install(mode, case)
            try:
                self.model.zero_grad(set_to_none=True)
                probe["peak_bytes"] = measure_peak(lambda: case.step(installed.forward), self.device).peak_bytes
            finally:
                installed.remove()
                self.model.zero_grad(set_to_none=True)
            probe["fits"] = probe["peak_bytes"] <= self.cap_bytes
        except InfeasibleBudgetError as error:
            probe |= {"fits": False, "error": f"no plan fits: minimum {error.minimum_budget_bytes} bytes"}
        except torch.OutOfMemoryError:
            probe |= {"fits": False, "error": "out of memory"}
            torch.cuda.empty_cache()
        self.probes.append(probe)
        print(f"  {mode.spec:<18} {size:>5}x{size:<5} batch {batch:>4}: {describe(probe)}", flush=True)
        return probe["fits"]


def describe(probe: dict[str, Any]) -> str:
    verdict = "fits" if probe["fits"] else "does not fit"
    detail = f"peak {probe['peak_bytes'] / 2**20:.1f} MiB" if "peak_bytes" in probe else probe["error"]
    return f"{verdict} ({detail})"


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    prober = Prober(args.profile, device, args.cap_bytes)
    step = size_step(args.profile)
    rows = []
    for mode in args.modes:
        row: dict[str, Any] = {"mode": mode.spec, "kind": mode.kind}
        if args.search in ("size", "both"):
            size = largest_fitting(lambda s, m=mode: prober.fits(m, s, args.profile.batch), step, args.max_size)
            row |= {"max_size": size, "max_pixels": size * size, "size_capped": size == args.max_size // step * step}
        if args.search in ("batch", "both"):
            batch = largest_fitting(lambda b, m=mode: prober.fits(m, args.profile.size, b), 1, args.max_batch)
            row |= {"max_batch": batch, "batch_capped": batch == args.max_batch}
        rows.append(row)
        print(f"{mode.spec}: {json.dumps({k: v for k, v in row.items() if k.startswith('max')})}", flush=True)
    naive = next((r for r in rows if r["mode"] == "naive"), None)
    for row in rows:
        for key in ("max_pixels", "max_batch"):
            if naive is not None and naive.get(key):
                row[f"{key}_ratio"] = row[key] / naive[key]
    return {
        "experiment": "high_res",
        "machine": machine_info(),
        "config": {
            **args.profile.describe(),
            "cap_bytes": args.cap_bytes,
            "max_size": args.max_size,
            "max_batch": args.max_batch,
            "size_step": step,
            "device": str(device),
        },
        "rows": rows,
        "probes": prober.probes,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    rows = result["rows"]
    panels = [
        (k, label) for k, label in (("max_size", "largest square size"), ("max_batch", "largest batch")) if k in rows[0]
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        ax.bar([r["mode"] for r in rows], [r[key] for r in rows], color="tab:blue")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
    config, machine = result["config"], result["machine"]
    fig.suptitle(
        f"{config['profile']} U-Net under a {config['cap_bytes'] / 2**20:.0f} MiB cap "
        f"(batch {config['batch']} / size {config['size']}); {device_label(machine)}",
        fontsize=9,
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_result(run(args), args.out, f"high_res_{args.profile.name}", plot)


if __name__ == "__main__":
    main()
