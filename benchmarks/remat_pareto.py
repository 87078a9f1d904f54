"""Memory / compute Pareto front of rematerialization methods on the reference U-Net.

Reference model: diffusers ``UNet2DModel`` with block_out_channels (32, 64, 64, 128),
layers_per_block 2, attention in the third down block (and the matching up block), 64x64 images,
batch 4, fp32. For each method one training step (forward + backward, gradients freshly
allocated) is measured: exact allocator peak (CPU: profiler allocation events; CUDA: allocator
statistics), FLOPs with torch's FlopCounter (recomputation included), median wall time, and the
largest relative gradient difference from plain autograd.

Methods: naive autograd; diffusers' ``enable_gradient_checkpointing()``; hand-tuned mixes
(selective on every ResNet/attention block; full on all; full except the highest-resolution stages,
selective there); ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``; and
lightning_tbp plans over a sweep of budgets down to the lowest feasible one.

    python benchmarks/remat_pareto.py --out docs/benchmarks --trials 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import UNet2DModel
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import REFERENCE_UNET
from common import StepMeasurement, grads_of, measure_step
from methods import compile_with_budget, reset_compile_budget

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.environment import machine_info
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.options import Option

TBP_BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35)
COMPILE_BUDGETS = (1.0, 0.5, 0.1)


def build(device: torch.device, batch: int, size: int) -> tuple[nn.Module, Callable[[], None]]:
    torch.manual_seed(0)
    model = UNet2DModel(**{**REFERENCE_UNET, "sample_size": size}).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    t = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1)).to(device)
    target = torch.randn_like(x)

    def step(forward: Callable = model) -> None:
        out = forward(x, t)
        out = out.sample if hasattr(out, "sample") else out
        torch.nn.functional.mse_loss(out, target).backward()

    return model, step


def hand_mix(model: nn.Module, name: str) -> InstalledWrappers:
    """The hand-tuned mixes from the design notes, applied through the same executor."""
    blocks = {path: m for path, m in model.named_modules() if type(m).__name__ in ("ResnetBlock2D", "Attention")}
    top_res = ("down_blocks.0.", "up_blocks.3.")
    if name == "selective_all":
        options = dict.fromkeys(blocks, Option.SELECTIVE)
    elif name == "full_all":
        options = dict.fromkeys(blocks, Option.FULL)
    else:  # full except the highest-resolution stages, which get selective
        options = {p: Option.SELECTIVE if p.startswith(top_res) else Option.FULL for p in blocks}
    wrappers = InstalledWrappers(model, options, defaultdict(lambda: sys.maxsize))  # cache every heavy output
    wrappers.ensure(options)
    return wrappers


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    model, step = build(device, args.batch, args.size)
    rows: list[dict] = []

    def record(method: str, config: dict, m: StepMeasurement, **extra) -> None:
        row = {"method": method, "config": config, **m.as_dict(), **extra}
        rows.append(row)
        print(
            f"{method:<24} {json.dumps(config):<28} peak {m.peak_bytes / 2**20:8.1f} MiB  "
            f"GFLOP {m.flops / 1e9:7.2f}  step {m.step_seconds:6.3f}s  grad diff {m.grad_max_rel_diff}",
            flush=True,
        )

    model.zero_grad(set_to_none=True)
    step()
    reference = grads_of(model)
    record("naive", {}, measure_step(model, step, args.trials, reference))

    model.enable_gradient_checkpointing()
    record("diffusers_checkpointing", {}, measure_step(model, step, args.trials, reference))
    model.disable_gradient_checkpointing()

    for mix in ("selective_all", "full_all", "full_except_top_res"):
        wrappers = hand_mix(model, mix)
        record("hand_mix", {"mix": mix}, measure_step(model, step, args.trials, reference))
        wrappers.remove()

    x_budgets: list[object] = list(TBP_BUDGETS)
    try:
        rematerialize(model, *step_inputs(args, device), memory_budget=1)
    except InfeasibleBudgetError as error:
        x_budgets.append(error.minimum_budget_bytes)
    for budget in x_budgets:
        start = time.perf_counter()
        try:
            plan = rematerialize(model, *step_inputs(args, device), memory_budget=budget)
        except InfeasibleBudgetError:
            continue
        plan_seconds = time.perf_counter() - start
        shape_plan = plan.current
        assert shape_plan is not None
        m = measure_step(model, step, args.trials, reference)
        plan.remove()
        record(
            "tiny_backprop",
            {"budget": budget if isinstance(budget, float) else "lowest"},
            m,
            predicted_peak_bytes=shape_plan.predicted_peak_bytes,
            plan_seconds=plan_seconds,
            solve_seconds=shape_plan.solve_seconds,
            max_nesting=max(b.level for b in shape_plan.blocks),
            decisions={p: o.name.lower() for p, o in shape_plan.options.items()},
        )

    if not args.skip_compile:
        for backend in ("inductor", "aot_eager_min_cut"):
            for budget in COMPILE_BUDGETS:
                start = time.perf_counter()
                compiled = compile_with_budget(model, backend, budget)
                m = measure_step(model, lambda c=compiled: step(c), args.trials, reference)
                record(
                    "torch_compile",
                    {"backend": backend, "activation_memory_budget": budget},
                    m,
                    compile_and_measure_seconds=time.perf_counter() - start,
                )
        reset_compile_budget()

    naive = rows[0]
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / naive["peak_bytes"]
        row["flop_ratio"] = row["flops"] / naive["flops"] if row["flops"] else None
        row["time_ratio"] = row["step_seconds"] / naive["step_seconds"]
    return {
        "experiment": "remat_pareto",
        "machine": machine_info(),
        "config": {
            "unet": REFERENCE_UNET,
            "batch": args.batch,
            "size": args.size,
            "dtype": "float32",
            "trials": args.trials,
        },
        "rows": rows,
    }


def step_inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(args.batch, 3, args.size, args.size, device=device), torch.zeros(
        args.batch, dtype=torch.long, device=device
    )


def series_name(row: dict) -> str:
    backend = row["config"].get("backend")
    return f"{row['method']}[{backend}]" if backend else row["method"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {
        "naive": ("black", "s"),
        "diffusers_checkpointing": ("tab:orange", "D"),
        "hand_mix": ("tab:purple", "^"),
        "torch_compile[inductor]": ("tab:green", "v"),
        "torch_compile[aot_eager_min_cut]": ("tab:olive", "<"),
        "tiny_backprop": ("tab:blue", "o"),
    }
    for ax, key, label in ((axes[0], "flop_ratio", "FLOPs / naive"), (axes[1], "time_ratio", "step time / naive")):
        for series, (color, marker) in styles.items():
            rows = [r for r in result["rows"] if series_name(r) == series and r.get(key) is not None]
            if not rows:
                continue
            rows.sort(key=lambda r: r["peak_ratio"])
            xs, ys = [r[key] for r in rows], [r["peak_ratio"] for r in rows]
            ax.plot(
                xs,
                ys,
                marker=marker,
                color=color,
                label=series,
                linestyle="-" if series == "tiny_backprop" and key == "flop_ratio" else "",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("measured peak / naive")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    machine = result["machine"]
    fig.suptitle(
        f"Reference UNet2DModel 64x64, batch {result['config']['batch']}: {machine['processor']}, "
        f"{machine['cpu_count']} cores, torch {machine['torch']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--skip-compile", action="store_true", help="leave out torch.compile (slow to compile on CPU)")
    parser.add_argument("--plot-only", type=Path, help="redraw the plot from an existing JSON result")
    args = parser.parse_args()
    if args.trials < 1 or args.batch < 1 or args.size < 8:
        parser.error("--trials and --batch must be positive and --size at least 8")
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remat_pareto.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "remat_pareto.png")
    print(f"wrote {args.out / 'remat_pareto.json'} and {args.out / 'remat_pareto.png'}")


if __name__ == "__main__":
    main()
