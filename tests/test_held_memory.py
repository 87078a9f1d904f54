"""A strategy's byte budget is the device's total: parameters and optimizer state come off first."""

import pytest
import torch
from test_strategy import fit
from torch import nn

from lightning_tbp import InfeasibleBudgetError, TinyBackpropStrategy
from lightning_tbp.memory.breakdown import tensor_bytes
from lightning_tbp.memory.held import held_memory, state_bytes_of_a_step


@pytest.mark.parametrize(
    ("make", "copies"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
        (lambda p: torch.optim.Adam(p), 2),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), 3),  # AdamW's defaults hold a key __init__ refuses
        (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3),
    ],
)
def test_state_comes_from_a_real_step_of_a_twin(make, copies) -> None:
    optimizer = make([nn.Parameter(torch.zeros(3))])
    assert state_bytes_of_a_step(optimizer, optimizer.param_groups[0], (5, 7), torch.float32) == copies * 5 * 7 * 4


def _low_bit(name: str):  # type: ignore[no-untyped-def]
    optim = pytest.importorskip("torchao.optim")
    return getattr(optim, name)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adafactor(p, lr=1e-2),  # factored: a row and a column per matrix
        lambda p: _low_bit("AdamW8bit")(p, lr=1e-3),  # 8-bit codes and a scale per block, for large tensors
        lambda p: _low_bit("AdamW4bit")(p, lr=1e-3),
    ],
)
def test_the_predicted_state_of_factored_and_low_bit_optimizers_is_what_their_first_step_makes(make) -> None:
    """Predicted per shape before the first step, within 2% of the bytes the real step then holds
    (the parameters are large enough for torchao to quantize them, and a bias too small to; a
    large one is probed scaled down, so its shared code book is counted more than once)."""
    net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128))
    optimizer = make(net.parameters())
    predicted = held_memory(net, [optimizer], torch.device("cpu")).optimizer_state_pending
    net(torch.randn(4, 256)).square().mean().backward()
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step: the same state, minutes sooner
        optimizer.step()
    made = tensor_bytes(net, [optimizer], "cpu").optimizer_state
    assert abs(predicted - made) <= 0.02 * made, (predicted, made)
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    assert made < param_bytes  # less than one full copy: neither factored nor low-bit state is counted as one


def test_predicted_optimizer_state_is_what_the_first_step_creates() -> None:
    net = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(net.parameters())
    before = held_memory(net, [optimizer], torch.device("cpu"))
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    assert before.parameters == param_bytes
    assert before.optimizer_state == before.optimizer_state_pending == 2 * param_bytes
    net(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    after = held_memory(net, [optimizer], torch.device("cpu"))
    assert after.optimizer_state_pending == 0
    step_counters = 8 * len(list(net.parameters()))  # one float scalar per parameter, at most 8 bytes
    assert 2 * param_bytes <= after.optimizer_state <= 2 * param_bytes + step_counters


def test_a_device_budget_holds_parameters_optimizer_state_and_the_step(data) -> None:
    """The plan gets the device budget less what is held; the measured step (with Adam's state
    by then real) fits in what is left, so the device total stays within the budget."""
    trainer, _, _ = fit("tiny_backprop", data, max_steps=1)
    naive = trainer.strategy.plan.current.naive.peak_bytes
    held = trainer.strategy.plan.current.held
    assert held.optimizer_state_pending == held.optimizer_state > 0  # planned before the first step
    budget = held.total + int(0.6 * naive)
    trainer, _, _ = fit(TinyBackpropStrategy(memory_budget=budget), data, max_steps=3)
    plan = trainer.strategy.plan
    shape_plan = plan.current
    assert shape_plan.budget_bytes == budget - shape_plan.held.total
    assert shape_plan.predicted_peak_bytes < naive  # the held bytes forced a real plan
    assert "device budget" in plan.report() and plan.to_dict()["held_bytes"]["parameters"] > 0
    now_held = trainer.strategy.held_memory()
    assert now_held.optimizer_state_pending == 0
    assert now_held.total + shape_plan.measured_peak_bytes <= budget


def test_a_device_budget_below_what_is_held_says_so(data) -> None:
    with pytest.raises(InfeasibleBudgetError, match="device's total") as caught:
        fit(TinyBackpropStrategy(memory_budget="4MiB"), data, max_steps=1)
    assert "optimizer state" in str(caught.value.__notes__)


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))
