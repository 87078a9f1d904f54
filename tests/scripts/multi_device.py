"""Two-process CPU (gloo) runs of the multi-device strategies; run as a script, since Lightning's
launcher re-runs argv for rank 1.

python multi_device.py SCENARIO OUT_DIR

Scenarios (each writes what the test compares into OUT_DIR, from rank 0 unless said):
  ddp, fsdp2   4 SGD steps with the plan on a deterministic regression; final parameters
               (params.pt), the plan each rank ran (plan_rank{r}.json), its metered loop steps
               and the loss it measured (loop_steps_rank{r}.json, loss_rank{r}.json), memory
               JSON per rank (ddp)
  ddp_fused, fsdp2_fused
               the same with the optimizer inside the backward; how many parameters each rank
               stepped inside its last backward and after it (stepped_rank{r}.json)
  ddp_idle     the same under "auto" with DDP's buckets as gradients: the communication hook in
               place, idle (the budget never needs the step inside the backward)
  ddp_bytes    ddp under a byte budget per device, the whole fit measured by the exact meter from
               before DDP wraps the model (whole_fit_rank{r}.json: its peak, the parameters'
               bytes, the budget, the loop's metered steps)
  ddp_host_tier
               ddp at a budget only the host tier meets (0.44 of the step's naive peak: 0.469
               without it, 0.416 with it), taken by "auto"
  fsdp2_host_tier
               fsdp2 at a budget only the host tier meets (0.42 of the step's naive peak: 0.464
               without it), taken by "auto" with the optimizer inside the backward
  lora_ddp_stream
               lora_ddp under a byte budget per device below its parameters' bytes (the test's
               TBP_STREAM_BUDGET): only its frozen base weights streamed from the host meet it
  ddp_adam     ddp_fused with Adam
  ddp_host     ddp_adam with the state and step on the host (optimizer_state_on_host=True)
  dp_ddp       one DP step (ghost, noise 0): initial weights, each rank's sample indices,
               the gradient the optimizer saw (dp.pt, indices_rank{r}.pt)
  dp_noise     one DP step with noise 1 and a loss whose gradient is 0: the gradient is the noise
  dp_ddp_offload
               dp_ddp at a budget only the host tier meets (0.40 of the step's naive peak: 0.424
               without it, 0.373 with it, in one process), the optimizer as it is: activations
               offloaded, brought back in both backward passes
  raise        rank 1 raises at its second step
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import tiny_unet

from lightning_tbp import MemoryProfilerCallback
from lightning_tbp.diffusion import LoraOptions, add_lora
from lightning_tbp.memory.meters import allocator_peak

SAMPLES = 8
PER_RANK_BATCH = 2


def regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 3, 32, 32, generator=generator)
    y = torch.randn(SAMPLES, 3, 32, 32, generator=generator)
    t = torch.arange(SAMPLES) * 97 % 1000
    return TensorDataset(torch.arange(SAMPLES), x, t, y)


class Regressor(L.LightningModule):
    """Deterministic per-sample loss (no random noise), so runs of any layout can be compared."""

    def __init__(self, scenario: str, out: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = tiny_unet()
        if scenario.startswith("lora"):  # only rank-4 adapters on the attention projections train
            add_lora(self.net, LoraOptions(rank=4))
        self.scenario, self.out = scenario, out
        self.seen: list[torch.Tensor] = []  # sample indices per step

    def training_step(self, batch, batch_idx):
        index, x, t, y = batch
        if self.scenario == "raise" and self.global_rank == 1 and batch_idx == 1:
            raise RuntimeError("rank 1 fails on purpose")
        self.seen.append(index)
        torch.save(self.seen, self.out / f"indices_rank{self.global_rank}.pt")
        x, y = self.sized(x), self.sized(y)
        per_sample = (self.net(x, t).sample - y).pow(2).flatten(1).mean(1)
        if self.scenario == "dp_noise":
            per_sample = per_sample * 0
        return per_sample if self.scenario.startswith("dp") else per_sample.mean()

    def sized(self, images: torch.Tensor) -> torch.Tensor:
        """The images the scenario trains on: 8x8 where the frozen weights must outweigh the
        activations (streaming them is then what a budget below the weights needs)."""
        return torch.nn.functional.avg_pool2d(images, 4) if self.scenario == "lora_ddp_stream" else images

    def on_train_start(self) -> None:
        if self.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in self.net.state_dict().items()}, self.out / "initial.pt")

    def configure_optimizers(self):
        return optimizer_for(self.scenario, self.parameters())


def optimizer_for(scenario: str, params) -> torch.optim.Optimizer:
    """Adam where the scenario moves its state to the host (SGD without momentum keeps none)."""
    adam = scenario in ("ddp_adam", "ddp_host")
    return torch.optim.Adam(params, lr=1e-2) if adam else torch.optim.SGD(params, lr=0.1)


class DPRegressor(Regressor):
    """Saves the gradient the optimizer sees (which a step inside the backward would refuse)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.global_rank == 0:
            grads = {name: p.grad.clone() for name, p in self.net.named_parameters()}
            torch.save(
                {"grads": grads, "expected_batch": self.trainer.strategy.privacy.expected_batch_size},
                self.out / "dp.pt",
            )


class StepCounts(L.Callback):
    """How many parameters the last step stepped inside its backward and after it, per rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stepper = trainer.strategy._in_backward.stepper
        counts = {"stepped": stepper.stepped, "after": stepper.stepped_after, "on_host": stepper.host is not None}
        (self.out / f"stepped_rank{trainer.global_rank}.json").write_text(json.dumps(counts))


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.named_parameters()
    }


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    strategy = {"ddp": "tiny_backprop_ddp", "fsdp2": "tiny_backprop_fsdp2"}.get(scenario, "tiny_backprop_ddp")
    if scenario.endswith("_fused"):
        from lightning_tbp import TinyBackpropDDPStrategy, TinyBackpropFSDP2Strategy

        fused = {"ddp_fused": TinyBackpropDDPStrategy, "fsdp2_fused": TinyBackpropFSDP2Strategy}[scenario]
        strategy = fused(optimizer_in_backward=True)
    if scenario == "ddp_adam":
        from lightning_tbp import TinyBackpropDDPStrategy

        strategy = TinyBackpropDDPStrategy(optimizer_in_backward=True)
    if scenario == "ddp_host":
        from lightning_tbp import TinyBackpropDDPStrategy

        strategy = TinyBackpropDDPStrategy(optimizer_in_backward=True, optimizer_state_on_host=True)
    if scenario == "ddp_idle":  # "auto" with its communication hook in place, never needing the step
        from lightning_tbp import TinyBackpropDDPStrategy

        strategy = TinyBackpropDDPStrategy(gradient_as_bucket_view=True)
    if scenario == "ddp_bytes":  # room for the planner's own measuring (8.6 to 9.2 MiB here) beside what is held
        from lightning_tbp import TinyBackpropDDPStrategy

        parameter_bytes = sum(p.numel() * p.element_size() for p in tiny_unet().parameters())
        budget = 2 * parameter_bytes + 10 * 2**20  # the parameters, DDP's buckets (a copy of the gradients), the step
        # init_sync=False: the ranks build the same weights (seed 0), and DDP's initial broadcast
        # flattens them into one copy that gloo's worker thread sometimes frees; the exact CPU
        # meter sees only the training thread's frees, so the whole fit would then read a copy of
        # the parameters too high (2 runs in 9 here, and stop 55's CI)
        strategy = TinyBackpropDDPStrategy(memory_budget=budget, init_sync=False)
    if scenario == "ddp_host_tier":
        from lightning_tbp import TinyBackpropDDPStrategy

        strategy = TinyBackpropDDPStrategy(memory_budget=0.44)
    if scenario == "fsdp2_host_tier":
        from lightning_tbp import TinyBackpropFSDP2Strategy

        strategy = TinyBackpropFSDP2Strategy(memory_budget=0.42)
    if scenario == "lora_ddp_stream":
        from lightning_tbp import TinyBackpropDDPStrategy

        strategy = TinyBackpropDDPStrategy(memory_budget=int(os.environ["TBP_STREAM_BUDGET"]))
    if scenario.startswith("dp"):
        from lightning_tbp import TinyBackpropDDPStrategy

        noise = 1.0 if scenario == "dp_noise" else 0.0
        strategy = TinyBackpropDDPStrategy(memory_budget=0.6, dp="ghost", max_grad_norm=1e-3, noise_multiplier=noise)
        if scenario == "dp_ddp_offload":
            strategy = TinyBackpropDDPStrategy(
                memory_budget=0.40,
                dp="ghost",
                max_grad_norm=1e-3,
                noise_multiplier=noise,
                optimizer_in_backward=False,
                optimizer_state_on_host=False,
            )
    model = (DPRegressor if scenario.startswith("dp") else Regressor)(scenario, out)
    callbacks = (
        [MemoryProfilerCallback(every_n_steps=1, warmup_steps=1, output_dir=out / "memory")]
        if scenario == "ddp"
        else [StepCounts(out)]
        if scenario.endswith(("_fused", "_idle", "_adam", "_host"))
        else []
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=1 if scenario.startswith("dp") else 4,
        logger=False,
        default_root_dir=out,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    data = DataLoader(regression_data(), batch_size=PER_RANK_BATCH)  # a GPU's dataset is on the host: not metered
    with allocator_peak("cpu") as whole_fit:
        trainer.fit(model, data)
    if scenario == "ddp_bytes":
        record = {
            "peak_bytes": whole_fit.peak_bytes,
            "parameter_bytes": parameter_bytes,
            "budget_bytes": budget,
            "loop_steps": trainer.strategy.loop_steps(),
        }
        (out / f"whole_fit_rank{trainer.global_rank}.json").write_text(json.dumps(record))
    plan = trainer.strategy.plan
    rank = trainer.global_rank
    if plan is not None and plan.shape_plans:
        (in_force,) = plan.shape_plans.values()  # one input shape; current is None after a last-step correction
        options = {path: option.name for path, option in in_force.options.items()}
        (out / f"plan_rank{rank}.json").write_text(json.dumps(options))
        (out / f"loop_steps_rank{rank}.json").write_text(json.dumps(trainer.strategy.loop_steps()))
        (out / f"loss_rank{rank}.json").write_text(json.dumps(in_force.measured_loss_bytes))
    state = full_state(model.net)
    if rank == 0:
        torch.save(state, out / "params.pt")
