"""The budget is a promise about every step of the loop the user runs, measured over whole fits.

Each test runs ``Trainer.fit`` for several steps (the first included: profiling, calibration,
metering) inside one exact allocator region, from the start of training to its end, and takes
the region's peak above what training held when it started (parameters, EMA copies, the data
module's tensors) less the optimizer state its first step made: the step as the loop really
runs it (the last step's gradients, accumulation, the optimizer step, validation in between).
That peak must be within the plan's budget and within 5% of its prediction.
"""

from __future__ import annotations

import contextlib
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy
from lightning_tbp.diffusion import DiffusionModule
from lightning_tbp.diffusion.data import DigitsDataModule
from lightning_tbp.memory.breakdown import tensor_bytes
from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak
from lightning_tbp.remat.step import PriorGradients
from lightning_tbp.testing.zoo_lightning import ZooModule
from lightning_tbp.testing.zoo_models import ZOO
from lightning_tbp.testing.zoo_models import sample as zoo_sample

MAIN_JOB_UNET = {
    "sample_size": 16,
    "in_channels": 1,
    "out_channels": 1,
    "block_out_channels": [32, 64, 64],
    "layers_per_block": 2,
    "norm_num_groups": 8,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": 8,
}


class WholeFit(Callback):
    """An exact allocator region from the start of training to its end, and the optimizer state
    held at its end (read there: on CUDA, Lightning's teardown moves the state to the CPU)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.reading: AllocatorPeak | None = None
        self.optimizer_state_bytes = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reading = self._stack.enter_context(allocator_peak(trainer.strategy.root_device))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        self.optimizer_state_bytes = tensor_bytes(pl_module, trainer.optimizers, device).optimizer_state
        self._stack.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stack.close()  # a fit that raises (an infeasible budget) leaves no region open


def _fit(module: L.LightningModule, data: object, strategy: TinyBackpropStrategy, **trainer_kwargs) -> dict:
    torch.manual_seed(0)
    watch = WholeFit()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=trainer_kwargs.pop("accelerator", "cpu"),
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[watch, *trainer_kwargs.pop("callbacks", [])],
        **trainer_kwargs,
    )
    trainer.fit(module, data)
    assert watch.reading is not None
    shape_plan = strategy.plan.current or list(strategy.plan.shape_plans.values())[-1]
    return {
        "step_peak": watch.reading.peak_bytes - watch.optimizer_state_bytes,
        "plan": shape_plan,
        "loop_steps": strategy.loop_steps(),
        "strategy": strategy,
        "module": module,
    }


def _assert_the_promise_holds(run: dict) -> None:
    plan, step_peak = run["plan"], run["step_peak"]
    assert step_peak <= plan.budget_bytes, (step_peak, plan.budget_bytes)
    assert abs(step_peak / plan.predicted_peak_bytes - 1) <= 0.05, (step_peak, plan.predicted_peak_bytes)
    assert [s["step"] for s in run["loop_steps"]][:3] == [0, 1, 2]  # the first steps were metered too
    for step in run["loop_steps"]:
        assert step["peak_bytes"] <= step["budget_bytes"], step
        assert abs(step["peak_bytes"] / step["predicted_bytes"] - 1) <= 0.05, step


def _main_job_module() -> DiffusionModule:
    return DiffusionModule(
        family="unet2d", model_config=MAIN_JOB_UNET, lr=1e-3, ema_decay=0.99, sample_images=0, export=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_main_jobs_whole_fit_stays_within_its_budget_and_prediction(accumulate: int) -> None:
    """The main job's module, EMA and validation included: every step, not only the metered one."""
    data = DigitsDataModule(image_size=16, batch_size=16)
    strategy = TinyBackpropStrategy(memory_budget=0.5)
    run = _fit(
        _main_job_module(),
        data,
        strategy,
        max_steps=5,
        accumulate_grad_batches=accumulate,
        limit_val_batches=1,
        val_check_interval=4 * accumulate,
    )
    _assert_the_promise_holds(run)
    cases = run["plan"].loop.gradients
    expected = {PriorGradients.RELEASED} | ({PriorGradients.ACCUMULATED} if accumulate > 1 else set())
    assert cases == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dit", "sd3", "sdxl_unet"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_zoo_whole_fits_stay_within_budget_and_prediction(name: str, accumulate: int) -> None:
    """At batch 4 these tiny models hold more in gradients and the optimizer's step than in
    activations, which no plan lowers: 0.9 of their naive peak is what a plan reaches on all."""
    module = ZooModule(name, batch=4)
    loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=4)
    strategy = TinyBackpropStrategy(memory_budget=0.9)
    run = _fit(module, loader, strategy, max_steps=4, accumulate_grad_batches=accumulate)
    _assert_the_promise_holds(run)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_whole_fit_with_the_optimizer_in_the_backward_holds_its_promise(accumulate: int) -> None:
    """At batch 1 a full fine-tune of the SDXL-style U-Net is bound by its gradients, not its
    activations. With each parameter stepped where its gradient completes and the gradient freed,
    the plan counts that step (exactly where no earlier gradients are held; as an upper bound
    with accumulation), every metered step holds it, and a device budget below the ordinary
    step's lowest plan, refused there, is met: forced, or by the planner's own choice ("auto",
    the default), with the weights of the ordinary step."""

    def run(in_backward: bool | str, budget: int) -> dict:
        module = ZooModule("sdxl_unet", batch=1)
        loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=1)
        strategy = TinyBackpropStrategy(memory_budget=budget, optimizer_in_backward=in_backward)
        return _fit(module, loader, strategy, max_steps=4, accumulate_grad_batches=accumulate)

    roomy = 80 << 20  # bytes: the device's, parameters and optimizer state included
    fused, ordinary = run(True, roomy), run(False, roomy)
    assert fused["plan"].loop.step_in_backward and not ordinary["plan"].loop.step_in_backward
    if accumulate > 1:
        assert fused["step_peak"] <= fused["plan"].budget_bytes
        assert fused["step_peak"] <= 1.05 * fused["plan"].predicted_peak_bytes
        assert all(s["peak_bytes"] <= s["budget_bytes"] for s in fused["loop_steps"])
        return
    _assert_the_promise_holds(fused)
    assert fused["step_peak"] < 0.8 * ordinary["step_peak"], (fused["step_peak"], ordinary["step_peak"])
    held = roomy - fused["plan"].budget_bytes
    tight = held + int(1.15 * fused["plan"].naive.peak_bytes)
    with pytest.raises(InfeasibleBudgetError):
        run(False, tight)
    _assert_the_promise_holds(run(True, tight))
    chosen = run("auto", tight)
    _assert_the_promise_holds(chosen)
    assert chosen["plan"].loop.step_in_backward and chosen["plan"].actions
    for (path, a), b in zip(ordinary["module"].named_parameters(), chosen["module"].parameters(), strict=True):
        assert torch.equal(a, b), path


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "in_backward"), [("ghost", False), ("bookkeeping", False), ("bookkeeping", True)])
def test_a_dp_whole_fit_with_accumulation_stays_within_budget_and_prediction(mode: str, in_backward: bool) -> None:
    """``in_backward``: each parameter noised and stepped as bookkeeping's sums (and the blocks it
    runs again) complete it."""
    data = DigitsDataModule(image_size=16, batch_size=8)
    strategy = TinyBackpropStrategy(
        memory_budget=0.6, dp=mode, noise_multiplier=1.0, max_grad_norm=1.0, optimizer_in_backward=in_backward
    )
    run = _fit(_main_job_module(), data, strategy, max_steps=3, accumulate_grad_batches=2, limit_val_batches=0)
    plan, step_peak = run["plan"], run["step_peak"]
    # Poisson batches are at most the plan's ceiling: the budget holds, the prediction is an upper bound
    assert step_peak <= plan.budget_bytes
    assert step_peak <= 1.05 * plan.predicted_peak_bytes
    assert run["loop_steps"] and all(s["peak_bytes"] <= s["budget_bytes"] for s in run["loop_steps"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_a_dp_whole_fit_under_bf16_mixed_stays_within_budget_and_prediction(mode: str) -> None:
    """Lightning's ``bf16-mixed`` (autocast without its weight cache) around the DP engine's
    passes: its per-layer meters run with autocast off, as its backward does, so a step is
    predicted at the sizes it runs at. Every metered step of the fit within the budget, and the
    metered step within 5% above its prediction (made for the largest Poisson batch)."""
    data = DigitsDataModule(image_size=16, batch_size=8)
    strategy = TinyBackpropStrategy(memory_budget=0.6, dp=mode, noise_multiplier=1.0, max_grad_norm=1.0)
    run = _fit(_main_job_module(), data, strategy, max_steps=3, limit_val_batches=0, precision="bf16-mixed")
    plan, step_peak = run["plan"], run["step_peak"]
    assert step_peak <= plan.budget_bytes
    assert step_peak <= 1.05 * plan.predicted_peak_bytes
    assert run["loop_steps"] and all(s["peak_bytes"] <= s["budget_bytes"] for s in run["loop_steps"])


class KeepsGradients(L.Callback):
    """Reads the gradients in ``on_before_zero_grad``: they must be there, so the strategy cannot
    free them early, and the plan counts them through the forward instead."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        self.seen.append(all(p.grad is not None for p in pl_module.model.parameters() if p.requires_grad))


@pytest.mark.slow
def test_gradients_someone_reads_before_zero_grad_are_kept_and_counted() -> None:
    keeps = KeepsGradients()
    data = DigitsDataModule(image_size=16, batch_size=16)
    strategy = TinyBackpropStrategy(memory_budget=0.5)
    run = _fit(_main_job_module(), data, strategy, max_steps=4, limit_val_batches=0, callbacks=[keeps])
    assert keeps.seen[1:] == [True] * (len(keeps.seen) - 1)  # the first step has none yet
    assert PriorGradients.UNTIL_BACKWARD in run["plan"].loop.gradients
    _assert_the_promise_holds(run)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_lora_fit_over_a_quantized_base_holds_its_promise(kind: str) -> None:
    """The main job's U-Net as a LoRA fine-tune with its base quantized by torchao: every metered
    step of the fit, the first included, within the budget and 5% of its prediction."""
    pytest.importorskip("torchao")
    module = DiffusionModule(
        family="unet2d",
        model_config=MAIN_JOB_UNET,
        lr=1e-3,
        lora_rank=4,
        base_quantization=kind,
        sample_images=0,
        export=False,
    )
    run = _fit(
        module,
        DigitsDataModule(image_size=16, batch_size=16),
        TinyBackpropStrategy(memory_budget=0.5),
        max_steps=4,
        limit_val_batches=0,
    )
    full_precision = sum(p.numel() * 4 for p in module.model.parameters())  # quantized ones at their apparent size
    assert run["plan"].held.parameters < full_precision  # the base counted as it is held
    _assert_the_promise_holds(run)


class NoisyVectors(L.LightningModule):
    """Denoising flat vectors with an MLP: the batch, the noise and the noisy inputs are a large
    share of its step (the loop keeps them beside the planned module, no trace of which sees them)."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(
            *(
                torch.nn.Sequential(
                    torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
                )
                for _ in range(depth)
            )
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (clean,) = batch
        noise = torch.randn_like(clean)
        return torch.nn.functional.mse_loss(self.model(clean + noise), noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.6, 0.9])
def test_what_the_loop_keeps_beside_the_planned_module_is_counted(budget: float) -> None:
    """The batch, the noise and the noisy inputs (about a fifth of this step) are measured where the
    module is called and counted in every prediction: the promise holds from the first step."""
    loader = DataLoader(TensorDataset(torch.randn(4096, 64)), batch_size=1024)
    run = _fit(NoisyVectors(), loader, TinyBackpropStrategy(memory_budget=budget), max_steps=4)
    alongside = run["plan"].alongside
    batch = 1024 * 64 * 4
    assert alongside.through_step == 2 * batch  # the batch and the noisy inputs
    assert alongside.until_backward == batch  # the noise
    _assert_the_promise_holds(run)


class ManualLoop(L.LightningModule):
    """Manual optimisation that zeroes the gradients only after the step (they live through the next forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = ZOO["dit"].build()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, t, y, target = batch
        loss = (zoo_sample(self.model(x, timestep=t, class_labels=y)).float() - target).square().mean()
        optimizer = self.optimizers()
        self.manual_backward(loss)
        optimizer.step()
        if batch_idx % 2:  # two batches per update: the gradients of the first live through the second
            optimizer.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)


@pytest.mark.slow
def test_manual_optimisation_that_keeps_gradients_is_planned_for_them_before_its_forward() -> None:
    module = ManualLoop()
    case = ZOO["dit"].case(batch=2)
    rows = [case.args[0], case.kwargs["timestep"], case.kwargs["class_labels"], case.target]
    loader = DataLoader(TensorDataset(*(r.repeat_interleave(4, 0) for r in rows)), batch_size=2)
    run = _fit(module, loader, TinyBackpropStrategy(memory_budget=0.9), max_steps=4)
    assert PriorGradients.ACCUMULATED in run["plan"].loop.gradients
    _assert_the_promise_holds(run)


def test_freeing_early_leaves_training_exactly_as_lightning_runs_it() -> None:
    """Freeing the last step's gradients before the forward instead of before the backward changes
    no weight: the same fit under Lightning's default strategy and under the plan's strategy with
    nothing to plan (a budget of 1.0 on a model whose peak nothing lowers)."""

    def weights(strategy: object) -> list[torch.Tensor]:
        torch.manual_seed(0)
        module = ZooModule("dit", batch=2)
        loader = DataLoader(TensorDataset(*(row.repeat_interleave(3, 0) for row in module.rows)), batch_size=2)
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
        return [p.detach().clone() for p in module.parameters()]

    plain = weights("auto")
    freed = weights(TinyBackpropStrategy(memory_budget=None))
    assert all(torch.equal(a, b) for a, b in zip(plain, freed, strict=True))


def test_a_loop_step_is_measured_from_its_batch_to_the_next() -> None:
    """``LoopWatch`` on a hand-made loop: a step's peak above what training holds, the gradients
    alive at its start counted and the optimizer state its first step makes left out. A later
    metered step's region opens at the previous batch's backward, so the gradients made there are
    seen when the step frees them."""
    from lightning_tbp.strategies.loop import LoopWatch

    watch = LoopWatch(torch.device("cpu"), first=0, every=2)
    mib = 1 << 20
    old = torch.empty(mib, dtype=torch.uint8)  # gradients from before the meter
    assert watch.previous_step_ended(alive_bytes=mib, state_bytes=0) is None
    watch.batch_started(1, alive_bytes=mib, state_bytes=0, can_meter=True)
    del old  # freed unseen: no region yet
    watch.training_step_ended(1, can_meter=True)  # batch 2 is metered: the region opens here
    grads = torch.empty(mib, dtype=torch.uint8)  # batch 1's backward
    assert watch.previous_step_ended(alive_bytes=mib, state_bytes=0) is None
    watch.batch_started(2, alive_bytes=mib, state_bytes=0, can_meter=True)
    del grads  # freed before the forward, seen
    activations = torch.empty(3 * mib, dtype=torch.uint8)
    del activations
    grads = torch.empty(mib, dtype=torch.uint8)
    watch.optimizer_stepping()
    state = torch.empty(2 * mib, dtype=torch.uint8)  # made by the first optimizer step
    step = watch.previous_step_ended(alive_bytes=mib, state_bytes=2 * mib)
    watch.batch_started(3, alive_bytes=mib, state_bytes=2 * mib, can_meter=True)
    assert step is not None and (step.index, step.peak_bytes) == (2, 3 * mib)  # its 3 made after 1 freed
    assert watch.stop(state_bytes=2 * mib) is None  # batch 3 is not metered: the region closed at its start
    del grads, state


def test_the_memory_report_names_the_plan_a_last_step_correction_left_waiting() -> None:
    """A step over its budget corrects the plan, which takes over at the next call; after the
    last step there is none, and the memory report then still names the plan in force (it
    said no plan: stop 63's multi-process script found none to write)."""
    module = ZooModule("dit", batch=2)
    loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=2)
    strategy = TinyBackpropStrategy(memory_budget=0.6)
    run = _fit(module, loader, strategy, max_steps=1)
    plan = strategy.plan
    assert plan is not None
    corrected = plan.correct(run["plan"], 1.1)  # as an over-budget last step does
    assert plan.current is None
    reported = strategy.memory_report_config()["plan"]
    assert reported is not None and reported["predicted_peak_bytes"] == corrected.predicted_peak_bytes


def test_a_free_out_of_the_meters_sight_bounds_its_step_and_leaves_the_next_as_it_was() -> None:
    """Where the meter misses frees (gloo's worker threads under FSDP2 on CPU), a step's reading
    is an upper bound: balanced at the next batch's start against what training holds there, the
    missed bytes say how far (the true peak lies between), and the next step is read from its own
    start, not raised by them. A free on another thread stands in for gloo's."""
    import threading

    from lightning_tbp.strategies.loop import LoopWatch

    watch = LoopWatch(torch.device("cpu"), first=2, every=0, frees_unseen=True)
    mib = 1 << 20
    assert watch.previous_step_ended(alive_bytes=0, state_bytes=0) is None
    watch.batch_started(0, alive_bytes=0, state_bytes=0, can_meter=True)
    collective = {"buffer": torch.empty(2 * mib, dtype=torch.uint8)}  # made on the training thread
    worker = threading.Thread(target=collective.clear)  # and dropped on another
    worker.start()
    worker.join()
    activations = torch.empty(2 * mib, dtype=torch.uint8)
    del activations
    first = watch.previous_step_ended(alive_bytes=0, state_bytes=0)
    watch.batch_started(1, alive_bytes=0, state_bytes=0, can_meter=True)
    assert first is not None and (first.peak_bytes, first.unseen_bytes, first.lowest_bytes) == (
        4 * mib,
        2 * mib,
        2 * mib,
    )
    activations = torch.empty(mib, dtype=torch.uint8)
    del activations
    second = watch.previous_step_ended(alive_bytes=0, state_bytes=0)
    watch.batch_started(2, alive_bytes=0, state_bytes=0, can_meter=True)  # not watched: the region closes
    assert second is not None and (second.peak_bytes, second.unseen_bytes) == (mib, 0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_low_bit_optimizer_state_is_counted_as_it_is_and_a_budget_adamw_cannot_meet_is_met() -> None:
    """torchao's 8-bit AdamW keeps about a quarter of AdamW's state: predicted before the first
    step within 1% (its shared code book counted once per probe), it leaves the plan more of a device budget,
    and a budget that AdamW's state puts out of reach of every plan is met, on every step (eager:
    torchao compiles its step, the same state and arithmetic, minutes later on this CPU)."""
    pytest.importorskip("torchao.optim")

    def run(optimizer: str, budget: int | float) -> dict:
        module = DiffusionModule(
            family="unet2d", model_config=MAIN_JOB_UNET, lr=1e-3, sample_images=0, export=False, optimizer=optimizer
        )
        strategy = TinyBackpropStrategy(memory_budget=budget, optimizer_in_backward=False)
        data = DigitsDataModule(image_size=16, batch_size=16)
        with torch.compiler.set_stance("force_eager"):
            return _fit(module, data, strategy, max_steps=3, limit_val_batches=0)

    first = run("adamw8bit", 0.5)
    predicted = first["plan"].held
    made = first["strategy"].held_memory()
    assert predicted.optimizer_state_pending > 0 and made.optimizer_state_pending == 0
    assert abs(made.optimizer_state - predicted.optimizer_state) <= 0.01 * made.optimizer_state
    assert predicted.optimizer_state < 0.3 * 2 * predicted.parameters  # AdamW would keep two full copies
    budget = predicted.total + int(0.4 * first["plan"].naive.peak_bytes)
    with pytest.raises(InfeasibleBudgetError, match="below the minimum feasible budget"):
        run("adamw", budget)
    _assert_the_promise_holds(run("adamw8bit", budget))


@pytest.mark.slow
@pytest.mark.parametrize("grad_steps", [4, 2])
def test_a_reward_fine_tune_through_the_sampling_chain_holds_its_promise(grad_steps: int) -> None:
    """LoRA reward fine-tuning through four DDIM steps of one U-Net (DRaFT-K; K = 2: the first
    two steps without gradients): each call of the U-Net is planned on its own."""
    from lightning_tbp.diffusion.reward import ConvReward, NoiseBatches, RewardFineTuneModule

    torch.manual_seed(0)
    module = RewardFineTuneModule(
        ConvReward(channels=1), model_config=MAIN_JOB_UNET, sampling_steps=4, grad_steps=grad_steps, lora_rank=4
    )
    loader = DataLoader(NoiseBatches(16, module.sample_shape(1)[1:]), batch_size=4)
    strategy = TinyBackpropStrategy(memory_budget=0.5)  # the chain and the reward, the default target
    run = _fit(module, loader, strategy, max_steps=4)
    _assert_the_promise_holds(run)
    assert any("#" in key for key in run["plan"].options), "a later call of the U-Net is planned"


@pytest.mark.slow
@pytest.mark.parametrize("train", ["decoder", "all"])
def test_a_video_vae_fine_tune_holds_its_promise_through_its_temporal_chunks(train: str) -> None:
    """Wan's VAE fine-tuned on clips of 5 frames (its encoder runs twice, its decoder three times
    per step, every call reading the feature cache the call before it wrote): at 0.6 of the
    step's naive peak the whole fit holds its promise with later chunks' calls planned; at the
    lowest budget the planner names (there with the host tier, and for the whole autoencoder the
    optimizer inside the backward), every metered step of the loop holds it (the profile itself,
    at step 0, peaks above so small a budget, which the strategy warns of)."""
    from lightning_tbp.diffusion.video_vae import MovingSquares, VideoVAEFineTuneModule

    def run(budget: float) -> dict:
        torch.manual_seed(0)
        module = VideoVAEFineTuneModule(train=train)  # type: ignore[arg-type]
        loader = DataLoader(MovingSquares(8, frames=5, size=32), batch_size=2)
        return _fit(module, loader, TinyBackpropStrategy(memory_budget=budget), max_steps=3)

    roomy = run(0.6)
    _assert_the_promise_holds(roomy)
    assert any("#" in key for key in roomy["plan"].options), "a later chunk's call is planned"
    with pytest.raises(InfeasibleBudgetError) as refused:
        run(0.01)
    lowest = run(math.ceil(1000 * refused.value.minimum_step_bytes / refused.value.naive_bytes) / 1000)
    steps = lowest["loop_steps"]
    assert [s["step"] for s in steps][:3] == [0, 1, 2]
    for step in steps:
        assert step["peak_bytes"] <= step["budget_bytes"], step
        assert abs(step["peak_bytes"] / step["predicted_bytes"] - 1) <= 0.05, step


CHAIN_DIT = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 4,
    "patch_size": 2,
    "sample_size": 8,
    "num_embeds_ada_norm": 10,
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["unet2d", "dit"])
def test_a_long_chain_searched_as_one_sequence_holds_its_promise_in_the_fit(family: str, shared_prefixes) -> None:
    """Eight sampling steps with gradients through all of them: enough calls that the solver
    searches the chain as one sequence (each block's calls moved together, the last two calls
    planned apart with the rest of the step shared between their plans), checked on every
    metered step of a whole fit, the first included."""
    from lightning_tbp.diffusion.reward import ConvReward, NoiseBatches, RewardFineTuneModule

    torch.manual_seed(0)
    config = MAIN_JOB_UNET if family == "unet2d" else CHAIN_DIT
    module = RewardFineTuneModule(
        ConvReward(channels=config["in_channels"]), family=family, model_config=config, sampling_steps=8, lora_rank=4
    )
    classes = 10 if family == "dit" else None
    loader = DataLoader(NoiseBatches(12, module.sample_shape(1)[1:], classes=classes), batch_size=4)
    strategy = TinyBackpropStrategy(memory_budget=0.4)  # the chain and the reward model, planned together
    run = _fit(module, loader, strategy, max_steps=3)
    _assert_the_promise_holds(run)
    assert shared_prefixes and shared_prefixes[0].hits > 0, (
        "searched as one sequence, the last calls' plans sharing the rest"
    )
    assert any("#" in key for key in run["plan"].options), "a later call of the denoiser is planned"
