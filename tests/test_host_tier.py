"""The host tier: blocks' saved activations offloaded to host memory, chosen by the planner.

On this CPU the host tier is memory numpy allocates, which the exact CPU meter does not count:
the peaks measured here are the device-resident ones. Promises checked where users run them:
plans below the lowest budget recomputation alone reaches, exact gradients, and whole fits.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from models import max_relative_difference
from test_loop_truth import _assert_the_promise_holds, _fit
from test_plan_fidelity import _measured
from torch.utils.data import DataLoader, TensorDataset

from lightning_tbp import InfeasibleBudgetError, StallingPlanError, TinyBackpropStrategy, rematerialize
from lightning_tbp.memory import measure_peak
from lightning_tbp.remat import overheads
from lightning_tbp.remat.budget import format_bytes
from lightning_tbp.remat.host_tier import MIN_OFFLOAD_BYTES, HostCopies, Resident, host_use, pack, unpack
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.overheads import step_overheads
from lightning_tbp.strategies import TinyBackpropFSDP2Strategy, TinyBackpropFSDPStrategy
from lightning_tbp.testing.zoo_lightning import ZooModule
from lightning_tbp.testing.zoo_models import HELD_OUT, ZOO

TOLERANCE = 0.05


def test_a_packed_view_comes_back_equal_and_its_host_copy_is_not_counted() -> None:
    base = torch.randn(64, 1024)
    view = base[8:40, 16:]  # an offset, a stride, a shape of its own
    expected = view.clone()
    gc.collect()
    holder: dict[str, object] = {}

    def offload() -> None:
        holder["packed"] = pack(view, HostCopies(Resident()))

    assert measure_peak(offload).peak_bytes == 0  # the whole storage went to uncounted host memory
    restored = unpack(holder["packed"])  # type: ignore[arg-type]
    assert torch.equal(restored, expected)
    assert restored.stride() == view.stride() and restored.storage_offset() == view.storage_offset()
    assert restored.untyped_storage().nbytes() == base.untyped_storage().nbytes()


def test_parameters_inputs_and_small_tensors_stay_on_the_device() -> None:
    weight = torch.nn.Parameter(torch.randn(256, 256))
    resident = Resident()
    resident.reset([weight])
    copies = HostCopies(resident)
    assert pack(weight, copies) is weight
    assert isinstance(pack(weight.t(), copies), torch.Tensor)  # a view of a parameter's storage
    small = torch.randn(MIN_OFFLOAD_BYTES // 4 - 1)
    assert pack(small, copies) is small
    assert not isinstance(pack(torch.randn(MIN_OFFLOAD_BYTES // 4), copies), torch.Tensor)


def test_a_storage_saved_twice_is_copied_once_unless_it_was_written_between() -> None:
    copies = HostCopies(Resident())
    x = torch.randn(64, 1024)
    original = x.clone()
    first, again = pack(x, copies), pack(x[1:], copies)
    assert first.host is again.host  # type: ignore[union-attr]
    x.add_(1)
    after_write = pack(x, copies)
    assert after_write.host is not first.host  # type: ignore[union-attr]
    assert torch.equal(unpack(after_write), x) and torch.equal(unpack(first), original)


def _lowest(model, case, host_tier: str) -> int:
    with pytest.raises(InfeasibleBudgetError) as error:
        rematerialize(model, *case.args, memory_budget=1, host_tier=host_tier, **case.kwargs)
    return error.value.minimum_budget_bytes


def _seeded(case):
    """The case's step from one RNG state (DiT drops class labels at random while training)."""

    def step() -> None:
        torch.manual_seed(0)
        case.step()

    return step


def _reference_grads(case) -> dict[str, torch.Tensor]:
    """Plain autograd's gradients of the case's seeded step (the model left without any)."""
    _seeded(case)()
    reference = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return reference


def _assert_the_step_keeps_the_plans_word(case, shape_plan, reference: dict[str, torch.Tensor]) -> None:
    """The planned step's exact device peak within the budget and 5% of the prediction, and
    plain autograd's gradients."""
    measured = _measured(case.model, _seeded(case))
    assert measured <= shape_plan.budget_bytes, (measured, shape_plan.budget_bytes)
    assert abs(measured / shape_plan.predicted_peak_bytes - 1) <= TOLERANCE, (measured, shape_plan.predicted_peak_bytes)
    grads = {n: p.grad for n, p in case.model.named_parameters() if p.grad is not None}
    assert max_relative_difference(grads, reference) <= 1e-6


@pytest.mark.parametrize("name", ["unet2d", "dit", "flux", "sdxl_unet", "sd3"])
def test_plans_with_the_host_tier_go_below_what_recomputation_reaches_and_keep_their_word(name: str) -> None:
    """At the lowest budget the planner names with the host tier (below the lowest without it):
    the step stays within the budget and within 5% of its prediction, with plain autograd's
    gradients; something is offloaded and the host bytes are reported."""
    case = ZOO[name].case(batch=8)
    model = case.model
    reference = _reference_grads(case)
    without = _lowest(model, case, "off")
    with_host = _lowest(model, case, "on")
    assert with_host < without, (with_host, without)
    plan = rematerialize(model, *case.args, memory_budget=with_host, host_tier="on", **case.kwargs)
    try:
        shape_plan = plan.current
        assert Option.OFFLOAD in shape_plan.options.values()
        assert shape_plan.planned.host_peak_bytes > 0
        assert "host tier:" in plan.report()
        host_use.reset_peak()
        before = host_use.live  # what earlier tests' optimizers keep there (their state on the host)
        _assert_the_step_keeps_the_plans_word(case, shape_plan, reference)
        assert host_use.live == before  # every host copy went with the step's graph
        assert abs((host_use.peak - before) / shape_plan.planned.host_peak_bytes - 1) <= TOLERANCE
    finally:
        plan.remove()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_held_out_architectures_keep_the_plans_word_with_the_host_tier(name: str) -> None:
    """Architectures the host tier was not built on, at half their naive peak with it on (or the
    lowest budget it names where half is out of reach)."""
    case = HELD_OUT[name].case(batch=4)
    model = case.model
    reference = _reference_grads(case)
    try:
        plan = rematerialize(model, *case.args, memory_budget=0.5, host_tier="on", **case.kwargs)
    except InfeasibleBudgetError as error:
        plan = rematerialize(model, *case.args, memory_budget=error.minimum_budget_bytes, host_tier="on", **case.kwargs)
    try:
        _assert_the_step_keeps_the_plans_word(case, plan.current, reference)
    finally:
        plan.remove()


def test_the_host_tier_is_refused_by_name_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="host_tier must be"):
        TinyBackpropStrategy(host_tier="yes")  # type: ignore[arg-type]
    TinyBackpropStrategy(host_tier="on", dp="ghost", noise_multiplier=1.0)  # streams only (test_dp_host_tier.py)
    with pytest.raises(ValueError, match="host_tier is not available with tiny_backprop_fsdp "):
        TinyBackpropFSDPStrategy(host_tier="on")
    TinyBackpropFSDP2Strategy(host_tier="on")  # activations offloaded per rank (test_multi_device.py)
    with pytest.raises(ValueError, match=r"optimizer_state_on_host=True .* cannot run with tiny_backprop_fsdp2"):
        TinyBackpropFSDP2Strategy(host_tier="on", optimizer_state_on_host=True)
    case = ZOO["dit"].case(batch=2)
    with pytest.raises(ValueError, match="host_tier must be"):
        rematerialize(case.model, *case.args, memory_budget=0.5, host_tier="yes", **case.kwargs)  # type: ignore[arg-type]


def test_auto_takes_the_host_tier_only_where_the_device_alone_cannot_meet_the_budget() -> None:
    case = ZOO["flux"].case(batch=8)
    model = case.model
    without, with_host = _lowest(model, case, "off"), _lowest(model, case, "on")
    with pytest.raises(InfeasibleBudgetError, match="with the host tier") as error:
        rematerialize(model, *case.args, memory_budget=1, host_tier="auto", **case.kwargs)
    assert error.value.minimum_budget_bytes == with_host
    roomy = rematerialize(model, *case.args, memory_budget=without, host_tier="auto", **case.kwargs)
    try:
        assert Option.OFFLOAD not in roomy.current.options.values() and "host tier" not in roomy.report()
    finally:
        roomy.remove()
    tight = rematerialize(model, *case.args, memory_budget=(with_host + without) // 2, host_tier="auto", **case.kwargs)
    try:
        assert Option.OFFLOAD in tight.current.options.values()
        assert "the host tier (host_tier='auto')" in tight.report()
        assert "stream" not in tight.report()  # a full fine-tune has no frozen weights to stream
    finally:
        tight.remove()


def test_a_plan_predicted_to_stall_the_step_is_refused_with_what_slows_it() -> None:
    """Below what recomputation reaches, the plan offloads; under the default limit (10x) it is
    taken, and a limit below its predicted slowdown refuses it by name, naming the parts and the
    fixes, and leaves the module unplanned."""
    case = ZOO["flux"].case(batch=8)
    model = case.model
    without, with_host = _lowest(model, case, "off"), _lowest(model, case, "on")
    budget = (with_host + without) // 2
    plan = rematerialize(model, *case.args, memory_budget=budget, host_tier="on", **case.kwargs)
    try:
        shape_plan = plan.current
        slowdown = shape_plan.planned_step_ns / shape_plan.step_ns
        assert Option.OFFLOAD in shape_plan.options.values() and 1 < slowdown <= plan.max_slowdown == 10
    finally:
        plan.remove()
    with pytest.raises(StallingPlanError, match=r"max_slowdown=1\b") as refused:
        rematerialize(model, *case.args, memory_budget=budget, host_tier="on", max_slowdown=1.0, **case.kwargs)
    assert refused.value.slowdown > 1 and refused.value.parts["recomputation and host copies"] > 0
    assert "larger budget" in str(refused.value) and "None: no limit" in str(refused.value)
    assert not model._forward_pre_hooks  # nothing left installed
    with pytest.raises(ValueError, match="max_slowdown must be a factor >= 1"):
        rematerialize(model, *case.args, memory_budget=budget, max_slowdown=0.5, **case.kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux", "sdxl_unet"])
def test_a_whole_fit_below_what_recomputation_reaches_holds_its_promise(name: str) -> None:
    """A Flux-style transformer and an SDXL-style U-Net, full fine-tunes with AdamW, trained by
    ``Trainer.fit`` with the host tier on, under a budget halfway between the lowest the planner
    reaches with it and without it: every metered step (the first three included) within the
    budget and 5% of its prediction, and the whole fit's exact peak too."""
    module = ZooModule(name, batch=8)
    rows = [row.repeat_interleave(2, 0) for row in module.rows]
    loader = DataLoader(TensorDataset(*rows), batch_size=8)

    def strategy(budget: float, host_tier: str) -> TinyBackpropStrategy:
        return TinyBackpropStrategy(memory_budget=budget, host_tier=host_tier, optimizer_in_backward=False)

    def lowest(host_tier: str) -> float:  # as a fraction of the step's naive peak
        with pytest.raises(InfeasibleBudgetError) as error:
            _fit(ZooModule(name, batch=8), loader, strategy(1e-6, host_tier), max_steps=1)
        return error.value.minimum_step_bytes / error.value.naive_bytes

    without, with_host = lowest("off"), lowest("on")
    assert with_host < without
    run = _fit(module, loader, strategy((with_host + without) / 2, "on"), max_steps=4)
    assert Option.OFFLOAD in run["plan"].options.values()
    _assert_the_promise_holds(run)


def test_plans_keep_within_the_host_budget_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host budget below what the lowest unbounded plan keeps there: the plan it names holds
    within it (measured), and its lowest device budget is no lower than the unbounded one.

    Offloading is priced free here, so that both plans offload whatever recomputation the op
    timings of a loaded machine would otherwise steer them to (it once failed under ``-n 2``):
    what is checked is the host budget, not the choice."""
    free = dataclasses.replace(step_overheads(torch.device("cpu")), offload_ns_per_byte=0.0, offload_save_ns=0.0)
    monkeypatch.setitem(overheads._MEASURED, "cpu", free)
    case = ZOO["flux"].case(batch=8)
    model = case.model
    unbounded = rematerialize(model, *case.args, memory_budget=0.4, host_tier="on", **case.kwargs)
    host_peak = unbounded.current.planned.host_peak_bytes
    unbounded.remove()
    assert host_peak > 0
    host_budget = host_peak // 3
    plan = rematerialize(
        model, *case.args, memory_budget=0.4, host_tier="on", host_budget_bytes=host_budget, **case.kwargs
    )
    try:
        assert 0 < plan.current.planned.host_peak_bytes <= host_budget
        assert f"host budget {format_bytes(host_budget)}" in plan.report()
        host_use.reset_peak()
        before = host_use.live
        _measured(model, _seeded(case))
        assert host_use.peak - before <= host_budget
    finally:
        plan.remove()
    with pytest.raises(ValueError, match="host_budget must be"):
        TinyBackpropStrategy(host_budget=-1)


def test_a_device_budget_below_what_training_holds_is_refused_with_what_the_device_and_host_need() -> None:
    module = ZooModule("flux", batch=8)
    loader = DataLoader(TensorDataset(*module.rows), batch_size=8)
    with pytest.raises(InfeasibleBudgetError, match="none left for the step") as error:
        _fit(module, loader, TinyBackpropStrategy(memory_budget=1 << 20), max_steps=1)
    notes = "\n".join(error.value.__notes__)
    assert "short)" in notes and "or more fits" in notes  # what the device must hold, as a device budget
    assert "with the host tier" in notes and "on the host tier" in str(error.value)  # and what the host would
