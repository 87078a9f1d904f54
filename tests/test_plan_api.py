"""The framework-free entry point: install, report, re-plan per shape, remove."""

import json
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import CASES, make_case, mlp_chain, parameter_bytes, training_step
from processes import run_in_a_gloo_group_of_one
from torch import nn

from lightning_tbp import InfeasibleBudgetError, NothingToPlanWarning, rematerialize
from lightning_tbp.remat import Plan
from lightning_tbp.remat.plan import BatchAboveCeilingWarning
from lightning_tbp.remat.solve import PLANNING_MARGIN, budget_for_peak

UNET = next(c for c in CASES if c.name == "unet2d_attention")


def test_remove_restores_the_module_exactly() -> None:
    model, args, kwargs = make_case(UNET)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_attrs = {name: set(m.__dict__) for name, m in model.named_modules()}
    before_hooks = {name: len(m._forward_pre_hooks) + len(m._forward_hooks) for name, m in model.named_modules()}
    ref_loss, ref_grads = training_step(model, UNET, args, kwargs)

    plan = rematerialize(model, *args, memory_budget=0.6, **kwargs)
    wrapped = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert wrapped and set(wrapped) == set(plan.current.options)
    plan.remove()

    assert {name: set(m.__dict__) for name, m in model.named_modules()} == before_attrs
    assert {name: len(m._forward_pre_hooks) + len(m._forward_hooks) for name, m in model.named_modules()} == (
        before_hooks
    )
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
    loss, grads = training_step(model, UNET, args, kwargs)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_report_and_json_summary() -> None:
    model, args, kwargs = make_case(UNET)
    plan = rematerialize(model, *args, memory_budget="auto", **kwargs)
    report = plan.report()
    for block in plan.current.blocks:
        assert block.path in report
    assert "predicted peak" in report and "recompute" in report
    summary = json.loads(plan.to_json())
    assert summary["predicted_peak_bytes"] <= summary["budget"]["bytes"]
    assert summary["budget"]["bytes"] == int(0.5 * summary["naive_peak_bytes"])  # "auto" on CPU
    assert summary["predicted_recompute_flops"] > 0
    decisions = {b["decision"] for b in summary["blocks"]}
    assert decisions <= {"keep", "full", "selective", "lazy"} and decisions != {"keep"}
    assert all(b["kept_bytes"] <= b["naive_kept_bytes"] + 1 for b in summary["blocks"] if b["decision"] != "keep")
    plan.remove()


def test_profile_records_unet_skip_edges() -> None:
    """The trace knows which block feeds which: U-Net skips run from the down path to the up path."""
    model, args, kwargs = make_case(UNET)
    plan = rematerialize(model, *args, memory_budget=0.9, **kwargs)
    edges = {(e["from"], e["to"]) for e in plan.to_dict()["edges"]}
    plan.remove()
    assert ("down_blocks.0.downsamplers.0", "down_blocks.1") in edges  # the main path
    skips = {(a, b) for a, b in edges if a.startswith("down_blocks") and b.startswith("up_blocks")}
    assert ("down_blocks.0.resnets.0", "up_blocks.2") in skips
    assert len({b for _, b in skips if "." not in b[len("up_blocks.") :]}) == 3, "every up stage takes skips"


def test_new_input_shape_gets_its_own_plan_and_stays_exact() -> None:
    model, args, kwargs = make_case(UNET)
    plan = rematerialize(model, *args, memory_budget=0.6, **kwargs)
    first = plan.current
    bigger = (torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4]))
    loss, grads = training_step(model, UNET, bigger, kwargs)
    assert len(plan.shape_plans) == 2 and plan.current is not first
    assert plan.current.naive.peak_bytes > first.naive.peak_bytes
    training_step(model, UNET, args, kwargs)
    assert plan.current is first, "the cached plan of the first shape is reused"
    plan.remove()
    ref_loss, ref_grads = training_step(model, UNET, bigger, kwargs)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_no_planning_under_no_grad() -> None:
    model, args, kwargs = make_case(UNET)
    plan = rematerialize(model, *args, memory_budget=0.6, **kwargs)
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32), torch.tensor([5]))
    assert len(plan.shape_plans) == 1
    plan.remove()


def test_infeasible_budget_names_the_minimum() -> None:
    model, args, kwargs = make_case(UNET)
    with pytest.raises(InfeasibleBudgetError, match="minimum feasible budget") as info:
        rematerialize(model, *args, memory_budget="1KiB", **kwargs)
    error = info.value
    assert error.minimum_budget_bytes > 1024
    assert f">= {error.minimum_budget_bytes}" in str(error)
    assert not any("forward" in m.__dict__ for m in model.modules()), "a failed plan leaves nothing behind"
    assert not model._forward_pre_hooks
    plan = rematerialize(model, *args, memory_budget=error.minimum_budget_bytes, **kwargs)
    assert plan.current.predicted_peak_bytes <= error.minimum_step_bytes
    plan.remove()


@settings(max_examples=8, deadline=None)
@given(
    depth=st.integers(2, 6),
    width=st.sampled_from([16, 48, 96]),
    batch=st.integers(1, 24),
    asked=st.sampled_from(["1KiB", 0.01, 0.05]),
)
def test_the_advice_of_a_refusal_passed_back_plans(depth, width, batch, asked) -> None:
    """Whatever the model and however low the budget asked, the figures the refusal's message
    advises (parsed from its text, as a user reads them) plan when passed back."""
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)]
    model = nn.Sequential(*blocks)
    x = torch.randn(batch, width)
    try:
        rematerialize(model, x, memory_budget=asked).remove()
        return  # the asked budget was feasible for this one: nothing to advise
    except InfeasibleBudgetError as error:
        message = str(error)
    advised_bytes = int(re.search(r"memory_budget >= (\d+) \(bytes", message).group(1))
    fraction = re.search(r"or >= ([\d.]+) \(fraction\)", message)
    assert fraction is not None or "no fraction" in message  # a fraction above 1 is never advised
    for advised in (advised_bytes, *([float(fraction.group(1))] if fraction else [])):
        plan = rematerialize(model, x, memory_budget=advised)
        assert plan.current is not None
        plan.remove()


def test_malformed_budget_is_a_value_error() -> None:
    model, args, kwargs = make_case(UNET)
    with pytest.raises(ValueError, match="is not valid; use a float"):
        rematerialize(model, *args, memory_budget="lots", **kwargs)


def test_nothing_to_plan_warns_and_runs_unchanged() -> None:
    """Under "auto" (a default fraction on the CPU) or a budget the step meets unplanned, a module
    with nothing to plan runs unchanged with a warning."""
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    for budget in ("auto", 1 << 30):
        with pytest.warns(NothingToPlanWarning, match="nothing to plan"):
            plan = rematerialize(model, x, memory_budget=budget)
        assert plan.current.options == {}
        model(x).sum().backward()
        assert model.weight.grad is not None
        plan.remove()


@pytest.mark.parametrize("budget", [0.5, 1])
def test_a_budget_nothing_can_meet_is_refused_even_with_nothing_to_plan(budget: float) -> None:
    """An explicit budget below the unplanned step's peak raises, naming that peak as the minimum,
    rather than running over it with a warning."""
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with pytest.raises(InfeasibleBudgetError, match="below the minimum feasible budget") as error:
        rematerialize(model, x, memory_budget=budget)
    assert error.value.minimum_peak_bytes == error.value.naive_bytes
    assert any("nothing to plan in Linear" in note for note in error.value.__notes__)


def test_budget_above_naive_plans_nothing() -> None:
    """A budget the unplanned step fits with the planning margin plans nothing; a budget at the
    naive peak (1.0) does not leave that margin, so the plan checkpoints something."""
    model = mlp_chain(depth=4)
    x = torch.randn(256, 64)
    at_naive = rematerialize(model, x, memory_budget=1.0)
    naive = at_naive.current.naive.peak_bytes
    assert at_naive.current.options and at_naive.current.predicted_peak_bytes <= naive * (1 - PLANNING_MARGIN)
    at_naive.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = rematerialize(model, x, memory_budget=budget_for_peak(naive) + parameter_bytes(model))
    assert plan.current.options == {} and plan.current.predicted_peak_bytes == plan.current.naive.peak_bytes
    plan.remove()


def test_planning_does_not_shift_the_random_stream(monkeypatch) -> None:
    """Profiling and calibration fork the RNG, so a run's dropout and noise are unchanged; also
    the first plan of a process, which measures the option overheads (once per device type)."""
    from lightning_tbp.remat import overheads

    monkeypatch.setattr(overheads, "_MEASURED", {})
    model, args, kwargs = make_case(UNET)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    plan = rematerialize(model, *args, memory_budget=0.6, **kwargs)
    assert torch.equal(torch.rand(4), expected)
    plan.remove()


def test_planning_inside_a_running_profiler_is_exact_and_leaves_it_running() -> None:
    """The exact CPU meter is a profiler; under the user's one it steps aside and says so."""
    from torch.profiler import ProfilerActivity, profile

    model, args, kwargs = make_case(UNET)
    ref_loss, ref_grads = training_step(model, UNET, args, kwargs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.warns(UserWarning, match="profiler is running"):
            plan = rematerialize(model, *args, memory_budget=0.6, **kwargs)
        loss, grads = training_step(model, UNET, args, kwargs)
        assert torch.autograd.profiler._is_profiler_enabled, "the user's profiler is still on"
    plan.remove()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert any("convolution" in e.name for e in prof.events())


def test_named_minimum_does_not_depend_on_timing_noise() -> None:
    """Op times are re-measured on every trace; the minimum an error names must not move with them."""
    model, args, kwargs = make_case(UNET)
    named = []
    for _ in range(2):
        with pytest.raises(InfeasibleBudgetError) as info:
            rematerialize(model, *args, memory_budget="1KiB", **kwargs)
        named.append(info.value.minimum_budget_bytes)
    assert named[0] == named[1]


def test_batch_ceiling_plans_once_for_every_batch_size() -> None:
    """Poisson batches (DP) vary in size: one plan, made for the ceiling, serves them all, exactly."""
    model, _, _ = make_case(UNET)
    plan = Plan(model, 0.6, batch_ceiling=4)
    calls = {batch: (torch.randn(batch, 3, 32, 32), torch.arange(batch) * 7) for batch in (2, 3, 1, 4)}
    planned = {batch: training_step(model, UNET, call, {}) for batch, call in calls.items()}
    assert len(plan.shape_plans) == 1 and plan.current.batch_size == 4
    assert plan.current.options, "the ceiling's plan checkpoints something"
    with pytest.warns(BatchAboveCeilingWarning, match="above the plan's batch ceiling 4"):
        training_step(model, UNET, (torch.randn(5, 3, 32, 32), torch.arange(5)), {})
    assert len(plan.shape_plans) == 1
    plan.remove()
    tight = Plan(model, "1KiB", batch_ceiling=4)
    with pytest.raises(InfeasibleBudgetError) as error:
        training_step(model, UNET, calls[2], {})
    assert any("batch ceiling, 4 samples" in note for note in error.value.__notes__)
    tight.remove()
    for batch in (2, 3):
        loss, grads = training_step(model, UNET, calls[batch], {})
        assert torch.equal(planned[batch][0], loss)
        assert all(torch.equal(planned[batch][1][k], grads[k]) for k in grads)


def test_a_batch_below_the_ceiling_is_metered_against_the_budget() -> None:
    """Under Poisson sampling the plan is made for the ceiling and most steps are smaller: such a
    step is still metered, and checked against the budget (its prediction is for the ceiling)."""
    model, _, _ = make_case(UNET)
    model.zero_grad(set_to_none=True)
    plan = Plan(model, 0.6, batch_ceiling=4, measure=True)
    try:
        training_step(model, UNET, (torch.randn(2, 3, 32, 32), torch.arange(2) * 7), {})
        checked = plan.finish_measurement()
        assert checked is not None and checked.batch_size == 4 and checked.measured_batch_size == 2
        assert not checked.measured_at_planned_batch
        assert 0 < checked.measured_peak_bytes < checked.predicted_peak_bytes <= checked.budget_bytes
        assert "at batch 2 of up to 4, within the budget" in plan.report(checked)
    finally:
        plan.remove()


def test_agreement_sees_every_plan_and_its_errors() -> None:
    """The hook the distributed strategies use: every new plan, or the error, passes through it."""
    model, args, kwargs = make_case(UNET)
    seen = []

    def agree(signature, local):
        seen.append((signature, local))
        if isinstance(local, Exception):
            raise RuntimeError("a rank could not plan") from local
        return local

    plan = Plan(model, 0.6, agree=agree)
    training_step(model, UNET, args, kwargs)
    training_step(model, UNET, args, kwargs)
    assert len(seen) == 1 and seen[0][1] is plan.current
    plan.remove()
    plan = Plan(model, "1KiB", agree=agree)
    with pytest.raises(RuntimeError, match="could not plan"):
        training_step(model, UNET, args, kwargs)
    assert isinstance(seen[-1][1], InfeasibleBudgetError)
    plan.remove()


def test_planning_in_the_forward_runs_the_module_hooks_once() -> None:
    """The plan profiles from the module's own pre-hook; the module's hooks must not run for the
    profiling pass too (FSDP2's post-forward hook would reshard the gathered parameters)."""
    model, args, kwargs = make_case(UNET)
    calls = {"pre": 0, "post": 0}
    model.register_forward_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    Plan(model, 0.6)
    model.register_forward_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    training_step(model, UNET, args, kwargs)
    assert calls == {"pre": 1, "post": 1}


def test_long_runs_are_timed_once(monkeypatch) -> None:
    """Profiling repeats a timing only where a run is short enough for a hiccup to matter: an
    op (``best_ns``) and the whole real forward (``time_forward``) at or above their thresholds
    run once (for an op, its timed warm-up is that run), below them best of two."""
    from lightning_tbp.remat import calibrate, forward_timing

    cpu = torch.device("cpu")
    runs: list[int] = []
    assert calibrate.best_ns(lambda: runs.append(1), cpu, warm_up_ns=0) >= 0
    assert len(runs) == 2
    runs.clear()
    calibrate.best_ns(lambda: runs.append(1), cpu)  # its own warm-up, then best of two
    assert len(runs) == 3
    runs.clear()  # a warm-up as long as the threshold is the time
    assert calibrate.best_ns(lambda: runs.append(1), cpu, warm_up_ns=calibrate.SINGLE_RUN_NS) == calibrate.SINGLE_RUN_NS
    assert runs == []
    monkeypatch.setattr(calibrate, "SINGLE_RUN_NS", 0)
    runs.clear()
    calibrate.best_ns(lambda: runs.append(1), cpu)
    assert len(runs) == 1

    model = mlp_chain(4, 16)
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    candidates = {block: f"{i}" for i, block in enumerate(model)}
    args = (torch.randn(8, 16),)
    _, per_block = forward_timing.time_forward(model, candidates, args, {}, False, [])
    assert len(forwards) == 2 and len(per_block) == len(candidates)
    monkeypatch.setattr(forward_timing, "SINGLE_FORWARD_NS", 0)
    forwards.clear()
    _, per_block = forward_timing.time_forward(model, candidates, args, {}, False, [])
    assert len(forwards) == 1 and len(per_block) == len(candidates) and all(t > 0 for t in per_block)


@pytest.mark.parametrize(("fill_ns", "rounds"), [(0, 3), (10**15, 12)])
def test_block_calibration_rounds_fill_their_time(monkeypatch, fill_ns: int, rounds: int) -> None:
    """A calibrated block runs its options in at least the fewest interleaved rounds, and in
    more, up to the most, while its rounds have not yet taken ``ROUNDS_FILL_NS``: one warm-up
    step, then per round a plain step and one per option."""
    from lightning_tbp.remat import calibrate_blocks
    from lightning_tbp.remat.options import Option

    monkeypatch.setattr(calibrate_blocks, "ROUNDS_FILL_NS", fill_ns)
    assert calibrate_blocks.ROUNDS == (3, 12)
    model = mlp_chain(4, 16)
    steps: list[int] = []
    model[1].register_forward_hook(lambda *_: steps.append(1))
    options = (Option.FULL, Option.SELECTIVE)
    extra = calibrate_blocks._time_block(model, "1", ((torch.randn(8, 16),), {}), options, cache_limit=0)
    assert set(extra) == set(options) and all(t >= 0 for t in extra.values())
    assert len(steps) == 1 + rounds * (1 + len(options))


def test_a_plan_refuses_weights_sharded_after_it_was_made() -> None:
    """``fully_shard`` after ``rematerialize``: the plan counted the weights whole and no
    all-gather (the zoo's DiT ran at 1.10x its prediction, silently). Its next call is refused with
    the fix; planned after sharding, the same model runs its steps (inside and outside the call
    a unit's parameters are gathered tensors or DTensor shards: neither is a change)."""
    body = """
    import pytest
    from torch.distributed.fsdp import fully_shard
    from lightning_tbp import rematerialize
    from lightning_tbp.testing.zoo_models import ZOO

    def shard(model):
        for block in model.transformer_blocks[1:]:
            fully_shard(block)
        fully_shard(model)

    case = ZOO["dit"].case(batch=8)
    plan = rematerialize(case.model, *case.args, memory_budget=0.8, **case.kwargs)
    shard(case.model)
    with pytest.raises(RuntimeError, match=r"changed layout after its plan was made .*FSDPDiT.*plan.remove\\(\\)"):
        case.loss()
    plan.remove()
    plan = rematerialize(case.model, *case.args, memory_budget=0.8, **case.kwargs)
    for _ in range(2):
        case.loss().backward()
    assert plan.current is not None and len(plan.shape_plans) == 1
    """
    run_in_a_gloo_group_of_one(body, port=29671)
