"""``tbp estimate``: one training step's device memory from fake tensors, against exact CPU peaks.

The estimate never allocates the model or its activations; these tests hold it to what the same
step really allocates on this machine (the exact CPU allocator meter), on the recipes' module,
on zoo architectures it was not built around, with LoRA and EMA, and check the plan it proposes
for a device size by running that plan.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from processes import run_in_a_gloo_group_of_one, run_script

from lightning_tbp.cli import main
from lightning_tbp.diffusion import DiffusionModule
from lightning_tbp.diffusion.lora import add_lora, lora_options
from lightning_tbp.diffusion.models import small_unet_config
from lightning_tbp.estimate import (
    CPU,
    CUDA,
    EstimateConfigError,
    Layout,
    StepEstimate,
    StepNeedsValuesError,
    TrainingStep,
    estimate_config,
    estimate_dict,
    estimate_step,
    format_estimate,
    lightning_step,
    measure_step,
)
from lightning_tbp.optim import OptimizerInBackward
from lightning_tbp.optim.host_state import HostOptimizerState
from lightning_tbp.privacy import attach
from lightning_tbp.remat.budget import parse_budget
from lightning_tbp.strategies.privacy import PrivacyConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from lightning_tbp.testing.zoo_models import BENCH_ONLY, HELD_OUT, ZOO, sample

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.05  # the promise: the naive peak within 5% of the exact measured one


def _diffusion_step(precision: str = "32-true", privacy: PrivacyConfig | None = None, **module_options: object):
    def build() -> TrainingStep:
        torch.manual_seed(0)
        module = DiffusionModule(model_config=small_unet_config(16, 1), compute_flops=False, **module_options)
        batch = {"images": torch.zeros(16, 1, 16, 16), "labels": torch.zeros(16, dtype=torch.long)}
        return lightning_step(module, batch, precision=precision, privacy=privacy)

    return build


def _zoo_step(name: str):
    def build() -> TrainingStep:
        case = {**ZOO, **HELD_OUT}[name].case(batch=2)
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4)

        def forward_backward() -> torch.Tensor:
            loss = case.loss()
            loss.backward()
            return loss

        return TrainingStep({"model": case.model}, case.model, case.args, forward_backward, optimizer.step, [optimizer])

    return build


def _dp_zoo_step(name: str, mode: str):
    """A DP-SGD step on a zoo model: the engine's passes, its book and its noise are in the step."""

    def build() -> TrainingStep:
        case = ZOO[name].case(batch=2)
        engine = attach(case.model, mode, max_grad_norm=1.0, noise_multiplier=1.0)
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4)

        def forward_backward() -> torch.Tensor:
            out = case.model(*case.args, **case.kwargs)
            out = out.sample if hasattr(out, "sample") else out[0]
            loss = (out.float() - case.target).square().flatten(1).mean(1)
            engine.backward(loss)
            return loss

        return TrainingStep({"model": case.model}, case.model, case.args, forward_backward, optimizer.step, [optimizer])

    return build


def _dp_lora_step(name: str, mode: str):
    """A DP-SGD step on a zoo model's LoRA adapters (its base frozen)."""

    def build() -> TrainingStep:
        case = ZOO[name].case(batch=2)
        add_lora(case.model, lora_options(4))
        engine = attach(case.model, mode, max_grad_norm=1.0, noise_multiplier=1.0)
        trainable = [p for p in case.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)

        def forward_backward() -> torch.Tensor:
            loss = (sample(case.model(*case.args, **case.kwargs)).float() - case.target).square().flatten(1).mean(1)
            engine.backward(loss)
            return loss

        return TrainingStep({"model": case.model}, case.model, case.args, forward_backward, optimizer.step, [optimizer])

    return build


def _assert_close(build, **estimate_options: object) -> None:
    estimate = estimate_step(build, device=CPU, minimum=False, **estimate_options)
    measured = measure_step(build)
    ratio = estimate.naive_peak_bytes / measured.peak_bytes
    assert abs(ratio - 1) <= TOLERANCE, (estimate.naive_peak_bytes, measured.peak_bytes, ratio)


@pytest.mark.parametrize(
    ("precision", "options"),
    [
        ("32-true", {"ema_decay": 0.99}),
        ("bf16-mixed", {}),
        ("32-true", {"lora_rank": 4}),
        ("32-true", {"lora_rank": 4, "base_quantization": "int8"}),
        ("32-true", {"lora_rank": 4, "base_quantization": "nf4"}),
    ],
    ids=["fp32-ema", "bf16-mixed", "lora", "lora-int8-base", "lora-nf4-base"],
)
def test_recipe_module_naive_peak_within_five_percent(precision: str, options: dict) -> None:
    _assert_close(_diffusion_step(precision, **options))


@pytest.mark.parametrize("name", ["sdxl_unet", "dit", "flux", "cogvideox"])
def test_zoo_naive_peak_within_five_percent(name: str) -> None:
    _assert_close(_zoo_step(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(HELD_OUT) - {"lumina2"}))
def test_held_out_architectures_naive_peak_within_five_percent(name: str) -> None:
    """Architectures the estimate was not built around (``zoo_models.HELD_OUT``)."""
    _assert_close(_zoo_step(name))


@pytest.mark.parametrize("name", ["sdxl_unet", "dit"])
def test_the_optimizer_stepping_inside_the_backward_is_estimated_within_five_percent(name: str) -> None:
    """The estimate runs the same stepper the strategies use; its device total against the same
    step measured exactly, and the smallest device a plan reaches lower than the ordinary step's
    (no gradient outlives its parameter's step, no step follows the backward)."""
    build = _zoo_step(name)
    fused = estimate_step(build, device=CPU, step_in_backward=True)
    measured = measure_step(build, step_in_backward=True)
    assert abs(fused.naive_peak_bytes / measured.peak_bytes - 1) <= TOLERANCE, (fused.naive_peak_bytes, measured)
    ordinary = estimate_step(build, device=CPU)
    assert fused.step_in_backward and fused.optimizer_step_peak_bytes < 0.01 * ordinary.optimizer_step_peak_bytes
    assert fused.minimum_device_bytes is not None and ordinary.minimum_device_bytes is not None
    assert fused.minimum_device_bytes < ordinary.minimum_device_bytes


def test_the_optimizer_state_on_the_host_is_estimated_within_five_percent() -> None:
    """The state and step on the host: the device total against the same step measured exactly,
    lower than the step inside the backward with the state on the device by about the state."""
    build = _zoo_step("sdxl_unet")
    hosted = estimate_step(build, device=CPU, step_in_backward=True, state_on_host=True)
    measured = measure_step(build, step_in_backward=True, state_on_host=True)
    assert abs(hosted.naive_peak_bytes / measured.peak_bytes - 1) <= TOLERANCE, (hosted.naive_peak_bytes, measured)
    on_device = estimate_step(build, device=CPU, step_in_backward=True)
    state = on_device.optimizer_state_bytes
    assert hosted.optimizer_state_bytes == 0 and hosted.host_state_bytes >= state > 0
    assert on_device.naive_peak_bytes - hosted.naive_peak_bytes >= 0.95 * state
    assert hosted.host_step_seconds > 0 and "the optimizer's state and step on the host" in format_estimate(hosted)
    # the slowdown the strategies' max_slowdown is checked against, said where it would refuse
    assert hosted.step_seconds > 0
    assert hosted.host_slowdown == (hosted.step_seconds + hosted.host_step_seconds) / hosted.step_seconds
    refused = dataclasses.replace(hosted, host_step_seconds=11 * hosted.step_seconds)
    assert "max_slowdown=10, which refuses it" in format_estimate(refused)
    assert "which refuses it" not in format_estimate(
        dataclasses.replace(hosted, host_step_seconds=0.5 * hosted.step_seconds)
    )


def test_part_of_the_optimizer_state_on_the_host_is_estimated_within_five_percent() -> None:
    """The state and step on the host for the three parameters with the most state only, the
    rest stepped on the device: the device total against the same step measured exactly, the
    device keeping the others' state, the host step shorter than the whole's, the report saying
    how many."""
    build = _zoo_step("dit")
    on_device = estimate_step(build, device=CPU, step_in_backward=True, minimum=False)
    by_name = on_device.state_bytes_by_parameter
    largest = sorted(by_name, key=lambda name: by_name[name], reverse=True)[:3]
    options = {"device": CPU, "minimum": False, "step_in_backward": True, "state_on_host": True}
    part = estimate_step(build, hosted=largest, **options)
    measured = measure_step(build, step_in_backward=True, state_on_host=True, hosted=largest)
    assert abs(part.naive_peak_bytes / measured.peak_bytes - 1) <= TOLERANCE, (part.naive_peak_bytes, measured)
    assert part.optimizer_state_bytes == on_device.optimizer_state_bytes - sum(by_name[n] for n in largest)
    assert part.host_parameters == (3, len(by_name)) and "for 3 of" in format_estimate(part)
    whole = estimate_step(build, **options)
    assert whole.host_parameters is None and 0 < part.host_step_seconds < whole.host_step_seconds
    with pytest.raises(ValueError, match="does not train"):
        estimate_step(build, hosted=["no.such.weight"], **options)


def test_fp32_masters_on_the_host_are_estimated_as_the_host_counts_them() -> None:
    """A bf16 model with float32 masters (``fp32_master_weights``): the host bytes the estimate
    names are those the host state holds after a step; the device's total is the same as
    without masters (they live on the host); the report names them; from a config, by its option."""

    def build() -> TrainingStep:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        model = model.to(torch.bfloat16)
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def forward_backward() -> torch.Tensor:
            loss = model(x).float().square().mean()
            loss.backward()
            return loss

        return TrainingStep({"model": model}, model, (x,), forward_backward, optimizer.step, [optimizer])

    options = {"device": CPU, "minimum": False, "step_in_backward": True, "state_on_host": True}
    widened = estimate_step(build, master_dtype=torch.float32, **options)
    plain = estimate_step(build, **options)
    step = build()
    stepper = OptimizerInBackward(step.optimizers[0])
    stepper.host = host = HostOptimizerState(step.optimizers[0], master_dtype=torch.float32)
    with stepper.stepping():
        step.forward_backward()
    assert widened.host_state_bytes == host.host_bytes
    numel = sum(p.numel() for p in step.modules["model"].parameters())
    assert widened.host_state_bytes - plain.host_state_bytes == 6 * numel  # 2 more bytes of master, 4 of state
    assert widened.naive_peak_bytes == plain.naive_peak_bytes
    assert widened.host_master_dtype == "float32" and plain.host_master_dtype is None
    assert "float32 masters" in format_estimate(widened) and "float32 masters" not in format_estimate(plain)
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    masters = ["-c", config, "--trainer.strategy.init_args.fp32_master_weights=true"]
    from_config = estimate_config([*masters, "--trainer.precision=bf16-true"], minimum=False)
    assert from_config.host_master_dtype == "float32" and from_config.host_state_bytes > 0
    assert estimate_config(masters, minimum=False).host_master_dtype is None  # float32 weights: nothing to widen


def test_a_config_that_does_not_fit_is_estimated_with_the_step_the_planner_would_take_too() -> None:
    """Under tiny_backprop (optimizer_in_backward='auto'), a device the ordinary step cannot fit
    is tried with the optimizer inside the backward, and the report says what that reaches."""
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    ordinary = estimate_config(["-c", config], device_memory=1 << 20)
    fused = ordinary.with_step_in_backward
    assert fused is not None and fused.step_in_backward and not ordinary.step_in_backward
    assert ordinary.minimum_device_bytes is not None and fused.minimum_device_bytes is not None
    assert fused.minimum_device_bytes < ordinary.minimum_device_bytes
    assert "inside the backward" in format_estimate(ordinary)
    off = estimate_config(
        ["-c", config, "--trainer.strategy.init_args.optimizer_in_backward=false"], device_memory=1 << 20
    )
    assert off.with_step_in_backward is None


@pytest.mark.parametrize("strategy", ["TinyBackpropDDPStrategy", "TinyBackpropFSDP2Strategy"])
def test_a_multi_device_config_with_the_optimizer_inside_the_backward_is_estimated_per_rank(strategy: str) -> None:
    """``optimizer_in_backward=True`` under tiny_backprop_ddp (whose buckets the gradients then
    view: LightningCLI passes DDP's ``gradient_as_bucket_view=False`` as a default, which the
    strategy overrides) and tiny_backprop_fsdp2, estimated per rank as it runs."""
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    args = ["-c", config, f"--trainer.strategy.class_path=lightning_tbp.{strategy}", "--trainer.devices=2"]
    fused = estimate_config([*args, "--trainer.strategy.init_args.optimizer_in_backward=true"], minimum=False)
    assert fused.step_in_backward and fused.world_size == 2
    assert fused.layout == ("ddp" if "DDP" in strategy else "fsdp2")
    assert "inside the backward" in format_estimate(fused)
    # the EMA is a copy of the weights, kept as shards like them under FSDP2
    assert fused.parameter_bytes["ema"] == pytest.approx(fused.parameter_bytes["model"], rel=0.01)
    plain = estimate_config([*args, "--trainer.strategy.init_args.optimizer_in_backward=false"], minimum=False)
    assert fused.optimizer_step_peak_bytes < plain.optimizer_step_peak_bytes


def test_a_config_that_does_not_fit_on_the_device_alone_is_estimated_with_the_host_tier_too() -> None:
    """Under tiny_backprop (host_tier='auto'), a device that neither the ordinary step nor the one
    with the optimizer inside the backward fits is tried with the host tier: a smaller device,
    the host bytes its plan keeps, and the report and JSON say so; host_tier=off does not."""
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    ordinary = estimate_config(["-c", config], device_memory=1 << 20)
    hosted = ordinary.with_host_tier
    fused = ordinary.with_step_in_backward
    assert hosted is not None and fused is not None and hosted.host_tier and hosted.step_in_backward
    assert hosted.minimum_device_bytes is not None and fused.minimum_device_bytes is not None
    assert hosted.minimum_device_bytes < fused.minimum_device_bytes
    assert hosted.minimum_plan_host_bytes > 0
    assert "with the host tier" in format_estimate(ordinary)
    assert estimate_dict(ordinary)["with_host_tier"]["minimum_plan_host_bytes"] == hosted.minimum_plan_host_bytes
    off = estimate_config(["-c", config, "--trainer.strategy.init_args.host_tier=off"], device_memory=1 << 20)
    assert off.with_host_tier is None
    forced = estimate_config(["-c", config, "--trainer.strategy.init_args.optimizer_state_on_host=true"])
    assert forced.step_in_backward and forced.host_state_bytes > 0 and forced.optimizer_state_bytes == 0


@pytest.mark.slow
def test_a_config_short_of_a_little_is_estimated_with_part_of_the_state_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device a quarter of the optimizer's state short of what the host tier reaches with the
    state on the device: as the strategy does, the estimate hosts the fewest parameters' state
    (most first) that covers it rather than all of it, where that is faster (the host's step priced
    1000x slower here, so that it is), and the report says how many."""
    from lightning_tbp.estimate import step as estimate_module

    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    on_device = ["-c", config, "--trainer.strategy.init_args.optimizer_state_on_host=false"]
    lowest = estimate_config(on_device, device_memory=1 << 20).with_host_tier
    assert lowest is not None and lowest.minimum_device_bytes is not None
    device_memory = lowest.minimum_device_bytes - lowest.optimizer_state_bytes // 4
    rate = estimate_module.host_optimizer_ns_per_byte
    monkeypatch.setattr(estimate_module, "host_optimizer_ns_per_byte", lambda *a, **k: 1000 * rate(*a, **k))
    estimate = estimate_config(["-c", config], device_memory=device_memory, minimum=False)
    part = estimate.with_host_tier
    assert part is not None and part.fit is not None and part.fit.fits_with_plan
    assert part.host_parameters is not None
    hosted, trainable = part.host_parameters
    assert 0 < hosted < trainable and 0 < part.optimizer_state_bytes < lowest.optimizer_state_bytes
    assert f"for {hosted} of {trainable} parameters" in format_estimate(estimate)
    assert estimate_dict(estimate)["with_host_tier"]["host_parameters"] == [hosted, trainable]


def test_a_step_that_reads_tensor_values_is_refused_naming_the_line() -> None:
    """Lumina 2 reads each caption's length from its mask (``.tolist()``): fake tensors have no
    values, so the estimate says where the model asks for them instead of a torch traceback."""
    with pytest.raises(StepNeedsValuesError, match=r"transformer_lumina2\.py:\d+ in forward"):
        estimate_step(_zoo_step("lumina2"), device=CPU, minimum=False)


@pytest.mark.parametrize(
    ("mode", "name"),
    [("ghost", "unet2d"), ("flash", "dit"), ("bookkeeping", "sdxl_unet"), ("bookkeeping", "pixart")],
)
def test_dp_step_naive_peak_within_five_percent(mode: str, name: str) -> None:
    """DP steps as the engine runs them (ghost/flash: two passes; bookkeeping: the book), PixArt's
    adaLN table read outside any layer (a tracked parameter) included."""
    _assert_close(_dp_zoo_step(name, mode))
    estimate = estimate_step(_dp_zoo_step(name, mode), device=CPU, minimum=False)
    assert estimate.step_model == f"dp:{mode}"


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_a_dp_lora_step_is_estimated_with_its_base_streamed(mode: str) -> None:
    """With the host tier a DP step's plan streams the frozen base (and may offload activations,
    copied back in each backward pass): a smaller device than on the device alone."""
    alone = estimate_step(_dp_lora_step("flux", mode), device=CPU)
    hosted = estimate_step(_dp_lora_step("flux", mode), device=CPU, host_tier=True)
    assert hosted.step_model == f"dp:{mode}"
    assert alone.minimum_device_bytes is not None and hosted.minimum_device_bytes is not None
    assert hosted.minimum_device_bytes < alone.minimum_device_bytes
    assert hosted.minimum_plan_host_bytes > 0  # the streamed weights


def _video_unet_dp_step(mode: str):
    """A DP step on diffusers' video U-Net: its layers run on frames and positions folded into
    the batch, whose norms the engine takes with each sample's rows merged into positions."""

    def build() -> TrainingStep:
        torch.manual_seed(0)
        model = BENCH_ONLY["video_unet"].build().eval()
        x, y = torch.randn(3, 4, 2, 8, 8), torch.randn(3, 4, 2, 8, 8)
        t, text = torch.tensor([3, 500, 999]), torch.randn(3, 5, 16)
        engine = attach(model, mode, max_grad_norm=1.0, noise_multiplier=1.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def forward_backward() -> torch.Tensor:
            loss = (model(x, t, encoder_hidden_states=text).sample - y).square().flatten(1).mean(1)
            engine.backward(loss)
            return loss

        return TrainingStep({"model": model}, model, (x, t, text), forward_backward, optimizer.step, [optimizer])

    return build


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_a_dp_step_on_folded_rows_is_estimated_within_five_percent(mode: str) -> None:
    """The estimate prices folded layers from shapes (no stand-ins): the merged rows the step runs."""
    _assert_close(_video_unet_dp_step(mode))


def test_nothing_is_allocated_for_a_model_larger_than_this_machine_holds_cheaply() -> None:
    """A DiT-XL-size transformer (675M parameters: 10.8 GB of weights, gradients and AdamW state
    in fp32) is estimated while the process grows by far less than its weights alone."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def build() -> TrainingStep:
        from diffusers import DiTTransformer2DModel

        model = DiTTransformer2DModel(
            num_attention_heads=16, attention_head_dim=72, num_layers=28, sample_size=32, patch_size=8,
            in_channels=4, out_channels=8,
        )  # fmt: skip
        x = torch.zeros(4, 4, 32, 32)
        labels = torch.zeros(4, dtype=torch.long)
        optimizer = torch.optim.AdamW(model.parameters())

        def forward_backward() -> torch.Tensor:
            loss = model(x, timestep=labels, class_labels=labels).sample.square().mean()
            loss.backward()
            return loss

        return TrainingStep({"model": model}, model, x, forward_backward, optimizer.step, [optimizer])

    estimate = estimate_step(build, device=CUDA, minimum=False)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    weights = estimate.parameter_bytes["model"]
    assert weights > 2.5e9
    assert estimate.optimizer_state_bytes >= 2 * weights
    assert grown < weights / 4, grown


def test_cuda_model_rounds_blocks_and_adds_the_cublas_workspace() -> None:
    cpu = estimate_step(_diffusion_step(), device=CPU, minimum=False)
    cuda = estimate_step(_diffusion_step(), device=CUDA, minimum=False)
    assert cuda.library_workspace_bytes == CUDA.library_workspace_bytes
    assert cuda.naive_peak_bytes >= cpu.naive_peak_bytes + CUDA.library_workspace_bytes


def test_cuda_autocasts_float32_list_runs_in_float32_under_cpu_autocast() -> None:
    """What CUDA's autocast widens (group norm, softmax, a power, a sum) runs in float32 under
    the mode, with its bf16 inputs cast; what both autocasts narrow (a matmul) stays bf16; and
    outside autocast nothing changes."""
    import torch.nn.functional as F

    from lightning_tbp.estimate.autocast_policy import CudaFloat32Ops

    x = torch.randn(2, 4, 3, 3)
    w = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        narrow = F.linear(x.flatten(2).transpose(1, 2), w)
        assert F.group_norm(narrow, 1).dtype == torch.bfloat16  # CPU autocast's own choice
        with CudaFloat32Ops():
            assert F.linear(x.flatten(2).transpose(1, 2), w).dtype == torch.bfloat16
            assert F.group_norm(narrow, 1).dtype == torch.float32
            assert F.softmax(narrow, dim=-1).dtype == torch.float32
            assert narrow.pow(2).dtype == torch.float32 and narrow.sum().dtype == torch.float32
            assert (narrow * 2).dtype == torch.bfloat16  # not on the list
    with CudaFloat32Ops():
        assert F.group_norm(narrow, 1).dtype == torch.bfloat16  # autocast off: as called


@pytest.mark.slow
def test_a_bf16_mixed_cuda_estimate_meets_what_an_h200_measured() -> None:
    """``ddpm_unet.yaml`` (bf16-mixed, 128², batch 64) estimated for CUDA on this CPU against
    the peak of its three-step fit on an H200 (``docs/benchmarks/gpu_h200/estimate_check.json``):
    within 5% (CPU autocast's op lists alone gave 0.59)."""
    from estimate_check import CASES, fit_args

    recorded = json.loads((ROOT / "docs/benchmarks/gpu_h200/estimate_check.json").read_text())
    measured = recorded["rows"]["ddpm_unet_bf16"]["measured_bytes"]
    case = next(c for c in CASES if c.name == "ddpm_unet_bf16")
    with tempfile.TemporaryDirectory() as scratch:
        estimate = estimate_config(fit_args(case, "cpu", 3, Path(scratch)), device="cuda", minimum=False)
    assert abs(estimate.naive_peak_bytes / measured - 1) <= 0.05, (estimate.naive_peak_bytes, measured)


def test_a_device_between_the_lowest_plan_and_naive_fits_with_a_plan_that_keeps_its_word() -> None:
    """The plan proposed for a device size is installed and run: its measured step stays inside."""
    from lightning_tbp import Plan

    build = _diffusion_step()
    estimate = estimate_step(build, device=CPU)
    assert estimate.minimum_device_bytes < estimate.naive_peak_bytes
    size = (estimate.minimum_device_bytes + estimate.naive_peak_bytes) // 2
    fitted = estimate_step(build, device=CPU, device_memory=size, minimum=False).fit
    assert fitted is not None and fitted.fits_with_plan and not fitted.fits_without_plan
    assert fitted.predicted_peak_bytes <= size
    below = estimate_step(build, device=CPU, device_memory=estimate.minimum_device_bytes // 2, minimum=False).fit
    assert below is not None and not below.fits_with_plan and below.reason

    step = build()  # real tensors: plan the target at the step budget the estimate solved for
    plan = Plan(step.target, fitted.budget_bytes)  # plans at the target's first forward
    try:
        step.optimizer_step(step.forward_backward)  # plans at the first call, makes optimizer state
        measured = measure_step(lambda: step)
    finally:
        plan.remove()
    assert measured.peak_bytes <= size, (measured.peak_bytes, size)


def test_fsdp2_and_ddp_layouts_per_rank() -> None:
    build = _diffusion_step()
    one = estimate_step(build, device=CPU, minimum=False)

    def on(layout: Layout):
        def laid_out() -> TrainingStep:
            step = build()
            step.layout = layout
            return step

        return estimate_step(laid_out, device=CPU, minimum=False)

    ddp = on(Layout("ddp", 4))
    assert ddp.held_bytes == one.held_bytes + one.gradient_bytes  # the gradient buckets
    fsdp = on(Layout("fsdp2", 4))
    assert fsdp.optimizer_state_bytes < one.optimizer_state_bytes / 3
    assert sum(fsdp.parameter_bytes.values()) < sum(one.parameter_bytes.values())
    assert on(Layout("fsdp2", 16)).naive_peak_bytes < fsdp.naive_peak_bytes  # smaller shards
    with pytest.raises(ValueError, match="unknown layout"):
        Layout("tp", 2)


def test_a_copy_of_the_weights_kept_sharded_is_divided_per_rank_but_not_its_buffers() -> None:
    """``DiffusionModule``'s EMA under FSDP2: its parameters are shards like the weights', 1/N per
    rank; a buffer beside them (here one of 1 MiB) stays whole on every rank, as FSDP2 keeps
    buffers."""
    build = _diffusion_step(ema_decay=0.99)

    def on(layout: Layout, buffer_bytes: int) -> StepEstimate:
        def laid_out() -> TrainingStep:
            step = build()
            step.layout = layout
            step.modules["ema"].register_buffer("extra", torch.zeros(buffer_bytes, dtype=torch.uint8))
            return step

        return estimate_step(laid_out, device=CPU, minimum=False)

    one, sharded = on(Layout(), 1 << 20), on(Layout("fsdp2", 4), 1 << 20)
    without = on(Layout("fsdp2", 4), 0)
    weights = one.parameter_bytes["ema"] - (1 << 20)
    assert sharded.parameter_bytes["ema"] - without.parameter_bytes["ema"] == pytest.approx(1 << 20, abs=4096)
    assert without.parameter_bytes["ema"] == pytest.approx(weights / 4, rel=0.01)


def test_the_optimizer_inside_the_backward_is_estimated_per_rank_under_ddp_and_fsdp2() -> None:
    """Each rank's step with the optimizer inside the backward: under DDP the buckets stay (the
    gradients are views of them), under FSDP2 each unit's sharded gradients are stepped in its
    post-backward, so no optimizer step follows the backward and no gradient outlives it."""
    build = _diffusion_step()

    def on(layout: Layout, fused: bool) -> StepEstimate:
        def laid_out() -> TrainingStep:
            step = build()
            step.layout = layout
            return step

        return estimate_step(laid_out, device=CPU, step_in_backward=fused)

    one = on(Layout(), True)
    ddp = on(Layout("ddp", 4), True)
    assert ddp.step_in_backward and ddp.held_bytes == one.held_bytes + one.gradient_bytes
    plain, fused = on(Layout("fsdp2", 4), False), on(Layout("fsdp2", 4), True)
    assert fused.step_in_backward and 0 <= fused.optimizer_step_peak_bytes < plain.optimizer_step_peak_bytes
    assert fused.minimum_device_bytes is not None and plain.minimum_device_bytes is not None
    assert fused.minimum_device_bytes <= plain.minimum_device_bytes


#: Run in a gloo group of one (``processes.py``): the zoo models NAMES, each step estimated for
#: the FSDP2 layout from its unsharded module and measured sharded as ``tiny_backprop_fsdp2``
#: shards it, the optimizer after the backward and inside it; the pairs go to OUT as JSON.
_FSDP2_AGAINST_SHARDED = """
import json, sys
sys.path.insert(0, TESTS)
from lightning_tbp.estimate import CPU, Layout, TrainingStep, estimate_step, measure_step
from lightning_tbp.strategies.distributed import shard_blocks
from lightning_tbp.testing.zoo_models import ZOO

def step_of(name, sharded):
    def build():
        torch.manual_seed(0)
        case = ZOO[name].case(batch=2)
        if sharded:
            shard_blocks(case.model)
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4)

        def forward_backward():
            loss = case.loss()
            loss.backward()
            return loss

        step = TrainingStep({"model": case.model}, case.model, case.args, forward_backward, optimizer.step, [optimizer])
        step.layout = Layout("fsdp2", 1)
        return step

    return build

pairs = {}
for name in NAMES:
    for fused in (False, True):
        estimated = estimate_step(step_of(name, False), device=CPU, minimum=False, step_in_backward=fused)
        measured = measure_step(step_of(name, True), step_in_backward=fused)
        pairs[f"{name} fused={fused}"] = (estimated.naive_peak_bytes, measured.peak_bytes)
with open(OUT, "w") as out:
    json.dump(pairs, out)
"""


@pytest.mark.slow
def test_the_fsdp2_layout_is_estimated_within_one_percent_of_a_sharded_step(tmp_path: Path) -> None:
    """Under FSDP2 the estimate simulates each unit's gather, its unsharded gradients and their
    reduce-scatter (and the optimizer stepping the sharded gradients inside the backward) from
    the unsharded module's fake trace. One process, so the meter is exact (gloo's threads free
    nothing unseen): against the same step sharded by ``shard_blocks``, measured. Read 1.0000
    (DiT) and 1.0034-1.0037 (SDXL-style U-Net); the shards' arithmetic across ranks is the
    planner's, checked in two processes (``test_multi_device.py``)."""
    out = tmp_path / "pairs.json"
    names = ["dit", "sdxl_unet"]
    setup = f"TESTS, OUT, NAMES = {str(ROOT / 'tests')!r}, {str(out)!r}, {names!r}\n"
    run_in_a_gloo_group_of_one(setup + _FSDP2_AGAINST_SHARDED, port=29657)
    pairs = json.loads(out.read_text())
    assert len(pairs) == 4
    for case, (estimated, measured) in pairs.items():
        assert abs(estimated / measured - 1) <= 0.01, (case, estimated, measured)


@pytest.mark.slow
def test_the_fsdp2_layout_across_two_ranks_simulates_the_spans_a_sharded_step_has(tmp_path: Path) -> None:
    """Two gloo ranks: each rank's estimate of its step (the units' spans from the unsharded
    model) against the planner's simulation of the same step sharded for real (the spans its
    units recorded), which ``test_multi_device.py`` checks against the exact meter. Read
    0.9998 (DiT) and 1.0000 (SDXL-style U-Net), the optimizer after the backward and inside it."""
    out = tmp_path / "pairs.json"
    run_script("fsdp2_estimate.py", str(out), "29659")
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for pairs in ranks:
        assert len(pairs) == 4
        for case, (estimated, simulated) in pairs.items():
            assert abs(estimated / simulated - 1) <= 0.01, (case, estimated, simulated)


def test_cli_estimates_the_main_job_config_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "estimate.json"
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    assert main(["estimate", "-c", config, "--device", "cpu", "--device-memory", "60MiB", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["fits"] is True and record["fits_without_plan"] is False
    assert record["plan"]["predicted_peak_bytes"] <= 60 * 1024**2
    assert record["naive_peak_bytes"] > 60 * 1024**2
    assert "fits in 60.00 MiB with a plan" in capsys.readouterr().out


def test_cli_override_changes_the_estimate(tmp_path: Path) -> None:
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    small = estimate_config(["-c", config], device="cpu", minimum=False)
    large = estimate_config(["-c", config, "--data.init_args.batch_size=128"], device="cpu", minimum=False)
    assert large.activation_bytes > 1.5 * small.activation_bytes


def test_cli_estimates_a_dp_config_and_the_same_step_measures_within_five_percent(tmp_path: Path) -> None:
    """A config with ``dp=`` is estimated as the strategy would run it: the engine attached to the
    module, the per-sample loss from its own ``training_step``, the engine's passes and noise."""
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    out = tmp_path / "dp.json"
    dp = ["--trainer.strategy.init_args.dp=bookkeeping", "--trainer.strategy.init_args.memory_budget=null"]
    dp += ["--trainer.strategy.init_args.noise_multiplier=1.0"]
    assert main(["estimate", "-c", config, "--device", "cpu", "--no-minimum", "--json", str(out), *dp]) == 0
    record = json.loads(out.read_text())
    assert record["step_model"] == "dp:bookkeeping"
    for mode in ("ghost", "bookkeeping"):
        _assert_close(_diffusion_step(privacy=PrivacyConfig(mode, noise_multiplier=1.0)))


def test_cli_refuses_datamodules_without_an_example_batch() -> None:
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    with pytest.raises(EstimateConfigError, match="example_batch"):
        estimate_config(["-c", config, "--data=lightning.pytorch.demos.boring_classes.BoringDataModule"], minimum=False)


_WHOLE_FIT = [
    "--trainer.max_steps=3",
    "--trainer.callbacks=[]",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.init_args.export=false",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", ["auto", "tiny_backprop", "in_backward"], ids=["lightning", "tiny_backprop", "in_backward"]
)
def test_the_main_job_config_is_estimated_within_five_percent_of_its_whole_fit(strategy: str) -> None:
    """``tbp estimate -c configs/ddpm_unet_tiny.yaml`` against the exact peak of a whole
    ``Trainer.fit`` of that config (three steps, the first included): under Lightning's own loop
    the last step's gradients are alive in every later forward (the estimate missed them: 0.94);
    under tiny_backprop they are freed before it. The estimate models the config's accelerator,
    the CPU, on its own; the unplanned step is estimated, so the fit runs without a plan."""
    from estimate_check import measured_fit_peak

    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    chosen = ["--trainer.strategy=auto"] if strategy == "auto" else ["--trainer.strategy.init_args.memory_budget=null"]
    if strategy == "in_backward":  # each parameter stepped inside the backward, estimated so
        chosen.append("--trainer.strategy.init_args.optimizer_in_backward=true")
    args = ["-c", config, *_WHOLE_FIT, *chosen]
    estimate = estimate_config(args, minimum=False)
    assert estimate.device == "cpu"
    measured = measured_fit_peak(args, "cpu")
    assert abs(estimate.naive_peak_bytes / measured - 1) <= TOLERANCE, (estimate.naive_peak_bytes, measured)


def test_the_estimate_follows_the_configs_accelerator_unless_told() -> None:
    config = str(ROOT / "configs" / "ddpm_unet_tiny.yaml")
    assert estimate_config(["-c", config], minimum=False).device == "cpu"  # the config says cpu
    assert estimate_config(["-c", config, "--trainer.accelerator=auto"], minimum=False).device == "cuda"
    assert estimate_config(["-c", config], device="cuda", minimum=False).device == "cuda"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--trainer.strategy.init_args.verify_every_n_steps=7"], "TinyBackpropStrategy"),
        (["--trainer.strategy=tiny_backprop_fsdp2", "--trainer.devices=2"], "TinyBackpropFSDP2Strategy"),
        (["--trainer.strategy=ddp", "--trainer.devices=2"], "TinyBackpropDDPStrategy"),
    ],
    ids=["config-class", "fsdp2-by-name", "plain-ddp"],
)
def test_the_arguments_it_suggests_train_the_config_with_that_budget(given: list[str], expected: str) -> None:
    """ "train with ..." as given, appended to the command estimated, is a command LightningCLI
    takes: the tiny_backprop strategy of the layout, at the budget, the config's other strategy
    options kept where its class was already that one (``--trainer.strategy=tiny_backprop
    --trainer.strategy.memory_budget=N``, as it read before, was refused by the parser)."""
    from lightning_tbp.lightning_cli import run_lightning_cli

    args = ["-c", str(ROOT / "configs" / "ddpm_unet_tiny.yaml"), *given]
    estimate = estimate_config(args, device_memory=64 << 20, minimum=False)
    assert estimate.fit is not None and estimate.fit.fits_with_plan
    line = next(line for line in format_estimate(estimate).splitlines() if "train with " in line)
    suggested = line.split("train with ", 1)[1].split(";")[0].split()
    cli = run_lightning_cli([*args, *suggested], run=False)
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == expected
    assert strategy.memory_budget == parse_budget(64 << 20)
    if expected == "TinyBackpropStrategy":
        assert strategy.verify_every_n_steps == 7


@pytest.mark.parametrize("config", ["finetune_lora.yaml", "finetune_sd3_lora.yaml", "finetune_flux_lora.yaml"])
def test_a_fine_tune_from_local_weights_is_estimated_from_their_config(config: str, tmp_path: Path) -> None:
    """``tbp estimate`` on the fine-tuning configs: under fake tensors the weights' folder gives
    its config and the model is made from it (their values cannot be loaded into fake tensors:
    every config with ``pretrained`` failed with "Unable to load weights"), so the estimate
    counts the same parameters the loaded model has; SD3's flow scheduler, whose constructor
    reads its sigmas, is made on real tensors."""
    from diffusers import UNet2DModel
    from models import tiny_flux_dev, write_latents
    from PIL import Image

    torch.manual_seed(0)
    if "flux" in config:  # FLUX.1-dev's kind, as the config's guidance_embedding says
        model = tiny_flux_dev()
    elif "sd3" in config:
        model = ZOO["sd3"].build()
    else:
        model = UNet2DModel(**small_unet_config(32, 3))
    model.save_pretrained(tmp_path / "weights")
    if isinstance(model, UNet2DModel):
        (tmp_path / "images" / "a").mkdir(parents=True)
        for index in range(4):
            Image.new("RGB", (32, 32)).save(tmp_path / "images" / "a" / f"{index}.png")
        data = [f"--data.init_args.root={tmp_path / 'images'}", "--data.init_args.image_size=32"]
    else:
        latents = write_latents(tmp_path / "latents.pt", samples=8)
        data = ["--data=lightning_tbp.diffusion.LatentsDataModule", f"--data.init_args.path={latents}"]
    args = ["-c", str(ROOT / "configs" / config), f"--model.init_args.pretrained={tmp_path / 'weights'}", *data]
    dtype = torch.bfloat16 if "flux" in config else torch.float32  # the Flux config loads bf16 weights
    precision = [] if "flux" in config else ["--trainer.precision=32"]
    estimate = estimate_config([*args, "--trainer.accelerator=cpu", *precision], minimum=False)
    loaded = type(model).from_pretrained(tmp_path / "weights", torch_dtype=dtype)
    weights = sum(t.numel() * t.element_size() for t in (*loaded.parameters(), *loaded.buffers()))
    assert 0 < estimate.trainable_parameters < sum(p.numel() for p in loaded.parameters()) / 5  # adapters
    adapters = estimate.trainable_parameters * dtype.itemsize
    assert estimate.parameter_bytes["model"] == pytest.approx(weights + adapters, rel=0.002)
