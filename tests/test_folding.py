"""An unrolled chain folded to four calls (``folding.py``) simulates as the whole chain under any
plan that gives the left-out calls the second call's options, and the solver's search on it finds
the whole search's plan; chains that do not repeat exactly are not folded."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import Unrolled, chain_trace, tiny_dit, tiny_unet
from torch import nn

from lightning_tbp.remat.folding import fold_chain
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.pricing import price_by_flops
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import InfeasibleBudgetError, Solver
from lightning_tbp.remat.trace import Trace


def _dit_chain_trace(calls: int) -> Trace:
    torch.manual_seed(0)
    model = Unrolled(tiny_dit(dropout=0.1), calls=calls, class_labels=torch.tensor([1, 3]))
    trace = record_trace(model, (torch.randn(2, 4, 8, 8), torch.tensor([5, 7])), {}, measure=False)
    price_by_flops(trace)
    return trace


@pytest.fixture(scope="module")
def chains() -> dict[str, Trace]:
    return {"unet": chain_trace(7), "dit": _dit_chain_trace(6)}


@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["unet", "dit"]), seed=st.integers(0, 2**16), moves=st.integers(0, 40))
def test_a_folded_chain_simulates_as_the_whole_chain_under_any_plan(
    chains: dict[str, Trace], name: str, seed: int, moves: int
) -> None:
    """Legal plans drawn on the folded trace (full, selective, lazy, offloaded and nested blocks;
    the last calls planned apart from the first two), the left-out calls given the second call's
    options: the same peak, device and host, the same recomputation, to the byte and the FLOP."""
    trace = chains[name]
    folded = fold_chain(trace)
    assert folded is not None and folded.fold.omitted >= 1
    moved = Solver(Simulator(folded.trace), offload=True, tie_repeats=False)
    moved._pinned = folded.pinned
    rng = random.Random(seed)
    options = [Option.KEEP] * len(folded.trace.nodes)
    for _ in range(moves):
        legal = moved.legal_moves(options)
        if not legal:
            break
        options = moved.apply(options, *rng.choice(legal))
    whole = Simulator(trace).run([options[i] for i in folded.node_of])
    part = Simulator(folded.trace, fold=folded.fold).run(options)
    assert (part.peak_bytes, part.host_peak_bytes, part.forward_end_bytes, part.recompute_flops) == (
        whole.peak_bytes,
        whole.host_peak_bytes,
        whole.forward_end_bytes,
        whole.recompute_flops,
    )
    assert part.recompute_cost == pytest.approx(whole.recompute_cost, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("fraction", [0.3, 0.0])
def test_the_search_on_the_folded_chain_finds_the_whole_searchs_plan(fraction: float) -> None:
    """Eight calls of a U-Net at 0.3 of naive, and at a budget no plan meets: the folded search
    takes the whole search's path (each move's estimate weighs the second call's blocks for the
    calls they stand for), to the same plan, or to the same minimum named."""
    trace = chain_trace(8)
    folding, whole = Solver(Simulator(trace)), Solver(Simulator(trace), fold_chains=False)
    assert folding.folded_solver is not None
    budget = int(whole.naive().peak_bytes * fraction)
    if fraction == 0.0:
        with pytest.raises(InfeasibleBudgetError) as folded_error:
            folding.solve(budget)
        with pytest.raises(InfeasibleBudgetError) as whole_error:
            whole.solve(budget)
        assert folded_error.value.minimum_budget_bytes == whole_error.value.minimum_budget_bytes
        return
    folded, searched = folding.solve(budget), whole.solve(budget)
    assert folded.options == searched.options
    assert folded.result.peak_bytes == searched.result.peak_bytes
    assert folded.result.recompute_cost == searched.result.recompute_cost  # both the whole step's simulation


class _Kept(nn.Module):
    """A chain whose loss reads every call's result: the left-out calls' results live to the end."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.denoiser, self.calls = tiny_unet(), calls

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        kept = []
        for i in range(self.calls):
            x = x - 0.1 * self.denoiser(x, t - i).sample
            kept.append(x)
        return torch.stack(kept)


class _Growing(nn.Module):
    """A chain whose calls run at a growing size: no two calls alike."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.denoiser, self.calls = tiny_unet(), calls

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for i in range(self.calls):
            size = 16 + 8 * (i % 3)
            total = total + self.denoiser(x[..., :size, :size], t - i).sample.mean()
        return total


@pytest.mark.parametrize("case", ["kept", "growing", "four_calls"])
def test_a_chain_that_does_not_repeat_exactly_is_not_folded(case: str) -> None:
    torch.manual_seed(0)
    model = {"kept": _Kept(6), "growing": _Growing(6), "four_calls": Unrolled(tiny_unet(), calls=4)}[case]
    trace = record_trace(model, (torch.randn(2, 3, 32, 32), torch.tensor([500, 700])), {}, measure=False)
    assert fold_chain(trace) is None


@pytest.mark.parametrize("family", ["unet2d", "dit"])
def test_a_reward_fine_tunes_ddim_chain_folds(family: str) -> None:
    """Eight DDIM steps of the reward recipe's denoiser, the reward model after them: the
    scheduler's last step runs other ops, and the fold keeps that call whole."""
    from test_loop_truth import CHAIN_DIT, MAIN_JOB_UNET

    from lightning_tbp.diffusion.reward import ConvReward, RewardFineTuneModule

    torch.manual_seed(0)
    config = MAIN_JOB_UNET if family == "unet2d" else CHAIN_DIT
    module = RewardFineTuneModule(
        ConvReward(channels=config["in_channels"]), family=family, model_config=config, sampling_steps=8, lora_rank=4
    )
    conditioning = {"labels": torch.randint(0, 10, (4,))} if family == "dit" else {}
    trace = record_trace(module.scored, (torch.randn(module.sample_shape(4)), conditioning), {}, measure=False)
    folded = fold_chain(trace)
    assert folded is not None and folded.fold.omitted == 3  # the first step stays apart; 7 - 4 left out
