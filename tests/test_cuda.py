"""The promises that depend on the device, on CUDA: skipped without a GPU.

``scripts/gpu_check.py`` runs this file first on a lent GPU (``pytest -m cuda``); on CPU every
test here skips, and the same promises are tested on CPU elsewhere in the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy, rematerialize
from lightning_tbp.diffusion.data import DigitsDataModule
from lightning_tbp.memory.meters import allocator_peak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from test_loop_truth import ZooModule, _assert_the_promise_holds, _fit, _main_job_module

from lightning_tbp.testing.zoo_models import ZOO, ZooCase

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MiB = 1 << 20


def test_cuda_regions_nest_and_read_exact_peaks() -> None:
    device = torch.device("cuda")
    torch.cuda.synchronize()
    with allocator_peak(device) as outer:
        first = torch.empty(4 * MiB, dtype=torch.uint8, device=device)
        with allocator_peak(device) as inner:
            second = torch.empty(8 * MiB, dtype=torch.uint8, device=device)
            del second
        third = torch.empty(2 * MiB, dtype=torch.uint8, device=device)
        del first, third
    assert inner.peak_bytes == 8 * MiB
    assert outer.peak_bytes == 12 * MiB


def test_the_main_jobs_whole_fit_holds_its_budget_on_cuda() -> None:
    """On an H100 the lowest plan of this step is 0.71 of its naive peak (cuDNN's and cuBLAS's
    fixed workspaces weigh more on CUDA than on CPU, where 0.5 is reached)."""
    data = DigitsDataModule(image_size=16, batch_size=16)
    strategy = TinyBackpropStrategy(memory_budget=0.85)
    run = _fit(_main_job_module(), data, strategy, accelerator="gpu", max_steps=5, limit_val_batches=1)
    _assert_the_promise_holds(run)


def test_a_zoo_whole_fit_holds_its_budget_on_cuda() -> None:
    """SDXL's U-Net in miniature at batch 4: its lowest plan is 0.85 of its naive peak on an H100."""
    module = ZooModule("sdxl_unet", batch=4)
    loader = DataLoader(TensorDataset(*(row.repeat_interleave(2, 0) for row in module.rows)), batch_size=4)
    run = _fit(module, loader, TinyBackpropStrategy(memory_budget=0.93), accelerator="gpu", max_steps=4)
    _assert_the_promise_holds(run)


def test_a_plan_on_cuda_is_exact_and_holds_its_budget() -> None:
    _assert_plan_holds(ZOO["sd3"].case(batch=2, device="cuda"), budget=0.8)  # lowest: 0.71 on an H100


def test_a_channels_last_unet_on_cuda_is_exact_and_holds_its_budget(record_property) -> None:
    """diffusers recommends channels-last for its U-Nets on GPUs: cuDNN's channels-last kernels,
    and the copies a kernel makes where gradients of both layouts meet, in the plan's word. At
    the lowest budget the planner names (CUDA's workspaces decide it)."""
    case = ZOO["unet2d"].case(batch=4, device="cuda").to_channels_last()
    with pytest.raises(InfeasibleBudgetError) as refused:
        rematerialize(case.model, *case.args, memory_budget=1, **case.kwargs)
    lowest = refused.value.minimum_budget_bytes
    record_property("lowest_fraction", lowest / refused.value.naive_bytes)
    _assert_plan_holds(case, budget=lowest)


def _assert_plan_holds(case: ZooCase, budget: float | int) -> None:
    """The plan at ``budget`` for one metered step: within the budget and 5% of its prediction,
    with plain autograd's gradients."""
    case.step()
    reference = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    plan = rematerialize(case.model, *case.args, memory_budget=budget, **case.kwargs)
    try:
        verdict = plan.verify(case.step)
        assert verdict.within_budget, verdict
        assert abs(verdict.ratio - 1) <= 0.05, verdict
        _assert_gradients_match(case.model, reference)
    finally:
        plan.remove()


def _assert_gradients_match(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    """Every gradient within 1e-4 of plain autograd's, relative to its largest entry (CUDA
    kernels may sum in another order)."""
    for name, parameter in model.named_parameters():
        if name in reference:
            scale = reference[name].abs().max().clamp_min(1e-6)
            assert float((parameter.grad - reference[name]).abs().max() / scale) < 1e-4, name


def test_the_host_tier_on_cuda_copies_through_pinned_memory_and_holds_its_budget(record_property) -> None:
    """Saved activations offloaded to pinned host memory and back, at the lowest budget the planner
    names with the host tier (below the device-only one): within the budget and 5% of the
    prediction, the host peak as reported, gradients as plain autograd's; the measured copy costs
    go into the test report (the GPU check's record of the host link)."""
    from lightning_tbp import InfeasibleBudgetError
    from lightning_tbp.remat.host_tier import HostCopies, Resident, host_use, pack, unpack
    from lightning_tbp.remat.options import Option
    from lightning_tbp.remat.overheads import step_overheads

    view = torch.randn(256, 1024, device="cuda")[3:, 8:]
    packed = pack(view, HostCopies(Resident()))
    assert packed.host.is_pinned() and torch.equal(unpack(packed), view)  # type: ignore[union-attr]
    case = ZOO["flux"].case(batch=8, device="cuda")
    case.step()
    reference = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    lowest = {}
    for tier in ("off", "on"):
        with pytest.raises(InfeasibleBudgetError) as error:
            rematerialize(case.model, *case.args, memory_budget=1, host_tier=tier, **case.kwargs)
        lowest[tier] = error.value.minimum_budget_bytes
    record_property("lowest_budget_bytes", lowest)
    assert lowest["on"] < lowest["off"]
    plan = rematerialize(case.model, *case.args, memory_budget=lowest["on"], host_tier="on", **case.kwargs)
    try:
        assert Option.OFFLOAD in plan.current.options.values()
        host_use.reset_peak()
        before = host_use.live  # what earlier tests' optimizers keep there (their state on the host)
        verdict = plan.verify(case.step)
        assert verdict.within_budget, verdict
        assert abs(verdict.ratio - 1) <= 0.05, verdict
        assert abs((host_use.peak - before) / plan.current.planned.host_peak_bytes - 1) <= 0.05
        _assert_gradients_match(case.model, reference)
    finally:
        plan.remove()
    overheads = step_overheads(torch.device("cuda"))
    record_property("offload_ns_per_byte", overheads.offload_ns_per_byte)
    record_property("offload_save_ns", overheads.offload_save_ns)


def test_streamed_weights_on_cuda_leave_the_device_and_hold_the_budget(record_property) -> None:
    """A Flux-style LoRA whose frozen weights stream from pinned host memory: its parameters'
    data leaves the device, the step holds the budget and the prediction within 5% (as device
    levels), the host holds the weights, and the adapters' gradients are plain autograd's."""
    from lightning_tbp import InfeasibleBudgetError
    from lightning_tbp.diffusion.lora import add_lora, lora_options
    from lightning_tbp.remat.host_tier import host_use
    from lightning_tbp.remat.options import Option

    case = ZOO["flux"].case(batch=2, device="cuda")
    add_lora(case.model, lora_options(4))
    case.step()
    reference = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    with pytest.raises(InfeasibleBudgetError) as error:
        rematerialize(case.model, *case.args, memory_budget=1, host_tier="off", **case.kwargs)
    device_only = error.value.minimum_budget_bytes
    plan = rematerialize(case.model, *case.args, memory_budget=device_only // 2, host_tier="on", **case.kwargs)
    try:
        assert Option.STREAM in plan.current.options.values()
        streamed = [p for p in case.model.parameters() if p.device.type == "cpu"]
        assert streamed and all(p.is_pinned() for p in streamed)
        assert sum(p.numel() * p.element_size() for p in streamed) == plan.streamed_bytes
        host_use.reset_peak()
        verdict = plan.verify(case.step)
        record_property("streamed_bytes", plan.streamed_bytes)
        record_property("verdict", verdict.describe())
        assert verdict.within_budget, verdict
        assert abs(verdict.ratio - 1) <= 0.05, verdict
        assert host_use.peak >= plan.streamed_bytes
        _assert_gradients_match(case.model, reference)
    finally:
        plan.remove()
    assert all(p.device.type == "cuda" for p in case.model.parameters())  # brought back


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_a_dp_lora_step_on_cuda_streams_its_base_and_holds_the_budget(mode: str, record_property) -> None:
    """DP on a Flux-style LoRA whose frozen base streams from pinned host memory (activations
    may be offloaded too): the engine reads no streamed weight off the device (its taps,
    bookkeeping's replays, offloaded saves copied back in each pass), the step holds
    the budget and the prediction within 5%, and the clipped gradients are the unplanned DP
    step's."""
    from lightning_tbp import InfeasibleBudgetError
    from lightning_tbp.diffusion.lora import add_lora, lora_options
    from lightning_tbp.privacy import attach
    from lightning_tbp.remat.options import Option
    from lightning_tbp.testing.zoo_models import sample

    case = ZOO["flux"].case(batch=4, device="cuda")
    model = case.model.eval()
    add_lora(model, lora_options(4))
    engine = attach(model, mode=mode, max_grad_norm=0.01, noise_multiplier=0.0)

    def step() -> None:
        engine.probe_next_step()
        out = sample(model(*case.args, **case.kwargs))
        engine.backward((out.float() - case.target).square().flatten(1).mean(dim=1))

    plan = None
    try:
        step()
        reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with pytest.raises(InfeasibleBudgetError) as error:
            rematerialize(model, *case.args, memory_budget=1, host_tier="off", **case.kwargs)
        device_only = error.value.minimum_budget_bytes
        plan = rematerialize(model, *case.args, memory_budget=device_only // 2, host_tier="on", **case.kwargs)
        assert Option.STREAM in plan.current.options.values()
        verdict = plan.verify(step)
        record_property("verdict", verdict.describe())
        assert verdict.within_budget, verdict
        assert abs(verdict.ratio - 1) <= 0.05, verdict
        model.zero_grad(set_to_none=True)
        step()
        _assert_gradients_match(model, reference)
    finally:
        if plan is not None:
            plan.remove()
        engine.detach()


def test_the_optimizer_state_on_the_host_on_cuda_leaves_the_device_and_overlaps(record_property) -> None:
    """Adam's state and step on the host (pinned masters, a worker thread overlapping the
    backward): no state on the device, a lower device peak than the step inside the backward on
    the device, and weights after three steps equal the device step's within float rounding
    (CPU and CUDA Adam kernels may round differently); both steps' times recorded (the first
    step's peak compared: where the device's state is made)."""
    import copy
    import time

    from lightning_tbp.optim import OptimizerInBackward
    from lightning_tbp.optim.host_state import HostOptimizerState

    case = ZOO["dit"].case(batch=4, device="cuda")
    hosted = copy.deepcopy(case.model)
    results = {}

    # the same gradients in both runs: cuDNN may pick other (TF32, atomic) algorithms for each
    def exact_convolutions():
        return torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False)

    for name, model in (("device", case.model), ("host", hosted)):
        torch.manual_seed(1)  # the same dropout masks in both runs
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        stepper = OptimizerInBackward(optimizer)
        if name == "host":
            stepper.host = HostOptimizerState(optimizer)
        times, peaks = [], []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with exact_convolutions(), allocator_peak(torch.device("cuda")) as reading, stepper.stepping():
                out = model(*case.args, **case.kwargs)
                out = out.sample if hasattr(out, "sample") else out[0]
                out.float().square().mean().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            peaks.append(reading.peak_bytes)
        on_device = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.is_cuda)
        results[name] = (peaks[0], sorted(times)[1], on_device)  # the first step makes the state
        stepper.remove()
    record_property("peaks_seconds_state_on_device", results)
    assert results["host"][2] == 0 < results["device"][2]
    assert results["host"][0] < results["device"][0]
    apart = {
        path: float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))
        for (path, a), b in zip(case.model.named_parameters(), hosted.parameters(), strict=True)
    }
    worst = sorted(apart.items(), key=lambda item: -item[1])[:5]
    record_property("largest_relative_differences", worst)
    assert worst[0][1] <= 1e-4, worst


def test_fp32_masters_and_part_of_the_state_on_the_host_on_cuda(record_property) -> None:
    """A bf16 model on CUDA with float32 masters on the host (pinned, stepped on the worker
    thread, the gradient widened there and the master's rounding copied back): the weights of the
    recipe by hand (float32 AdamW on host masters over the CUDA gradients widened), bit for bit,
    the host step running the same CPU kernels. Then part of the state on the host (the largest
    parameter's), the rest stepped on the device: the device-only step's weights within float
    rounding (CPU and CUDA AdamW kernels may round differently). Step times recorded."""
    import time

    from lightning_tbp.optim import OptimizerInBackward
    from lightning_tbp.optim.host_state import HostOptimizerState

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = (torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        return torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)

    def batch(step: int) -> torch.Tensor:
        return torch.randn(64, 256, generator=torch.Generator().manual_seed(step)).to("cuda", torch.bfloat16)

    steps, lr = 4, 1e-4
    by_hand = model()
    masters = [p.detach().float().cpu().requires_grad_() for p in by_hand.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=lr)
    for step in range(steps):
        by_hand.zero_grad(set_to_none=True)
        by_hand(batch(step)).float().square().mean().backward()
        for param, master in zip(by_hand.parameters(), masters, strict=True):
            master.grad = param.grad.float().cpu()
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(by_hand.parameters(), masters, strict=True):
                param.copy_(master)
    times: dict[str, float] = {}

    def run(name: str, hosted: bool, master_dtype: torch.dtype | None, part: bool = False) -> torch.nn.Module:
        found = model()
        stepper = OptimizerInBackward(torch.optim.AdamW(found.parameters(), lr=lr))
        if hosted:
            largest = [max(found.parameters(), key=torch.Tensor.numel)] if part else None
            stepper.host = HostOptimizerState(stepper.optimizer, master_dtype=master_dtype, hosted=largest)
        durations = []
        for step in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with stepper.stepping():
                found(batch(step)).float().square().mean().backward()
            torch.cuda.synchronize()
            durations.append(time.perf_counter() - start)
        stepper.remove()
        times[name] = sorted(durations[1:])[len(durations[1:]) // 2]
        return found

    with_masters = run("fp32 masters on the host", hosted=True, master_dtype=torch.float32)
    for (path, a), b in zip(by_hand.named_parameters(), with_masters.parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b), path
    on_device = run("on the device", hosted=False, master_dtype=None)
    part = run("the largest parameter's state on the host", hosted=True, master_dtype=None, part=True)
    record_property("median_step_seconds", times)
    for (path, a), b in zip(on_device.named_parameters(), part.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3, msg=path)  # bf16 weights: a few ulps


def test_auto_budget_is_the_free_device_memory() -> None:
    case = ZOO["dit"].case(batch=2, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    plan = rematerialize(case.model, *case.args, memory_budget="auto", **case.kwargs)
    budget = plan.current.budget_bytes
    plan.remove()
    assert 0 < budget <= free


def test_the_triton_flash_kernel_compiled_on_cuda() -> None:
    pytest.importorskip("triton")
    script = Path(__file__).parent / "scripts" / "flash_kernel_interpreted.py"
    completed = subprocess.run([sys.executable, str(script), "cuda"], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr[-2000:]


def test_tbp_estimate_matches_a_whole_fit_on_cuda(tmp_path: Path) -> None:
    from estimate_check import CASES, check

    row = check(next(c for c in CASES if c.name == "ddpm_unet_tiny"), "cuda", steps=3, scratch=tmp_path)
    assert row["estimate_device"] == "cuda"
    assert abs(float(row["estimated_vs_measured"]) - 1) <= 0.05, row  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["tiny_backprop_fsdp", "tiny_backprop_fsdp2", "tiny_backprop_fsdp2_host"])
def test_a_sharded_strategy_on_one_gpu_plans_and_holds_its_budget(strategy: str, tmp_path: Path) -> None:
    """FSDP1 and FSDP2 with a plan on one GPU (their own process each): a short fit of the zoo's
    DiT whose metered loop steps hold the budget (on CPU: ``test_multi_device``'s FSDP2 fits);
    ``tiny_backprop_fsdp2_host`` at a budget the host tier meets, offloading through pinned memory."""
    out = tmp_path / "run.json"
    script = Path(__file__).parent / "scripts" / "one_gpu_sharded.py"
    completed = subprocess.run(
        [sys.executable, str(script), strategy, str(out)], capture_output=True, text=True, timeout=240
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    record = json.loads(out.read_text())
    steps = record["loop_steps"]
    readings = [(s["peak_bytes"], s["predicted_bytes"], s["budget_bytes"]) for s in steps]
    assert steps and all(peak <= budget for peak, _, budget in readings), readings
    if strategy == "tiny_backprop_fsdp2_host":
        assert "OFFLOAD" in record["options"], record["options"]


def test_the_memory_callback_on_cuda_records_history_and_dumps_an_out_of_memory_snapshot(
    tmp_path: Path, record_property
) -> None:
    """``MemoryProfilerCallback(record_history=True)`` writes the allocator's history for the fit;
    a step that runs out of memory leaves ``oom_snapshot_rank0.pickle``; the callback's cost per
    step (``benchmarks/callback_overhead.py``'s fit, metering every batch, against none) goes into
    the report."""
    import lightning as L
    from callback_overhead import run_one
    from models import Denoiser

    from lightning_tbp import MemoryProfilerCallback

    medians = {name: run_one(name, 12, 2, "cuda")["median_step_ms"] for name in ("no_callback", "callback_every_1")}
    record_property("median_step_ms_without_and_with_the_callback", medians)

    class RunsOutOfMemory(Denoiser):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 3:
                torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # a petabyte: refused at once
            return super().training_step(batch, batch_idx)

    callback = MemoryProfilerCallback(every_n_steps=1, warmup_steps=1, output_dir=tmp_path, record_history=True)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    data = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(RunsOutOfMemory(), DataLoader(TensorDataset(data), batch_size=4))
    assert (tmp_path / "oom_snapshot_rank0.pickle").stat().st_size > 0
    assert (tmp_path / "memory_history_rank0.pickle").stat().st_size > 0


def test_the_main_job_under_fsdp2_on_one_gpu_samples_and_exports_its_ema(tmp_path: Path) -> None:
    """``tbp fit -c configs/ddpm_unet_tiny.yaml`` under tiny_backprop_fsdp2 on one GPU (NCCL):
    its EMA kept as DTensor shards, every rank sampling the grid and the export gathering the
    whole EMA weights (on CPU: ``test_multi_device``'s two-process main job, on gloo)."""
    from diffusers import UNet2DModel

    config = Path(__file__).parents[1] / "configs" / "ddpm_unet_tiny.yaml"
    command = [sys.executable, "-m", "lightning_tbp.cli", "fit", "-c", str(config)]
    command += ["--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.strategy=tiny_backprop_fsdp2"]
    command += ["--trainer.max_steps=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    command += ["--trainer.check_val_every_n_epoch=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
    command += [
        f"--trainer.default_root_dir={tmp_path}",
        "--model.init_args.sample_images=4",
        "--model.init_args.sample_steps=3",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["step_000002.png"]
    exported = UNet2DModel.from_pretrained(tmp_path / "pretrained" / "unet")
    assert all(torch.isfinite(p).all() for p in exported.parameters())
