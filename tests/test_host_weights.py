"""Frozen weights streamed from host memory (the plan's ``STREAM``), chosen by the planner.

On this CPU the host is memory numpy allocates, which the exact CPU meter does not count, so the
peaks measured here are device-resident ones. Plans that stream count against the parameters as
loaded, so their peaks (and budgets) can be below zero; they are compared as device levels
(``ShapePlan.ratio``). Promises are checked where users run them: exact gradients against plain
autograd, peaks against the exact meter, and whole fits whose device budget is below what the
parameters alone take.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import run_in_a_gloo_group_of_one
from test_host_tier import _reference_grads, _seeded
from test_loop_truth import _fit
from test_plan_fidelity import _measured
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy, rematerialize
from lightning_tbp.diffusion.lora import add_lora, lora_options
from lightning_tbp.memory import measure_peak
from lightning_tbp.memory.held import held_memory
from lightning_tbp.memory.homes import home_of
from lightning_tbp.remat.host_weights import HostWeights, streamable, unshadow
from lightning_tbp.remat.options import Option
from lightning_tbp.testing.zoo_lightning import ZooModule
from lightning_tbp.testing.zoo_models import HELD_OUT, ZOO

TOLERANCE = 0.05
ROOT = Path(__file__).resolve().parents[1]


def _block() -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    block.requires_grad_(False)
    return block


def test_placed_weights_leave_the_meter_and_come_back_equal() -> None:
    block = _block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    weights = HostWeights(block)
    gc.collect()

    def place() -> None:
        weights.place(["0.weight", "2.weight"])

    assert measure_peak(place).peak_bytes == 0  # on a CPU they stay where they were loaded: nothing moves
    assert weights.moved_bytes == 2 * 128 * 256 * 4
    assert home_of(block[0].weight) == torch.device("cpu") and home_of(block[0].bias) is None
    assert all(torch.equal(v, before[k]) for k, v in block.state_dict().items())  # same names, same values
    x = torch.randn(4, 128)
    expected = nn.functional.linear(
        nn.functional.gelu(nn.functional.linear(x, before["0.weight"], before["0.bias"])),
        before["2.weight"],
        before["2.bias"],
    )

    def shadowed_call() -> torch.Tensor:
        shadows = weights.shadow(block, ["0.weight", "2.weight"])
        try:
            return block(x)
        finally:
            unshadow(shadows)

    reading = measure_peak(shadowed_call)
    assert reading.peak_bytes >= weights.moved_bytes  # the copies are device memory while the block runs
    assert torch.equal(shadowed_call(), expected)
    assert "weight" not in block[0].__dict__  # the parameter is back in charge
    weights.place([])
    assert weights.moved_bytes == 0 and home_of(block[0].weight) is None
    assert all(torch.equal(v, before[k]) for k, v in block.state_dict().items())


def test_only_frozen_plain_weights_of_one_name_and_some_size_stream() -> None:
    block = _block()
    assert streamable(block[0].weight)
    assert not streamable(block[0].bias)  # too small to be worth a copy
    trainable = nn.Parameter(torch.randn(256, 256))
    assert not streamable(trainable)
    assert not streamable(nn.Parameter(torch.randn(256, 512)[:, :256], requires_grad=False))  # a view
    from lightning_tbp.remat.host_weights import frozen_weights

    tied = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)).requires_grad_(False)
    tied[1].weight = tied[0].weight
    ids: dict[int, int] = {}
    names = frozen_weights(tied, lambda t: ids.setdefault(t.untyped_storage().data_ptr(), len(ids)))
    assert not names  # one storage under two names stays


def test_frozen_weights_fsdp2_shards_never_stream() -> None:
    """Under ``tiny_backprop_fsdp2`` the host tier offloads activations only: FSDP2 turns a frozen
    weight into a shard of a DTensor, gathered by FSDP2 for each use, which no plan streams (a
    process of its own, a gloo group of one)."""
    body = """
from torch.distributed.fsdp import fully_shard
from lightning_tbp.remat.host_weights import streamable
model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 4)).requires_grad_(False)
assert streamable(model[0].weight)
fully_shard(model)
assert not streamable(model[0].weight), type(model[0].weight)
"""
    run_in_a_gloo_group_of_one(body, port=29641)


def _lora_case(name: str, batch: int = 2):
    case = (ZOO | HELD_OUT)[name].case(batch=batch)
    add_lora(case.model, lora_options(4))
    return case


def _lowest(case, host_tier: str) -> int:
    """The lowest budget ``rematerialize`` takes (budgets are positive: 1 byte where a plan gets there)."""
    try:
        plan = rematerialize(case.model, *case.args, memory_budget=1, host_tier=host_tier, **case.kwargs)
    except InfeasibleBudgetError as error:
        return error.minimum_budget_bytes
    plan.remove()
    return 1


def _assert_streams_and_keeps_its_word(name: str, must_stream: bool) -> None:
    """At the lowest budget with the host tier (below the lowest without it) a LoRA model streams
    frozen weights, and its step holds the budget and the prediction (as device levels, within
    5%) with plain autograd's gradients, bit for bit (the copies are the weights)."""
    case = _lora_case(name)
    reference = _reference_grads(case)
    without, with_host = _lowest(case, "off"), _lowest(case, "on")
    assert with_host < without, (with_host, without)
    # where a plan gets to zero (a budget of 1 byte), half the device-only minimum: the margin a
    # plan keeps is a share of its budget, and of 1 byte there is none
    budget = with_host if with_host > 1 else without // 2
    plan = rematerialize(case.model, *case.args, memory_budget=budget, host_tier="on", **case.kwargs)
    try:
        shape_plan = plan.current
        assert shape_plan.streamed_bytes == plan.streamed_bytes
        assert {Option.STREAM, Option.OFFLOAD} & set(shape_plan.options.values())
        assert not must_stream or Option.STREAM in shape_plan.options.values()
        measured = _measured(case.model, _seeded(case)) - plan.streamed_bytes
        assert measured <= shape_plan.budget_bytes, (measured, shape_plan.budget_bytes)
        ratio = shape_plan.ratio(measured, shape_plan.predicted_peak_bytes)
        assert abs(ratio - 1) <= TOLERANCE, (measured, shape_plan.predicted_peak_bytes)
        for n, p in case.model.named_parameters():
            if p.grad is not None:
                assert torch.equal(p.grad, reference[n]), n
        assert ("stream their frozen weights" in plan.report()) == bool(shape_plan.streamed)
    finally:
        plan.remove()
    assert all(home_of(p) is None for p in case.model.parameters())  # removing the plan brings them back


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_lora_models_stream_frozen_weights_below_what_recomputation_reaches(name: str) -> None:
    _assert_streams_and_keeps_its_word(name, must_stream=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unet2d", "dit", "sdxl_unet", *sorted(HELD_OUT)])
def test_more_lora_models_stream_and_keep_their_word(name: str) -> None:
    """The planner may prefer offloading activations to streaming here: either keeps its word."""
    _assert_streams_and_keeps_its_word(name, must_stream=False)


def test_a_device_smaller_than_the_weights_trains_a_lora_with_them_streamed() -> None:
    """A whole fit of a Flux-style LoRA whose device budget is below the bytes of its parameters:
    the step's budget is negative, the host tier is taken by default ('auto'), and every metered
    step of the loop holds the budget and the prediction. The plan's report gives sizes above what
    stays on the device (the streamed weights on the host), never below zero."""
    module = ZooModule("flux", batch=1, lora_rank=4)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=1)
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    with pytest.raises(InfeasibleBudgetError) as error:
        _fit(ZooModule("flux", batch=1, lora_rank=4), loader, TinyBackpropStrategy(memory_budget=1 << 10), max_steps=1)
    fits = error.value.minimum_device_bytes
    assert fits is not None and fits < parameters  # the host tier needs less device memory than the weights alone
    strategy = TinyBackpropStrategy(memory_budget=(fits + parameters) // 2)
    run = _fit(module, loader, strategy, max_steps=4)
    plan = run["plan"]
    assert plan.budget_bytes < 0 and plan.streamed_bytes > 0
    assert "host_tier='auto'" in " ".join(plan.actions) and "stream their frozen weights" in " ".join(plan.actions)
    report = strategy.plan.report(plan)
    assert "leaves nothing (" in report and not re.search(r"-\d[\d.]* (B|KiB|MiB|GiB)\b", report), report
    assert [s["step"] for s in run["loop_steps"]][:3] == [0, 1, 2]
    for step in run["loop_steps"]:
        assert step["peak_bytes"] <= step["budget_bytes"], step
        assert abs(step["ratio"] - 1) <= TOLERANCE, step
    held = held_memory(module, [], torch.device("cpu"))
    assert held.parameters == parameters  # what training holds counts the weights where they were loaded


def test_the_flux_lora_config_trains_on_a_device_smaller_than_its_weights(tmp_path) -> None:
    """The user's command for the flagship case: ``tbp fit -c configs/finetune_flux_lora.yaml``
    (DiffusionModule's Flux family, bf16 weights, FLUX.1-dev's guidance input, LoRA) on a tiny
    Flux whose device budget is below its weights' bytes. The first try names the smallest
    device; at a budget between it and the weights the strategy takes the host tier by itself,
    streams the frozen blocks, and every metered step of the whole fit, the first included,
    holds the budget and the prediction."""
    from models import tiny_flux_dev, write_latents

    from lightning_tbp.lightning_cli import run_lightning_cli

    torch.manual_seed(0)
    tiny_flux_dev().save_pretrained(tmp_path / "flux")
    write_latents(tmp_path / "z.pt", samples=8)
    command = ["fit", "-c", str(ROOT / "configs" / "finetune_flux_lora.yaml"), "--trainer.accelerator=cpu"]
    command += [f"--model.init_args.pretrained={tmp_path / 'flux'}", "--data=lightning_tbp.diffusion.LatentsDataModule"]
    command += [f"--data.init_args.path={tmp_path / 'z.pt'}"]
    command += ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0"]
    command += [
        "--data.init_args.val_fraction=0",
        "--model.init_args.export=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(InfeasibleBudgetError) as error:
        run_lightning_cli([*command, "--trainer.max_steps=1", "--trainer.strategy.memory_budget=1024"])
    fits = error.value.minimum_device_bytes
    cli = run_lightning_cli([*command, "--trainer.max_steps=4", f"--trainer.strategy.memory_budget={fits}"])
    parameters = sum(p.numel() * p.element_size() for p in cli.model.parameters())
    plan = cli.trainer.strategy.plan.current
    assert fits < parameters and plan.streamed_bytes > 0 and "host_tier='auto'" in " ".join(plan.actions)
    steps = cli.trainer.strategy.loop_steps()
    assert [s["step"] for s in steps][:3] == [0, 1, 2]
    for step in steps:
        assert step["peak_bytes"] <= step["budget_bytes"], step
        assert abs(step["ratio"] - 1) <= TOLERANCE, step


def test_a_lora_trained_with_streamed_weights_ends_where_the_plain_run_does() -> None:
    """Several optimizer steps with streamed base weights: the adapters equal the plain run's."""

    def train(host_tier: str) -> dict[str, torch.Tensor]:
        case = _lora_case("flux")
        budget = _lowest(case, "on") if host_tier == "on" else None
        plan = (
            rematerialize(case.model, *case.args, memory_budget=budget, host_tier="on", **case.kwargs)
            if budget is not None
            else None
        )
        optimizer = torch.optim.AdamW([p for p in case.model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            _seeded(case)()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if plan is not None:
            assert plan.streamed_bytes > 0
            plan.remove()
        return {n: p.detach().clone() for n, p in case.model.named_parameters()}

    streamed, plain = train("on"), train("off")
    assert all(torch.equal(streamed[n], plain[n]) for n in plain)


@pytest.fixture(scope="module")
def streaming_solver():
    """A solver that may stream, for a Flux-style LoRA's trace, and its lowest reachable peak."""
    from lightning_tbp.remat.record import record_trace
    from lightning_tbp.remat.simulate import Simulator
    from lightning_tbp.remat.solve import Solver

    case = _lora_case("flux", batch=1)
    solver = Solver(Simulator(record_trace(case.model, case.args, case.kwargs)), offload=True, stream=True)
    lowest = solver.lowest(-(1 << 40))[1]
    return solver, lowest.peak_bytes


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0.0, 1.0))
def test_a_solved_plan_peaks_under_its_target_wherever_the_budget_lies(streaming_solver, where: float) -> None:
    """Budgets from the lowest a streaming plan reaches (below zero: less than the weights) to the
    unplanned peak: the plan the solver returns peaks within the budget less its margin, which
    for a budget below zero lies below it too."""
    from lightning_tbp.remat.solve import budget_for_peak, planning_target

    solver, lowest = streaming_solver
    budget = int(budget_for_peak(lowest) + where * (solver.naive().peak_bytes - budget_for_peak(lowest)))
    solution = solver.solve(budget)
    assert solution.result.peak_bytes <= planning_target(budget) <= budget


def test_no_plan_streams_a_block_without_frozen_weights() -> None:
    """A streamed block with nothing to stream is a full checkpoint by another name (under
    bookkeeping it would even be replayed as one, and the report would count it as streaming):
    no search offers it, not even where streaming is priced below a full checkpoint."""
    from lightning_tbp.remat.record import record_trace
    from lightning_tbp.remat.simulate import Simulator
    from lightning_tbp.remat.solve import Solver, budget_for_peak

    case = ZOO["dit"].case(batch=2)  # a full fine-tune: every weight trains
    trace = record_trace(case.model, case.args, case.kwargs)
    trace.option_scale[Option.STREAM] = 0.5
    solver = Solver(Simulator(trace), stream=True)  # recomputation's plans (offloading is cheaper here)
    lowest = budget_for_peak(solver.lowest(0)[1].peak_bytes)
    for budget in (lowest, (lowest + solver.naive().peak_bytes) // 2):
        assert Option.STREAM not in solver.solve(budget).options


def test_a_module_whose_weights_sit_on_the_host_is_metered_where_they_were_loaded() -> None:
    """``Plan.verify`` without a device meters the module's device: with its weights streamed
    that is where they were loaded, not the host that holds them (on an H200 the CPU meter ran
    instead and read a streamed LoRA step at 15 KB for 1.1 MB)."""
    from lightning_tbp.memory.homes import set_home, take_home
    from lightning_tbp.remat.plan import _device_of

    block = _block()
    loaded = torch.device("meta")  # stands for the CUDA device the parameters came from
    for param in block.parameters():
        set_home(param, loaded)
    try:
        assert _device_of(block, (), {}) == loaded
    finally:
        for param in block.parameters():
            take_home(param)
    assert _device_of(block, (), {}) == torch.device("cpu")
