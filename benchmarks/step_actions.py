"""What each action on the step's bytes buys: whole ``Trainer.fit`` runs of a full fine-tune.

Per setup (a zoo architecture at a batch where its gradients and optimizer step weigh as much as
its activations), four runs of the same fit under ``TinyBackpropStrategy``:

- ``naive``: no plan, the optimizer stepped after the backward;
- ``plan``: the lowest device budget a plan reaches with the ordinary step;
- ``in_backward_at_plan``: each parameter stepped inside the backward, at ``plan``'s budget (what
  the step inside the backward itself costs, the plan at that budget recomputing no more);
- ``plan_in_backward``: the lowest with each parameter stepped inside the backward;
- ``plan_in_backward_adamw8bit``: the same with torchao's 8-bit AdamW (``--low-bit``; torchao
  compiles its step per parameter shape, which takes minutes on a small CPU);
- ``plan_state_on_host``: the lowest with AdamW's state and step on the host, each parameter
  stepped there inside the backward (``optimizer_state_on_host=True``).

The lowest budget is the one the strategy's own error names for a device budget of one byte
(:class:`InfeasibleBudgetError`, plus what training holds). Each run is metered twice: its
device peak is the exact allocator peak of a whole fit (its first steps included) plus the
parameters; its step time is the median of the later steps of a separate, unmetered fit, the
variants interleaved in rounds in this one process. Weights after the fit are compared with the
naive run's (bitwise where the kernels allow).

    python benchmarks/step_actions.py --out docs/benchmarks/step_actions [--rounds 3] [--low-bit] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy
from lightning_tbp.environment import machine_info
from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.testing.zoo_lightning import ZooModule

SETUPS = {"sdxl_unet_b1": ("sdxl_unet", 1), "dit_b1": ("dit", 1)}
VARIANTS = {
    "naive": {"budget": None, "in_backward": False, "optimizer": "adamw", "state_on_host": False},
    "plan": {"budget": "lowest", "in_backward": False, "optimizer": "adamw", "state_on_host": False},
    "in_backward_at_plan": {"budget": "plan", "in_backward": True, "optimizer": "adamw", "state_on_host": False},
    "plan_in_backward": {"budget": "lowest", "in_backward": True, "optimizer": "adamw", "state_on_host": False},
    "plan_in_backward_adamw8bit": {
        "budget": "lowest", "in_backward": True, "optimizer": "adamw8bit", "state_on_host": False,
    },
    "plan_state_on_host": {"budget": "lowest", "in_backward": True, "optimizer": "adamw", "state_on_host": True},
}  # fmt: skip
STEPS_TIMED = 12  # steps of a timing fit; the median is over those after the first six


class WholeFit(L.Callback):
    """The exact allocator peak from the start of training to its end; step wall times."""

    def __init__(self, metered: bool) -> None:
        self.metered = metered
        self._stack = contextlib.ExitStack()
        self.reading: AllocatorPeak | None = None
        self.step_seconds: list[float] = []
        self._started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.metered:
            self.reading = self._stack.enter_context(allocator_peak(trainer.strategy.root_device))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        _synchronize(trainer)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        _synchronize(trainer)
        self.step_seconds.append(time.perf_counter() - self._started)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stack.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stack.close()


ACCELERATOR = {"cpu": "cpu", "cuda": "gpu"}


def _synchronize(trainer: L.Trainer) -> None:
    """Wait for the device's queued work, so a step's wall time is its own (CUDA)."""
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)


def strategy_for(variant: dict, budget: int | None) -> TinyBackpropStrategy:
    return TinyBackpropStrategy(
        memory_budget=budget,
        optimizer_in_backward=variant["in_backward"],
        optimizer_state_on_host=variant["state_on_host"],
    )


def fit(setup: str, variant: dict, budget: int | None, steps: int, metered: bool, device: str) -> dict[str, Any]:
    name, batch = SETUPS[setup]
    module = ZooModule(name, batch, variant["optimizer"])
    loader = DataLoader(TensorDataset(*(r.repeat_interleave(steps, 0) for r in module.rows)), batch_size=batch)
    strategy = strategy_for(variant, budget)
    watch = WholeFit(metered)
    trainer = L.Trainer(
        strategy=strategy, accelerator=ACCELERATOR[device], devices=1, max_steps=steps, logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[watch],
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(module, loader)
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    plan = strategy.plan
    shape_plan = None if plan is None else (plan.current or list(plan.shape_plans.values())[-1])
    return {
        "module": module,
        "device_peak_bytes": None if watch.reading is None else parameters + watch.reading.peak_bytes,
        "step_seconds": watch.step_seconds,
        "predicted_step_bytes": None if shape_plan is None else shape_plan.predicted_peak_bytes,
        "held_bytes": None if shape_plan is None or shape_plan.held is None else shape_plan.held.total,
        "budget_bytes": budget,
        "loop_steps": strategy.loop_steps() if plan is not None else [],
    }


def lowest_budget(setup: str, variant: dict, device: str) -> int:
    """The device budget the strategy names as its minimum when given one byte."""
    name, batch = SETUPS[setup]
    module = ZooModule(name, batch, variant["optimizer"])
    loader = DataLoader(TensorDataset(*module.rows), batch_size=batch)
    strategy = strategy_for(variant, 1)
    trainer = L.Trainer(
        strategy=strategy, accelerator=ACCELERATOR[device], devices=1, max_steps=1, logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module, loader)
    except InfeasibleBudgetError as error:
        assert error.minimum_device_bytes is not None  # a byte budget
        return error.minimum_device_bytes
    raise RuntimeError("a one-byte budget was met")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--low-bit", action="store_true", help="also the 8-bit AdamW variant (torchao; compiles)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--device", choices=sorted(ACCELERATOR), default="cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = {k: v for k, v in VARIANTS.items() if args.low_bit or v["optimizer"] == "adamw"}
    setups = [s for s in SETUPS if not args.only or s in args.only]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for setup in setups:
        reference = None
        for key, variant in variants.items():
            budget = None
            if variant["budget"] == "lowest":
                budget = lowest_budget(setup, variant, args.device)
            elif variant["budget"] == "plan":
                budget = rows[setup, "plan"]["budget_bytes"]
            run = fit(setup, variant, budget, steps=4, metered=True, device=args.device)
            module = run.pop("module")
            if reference is None:
                reference = module
            run["weights_equal_naive"] = all(
                torch.equal(a, b) for a, b in zip(reference.parameters(), module.parameters(), strict=True)
            )
            run.pop("step_seconds")
            rows[setup, key] = {"setup": setup, "variant": key, **variant, **run, "step_medians_s": []}
            print(f"{setup} {key}: device peak {format_bytes(run['device_peak_bytes'])}", flush=True)
    for _ in range(args.rounds):  # interleaved: every variant once per round
        for (setup, key), row in rows.items():
            timed = fit(setup, variants[key], row["budget_bytes"], steps=STEPS_TIMED, metered=False, device=args.device)
            row["step_medians_s"].append(statistics.median(timed["step_seconds"][6:]))
    for row in rows.values():
        row["step_seconds"] = statistics.median(row["step_medians_s"])
    result = {"machine": machine_info(), "device": args.device, "rounds": args.rounds, "rows": list(rows.values())}
    (args.out / "step_actions.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "step_actions.png")
    for row in rows.values():
        naive = rows[row["setup"], "naive"]
        print(
            f"{row['setup']:<14} {row['variant']:<28} peak {format_bytes(row['device_peak_bytes']):>11} "
            f"({row['device_peak_bytes'] / naive['device_peak_bytes']:.3f} of naive), step "
            f"{row['step_seconds'] * 1e3:.1f} ms ({row['step_seconds'] / naive['step_seconds']:.2f}x), "
            f"weights equal: {row['weights_equal_naive']}"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = sorted({row["setup"] for row in result["rows"]})
    figure, axes = plt.subplots(1, len(setups), figsize=(5 * len(setups), 4), squeeze=False)
    for axis, setup in zip(axes[0], setups, strict=True):
        rows = [row for row in result["rows"] if row["setup"] == setup]
        naive = next(row for row in rows if row["variant"] == "naive")
        for row in rows:
            x = row["step_seconds"] / naive["step_seconds"]
            y = row["device_peak_bytes"] / naive["device_peak_bytes"]
            axis.scatter(x, y)
            axis.annotate(row["variant"], (x, y), fontsize=8)
        axis.set_title(setup)
        axis.set_xlabel("step time / naive")
        axis.set_ylabel("device peak / naive")
    meter = "CUDA allocator" if result["device"] == "cuda" else "exact CPU"
    figure.suptitle(f"whole fits, {meter} peaks ({result['machine']['git_commit']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
