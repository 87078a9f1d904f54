"""Bookkeeping with a plan: fully checkpointed blocks are replayed after the backward.

The book keeps a replayed block's inputs and output gradient instead of every layer's operands
inside it, and after the norms are known the block runs again, forward and backward, from its
output gradient scaled per sample by the clipping coefficients (``remat/replay.py``). These
tests check that the clipped sums stay exact (against the vmap reference, with dropout and under
autocast against the unplanned step), that only blocks no other planned block encloses are
replayed, that the replay is what lowers the measured peak, and that the planner's simulation of
the replayed step matches the allocator.
"""

from __future__ import annotations

import gc

import pytest
import torch
from dp_reference import clipped_at_median, per_sample_grads
from torch import nn

from lightning_tbp.memory import measure_peak
from lightning_tbp.privacy import attach
from lightning_tbp.remat import Option, record_trace, rematerialize
from lightning_tbp.remat.apply import InstalledWrappers
from lightning_tbp.remat.replay import CheckpointedCall, register_checkpoint_recorder


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    """A token stack: ``inner`` blocks sit inside ``outer`` (to nest checkpoints), a learned
    position table is a tracked use (no layer handler), and the head sits outside every block."""

    def __init__(self, width: int = 16, dropout: float = 0.0, tokens: int = 8) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(tokens, width) * 0.1)
        self.blocks = nn.ModuleList([Block(width, dropout) for _ in range(3)])
        self.outer = nn.Sequential(Block(width, dropout), Block(width, dropout))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.outer(x))


def per_sample_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).square().mean(dim=(1, 2))


def make_case(dropout: float = 0.0, batch: int = 6):
    torch.manual_seed(0)
    model = Stack(dropout=dropout)
    data = {"x": torch.randn(batch, 8, 16), "y": torch.randn(batch, 8, 2)}
    return model, data


#: blocks.0 and blocks.2 are replayed; outer is replayed whole (its inner checkpoint is not).
FULL_BLOCKS = ("blocks.0", "blocks.2", "outer", "outer.1")


def checkpointed(model: nn.Module, paths=FULL_BLOCKS) -> InstalledWrappers:
    wrappers = InstalledWrappers(model, dict.fromkeys(paths, Option.FULL), {})
    wrappers.ensure(paths)
    return wrappers


@pytest.fixture
def reruns(monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """The outputs of every replay, in order."""
    seen: list[list[torch.Tensor]] = []
    original = CheckpointedCall.rerun

    def rerun(self: CheckpointedCall) -> list[torch.Tensor]:
        outputs = original(self)
        seen.append([t.detach().clone() for t in outputs])
        return outputs

    monkeypatch.setattr(CheckpointedCall, "rerun", rerun)
    return seen


def test_replayed_blocks_give_the_vmap_clipped_sum(reruns) -> None:
    model, data = make_case()
    grads = per_sample_grads(model, lambda call, b: per_sample_loss(call, b), data)
    expected, norms, threshold = clipped_at_median(grads)
    wrappers = checkpointed(model)
    engine = attach(model, mode="bookkeeping", max_grad_norm=threshold, noise_multiplier=0.0)
    try:
        for step in range(2):  # the first step probes independence (the output gradients too)
            reruns.clear()
            model.zero_grad(set_to_none=True)
            engine.backward(per_sample_loss(model, data))
            assert len(reruns) == 3, step  # blocks.0, blocks.2, outer: not outer.1 inside outer
            torch.testing.assert_close(engine.per_sample_norms, norms, rtol=1e-5, atol=0)
            scale = max(float(g.abs().max()) for g in expected.values())
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
            assert engine.buffers.current_bytes < 1024  # norms and coefficients only: the replays released theirs
    finally:
        engine.detach()
        wrappers.remove()


def _clipped_step(model: nn.Module, data: dict, autocast: bool) -> dict[str, torch.Tensor]:
    engine = attach(model, mode="bookkeeping", max_grad_norm=0.05, noise_multiplier=0.0)
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = per_sample_loss(model, data)
        engine.backward(loss.float())
        assert bool((engine.clip_coefficients < 1).any())
        return {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
    finally:
        engine.detach()


def _planned_step(model: nn.Module, data: dict, paths: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``_clipped_step`` with the blocks at ``paths`` checkpointed in full (bookkeeping replays them)."""
    wrappers = checkpointed(model, paths)
    try:
        return _clipped_step(model, data, autocast=False)
    finally:
        wrappers.remove()


def _assert_same_sums(planned: dict, unplanned: dict, tolerance: float = 1e-5) -> None:
    for name, grad in unplanned.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(planned[name], grad, rtol=tolerance, atol=tolerance * scale, msg=name)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_replay_runs_under_the_forwards_rng_and_autocast(autocast: bool, reruns) -> None:
    """With dropout and under bf16 autocast, each replay reproduces its block's forward output
    bit for bit (same masks, same precision), and the clipped sums equal the unplanned step's
    (up to the rounding of scaling the output gradient before, not after, the contraction)."""
    model, data = make_case(dropout=0.3)
    model.train()
    unplanned = _clipped_step(model, data, autocast)
    forward_outputs = []
    hooks = [
        model.get_submodule(path).register_forward_hook(lambda m, a, out: forward_outputs.append(out.detach().clone()))
        for path in ("blocks.0", "blocks.2", "outer")
    ]
    wrappers = checkpointed(model)
    try:
        planned = _clipped_step(model, data, autocast)
    finally:
        wrappers.remove()
        for hook in hooks:
            hook.remove()
    assert len(reruns) == 3
    for replayed, original in zip(reruns, reversed(forward_outputs), strict=True):  # replays run last block first
        assert torch.equal(replayed[0], original)
    _assert_same_sums(planned, unplanned, tolerance=2e-2 if autocast else 1e-5)


def _step_peak(model: nn.Module, data: dict, engine) -> int:
    def step() -> None:
        engine.probe_next_step()  # every measured step probes, as the first one does
        engine.backward(per_sample_loss(model, data))

    step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    return measure_peak(step).peak_bytes


def test_the_replay_is_what_lowers_the_peak_and_the_plan_predicts_it() -> None:
    """The same plan without replays (the book keeps every layer's operands) peaks higher; with
    them the measured peak is the simulated one (±5%) and within the budget."""
    torch.manual_seed(0)
    model = Stack(width=32, tokens=64)
    data = {"x": torch.randn(16, 64, 32), "y": torch.randn(16, 64, 2)}
    engine = attach(model, mode="bookkeeping", max_grad_norm=1.0, noise_multiplier=0.0)
    plan = None
    try:
        naive = _step_peak(model, data, engine)
        plan = rematerialize(model, data["x"], memory_budget=0.6)
        shape_plan = plan.current
        assert Option.FULL in shape_plan.options.values()
        replayed = _step_peak(model, data, engine)
        register_checkpoint_recorder(list(model.modules()), None)  # the same plan, booking every layer
        booked = _step_peak(model, data, engine)
    finally:
        if plan is not None:
            plan.remove()
        engine.detach()
    assert replayed <= shape_plan.budget_bytes < naive
    assert abs(replayed / shape_plan.predicted_peak_bytes - 1) <= 0.05, (replayed, shape_plan.predicted_peak_bytes)
    assert booked > 1.1 * replayed, (booked, replayed)


class Returns(nn.Module):
    """A block returning its hidden state twice (as diffusers' down blocks return their last
    state among their skips), or with a view of it."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.block = Block(16, 0.0)
        self.view = view

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        h = self.block(x)
        return h, (h[:, :4] if self.view else h,)


class SkipNet(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.down = Returns(view)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, (skip,) = self.down(x)
        return self.head(h) + self.head(skip).sum(dim=1, keepdim=True)


@pytest.mark.parametrize("view", [False, True])
def test_an_output_returned_twice_is_replayed_once_and_a_view_is_booked(view: bool, reruns) -> None:
    """The same tensor twice is one output (its hook sees the whole gradient); outputs sharing
    memory otherwise are not replayed (a hook's gradient may hold the other's), and the layers
    inside are booked as usual: the clipped sums are exact either way, and the simulator knows."""
    torch.manual_seed(0)
    model = SkipNet(view)
    data = {"x": torch.randn(6, 8, 16), "y": torch.randn(6, 8, 2)}
    unplanned = _clipped_step(model, data, autocast=False)
    planned = _planned_step(model, data, ("down",))
    assert len(reruns) == (0 if view else 1)
    _assert_same_sums(planned, unplanned)
    engine = attach(model, mode="bookkeeping", max_grad_norm=1.0, noise_multiplier=0.0)
    try:
        trace = record_trace(model, (data["x"],), {})
    finally:
        engine.detach()
    assert next(node for node in trace.nodes if node.path == "down").replayable is not view


class DownStage(nn.Module):
    """Two blocks returning both states, as a U-Net's down stage returns its skips: the first
    state is an output *and* the second block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(16, 0.0), Block(16, 0.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h0 = self.first(x)
        h1 = self.second(h0)
        return h1, (h0, h1)


class DownUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = DownStage()
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, (skip0, skip1) = self.down(x)
        return self.head(h + skip0 * 0.5 + skip1 * 0.25)


def test_an_output_the_block_also_reads_is_replayed_with_the_outside_gradient_only(reruns) -> None:
    """A skip state feeds the stage's next block too. Its hook once sat on the tensor itself and
    took the gradient from inside the stage as well, which the replay's backward then added
    again: every clipped sum of the layers before the last skip was wrong (diffusers' U-Net down
    blocks under bookkeeping with a plan), the norms right. The hook now sits on an alias that
    only the caller reads."""
    torch.manual_seed(0)
    model = DownUp()
    data = {"x": torch.randn(6, 8, 16), "y": torch.randn(6, 8, 2)}
    unplanned = _clipped_step(model, data, autocast=False)
    planned = _planned_step(model, data, ("down",))
    assert len(reruns) == 1
    _assert_same_sums(planned, unplanned)


def test_a_frozen_block_stays_a_plain_checkpoint(reruns) -> None:
    """A block without a clipped parameter has nothing to replay: it is not recorded (no second
    forward, no inputs and output gradient kept to the end of the backward), the trace tells the
    simulator so, and the clipped sums are still the unplanned step's."""
    model, data = make_case()
    model.blocks[0].requires_grad_(False)
    engine = attach(model, mode="bookkeeping", max_grad_norm=1.0, noise_multiplier=0.0)
    try:
        trace = record_trace(model, (data["x"],), {})
    finally:
        engine.detach()
    unplanned = _clipped_step(model, data, autocast=False)
    planned = _planned_step(model, data, FULL_BLOCKS)
    assert len(reruns) == 2  # blocks.2 and outer; not the frozen blocks.0
    replayable = {node.path: node.replayable for node in trace.nodes[1:]}
    assert not replayable["blocks.0"] and replayable["blocks.2"] and replayable["outer"]
    assert "blocks.0.up.weight" not in planned
    _assert_same_sums(planned, unplanned)


def test_an_input_written_in_place_before_its_replay_stops_the_step() -> None:
    """The replay runs a block again from its inputs; one written in place after the block's
    backward (here by a gradient hook) would give other values, so the step stops and says which."""
    model, data = make_case()
    wrappers = checkpointed(model, ("blocks.1",))
    engine = attach(model, mode="bookkeeping", max_grad_norm=1.0, noise_multiplier=0.0)
    inputs: list[torch.Tensor] = []
    hook = model.blocks[1].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    try:
        engine.backward(per_sample_loss(model, data))  # the first step probes (a retained pass)
        inputs.clear()
        loss = per_sample_loss(model, data)

        def write(grad: torch.Tensor) -> None:
            with torch.no_grad():
                inputs[0].mul_(2)

        inputs[0].register_hook(write)  # runs once the block's backward has made its input's gradient
        with pytest.raises(RuntimeError, match=r"argument 0 of checkpointed block 'blocks\.1' was modified in place"):
            engine.backward(loss)
    finally:
        hook.remove()
        engine.detach()
        wrappers.remove()
