"""LoRA on a quantized frozen base (torchao int8 weight-only and NF4): the base takes the bytes it
really holds, the plan traces, recomputes and differentiates its layers exactly (gradients equal
plain autograd's of the quantized model), and its prediction holds on the zoo and held-out
architectures."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.diffusion import DiffusionModule
from lightning_tbp.diffusion.lora import LoraOptions, add_lora
from lightning_tbp.diffusion.quantized_base import quantize_base
from lightning_tbp.memory import measure_peak
from lightning_tbp.memory.breakdown import tensor_bytes
from lightning_tbp.remat.options import Option
from lightning_tbp.testing.zoo_models import HELD_OUT, ZOO, Architecture

pytest.importorskip("torchao")

ADAPTED = ("to_q", "to_k", "to_v", "to_out.0")
CPU = torch.device("cpu")


def _quantized_lora(architecture: Architecture, kind: str) -> tuple[nn.Module, tuple, dict]:
    """The architecture's model with a quantized base and rank-4 adapters (their B not zero, so
    every adapter gets a gradient), and its seeded inputs."""
    case = architecture.case(batch=2)
    quantize_base(case.model, kind)
    add_lora(case.model, LoraOptions(4, target_modules=ADAPTED))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in case.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return case.model, case.args, case.kwargs


def _loss(model: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    from lightning_tbp.testing.zoo_models import sample

    torch.manual_seed(11)  # dropout and any sampling inside the model draw the same numbers
    return sample(model(*args, **kwargs)).float().square().mean()


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_base_holds_its_quantized_bytes_and_only_adapters_train(kind: str) -> None:
    model = ZOO["flux"].build()
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is nn.Linear)
    before = tensor_bytes(model, [], CPU).parameters
    quantized = quantize_base(model, kind)
    after = tensor_bytes(model, [], CPU).parameters
    assert (quantized.bytes_before, quantized.bytes_after) == (before, after)
    # int8 keeps a byte and a scale per row, NF4 half a byte and its double-quantized scales
    ratio = {"int8": 0.27, "nf4": 0.16}[kind]
    assert before - after >= (1 - ratio) * linear_bytes * (
        quantized.layers / (quantized.layers + len(quantized.skipped))
    )
    add_lora(model, LoraOptions(4, target_modules=ADAPTED))
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("name", ["dit", pytest.param("sdxl_unet", marks=pytest.mark.slow), "flux", "sd3"])
@pytest.mark.parametrize("where", ["half", "lowest"])
def test_plans_over_a_quantized_base_are_exact_and_keep_their_word(kind: str, name: str, where: str) -> None:
    """Gradients under the plan equal plain autograd's of the same quantized model; the metered
    step stays under its budget and within 5% of its prediction (the dequantization inside each
    quantized matmul is that op's workspace)."""
    model, args, kwargs = _quantized_lora(ZOO[name], kind)
    _loss(model, args, kwargs).backward()
    reference = _gradients(model)
    model.zero_grad(set_to_none=True)
    budget: float | int = 0.5
    if where == "lowest":
        with pytest.raises(InfeasibleBudgetError) as error:
            rematerialize(model, *args, memory_budget=1, **kwargs)
        budget = error.value.minimum_budget_bytes
    try:
        plan = rematerialize(model, *args, memory_budget=budget, **kwargs)
    except InfeasibleBudgetError:
        pytest.skip(f"{name} with a {kind} base cannot reach half of its naive peak at this size")
    try:
        _loss(model, args, kwargs).backward()  # warm-up, and the gradients under the plan
        planned = _gradients(model)
        assert planned.keys() == reference.keys() and reference
        for key, value in reference.items():
            torch.testing.assert_close(planned[key], value, rtol=1e-5, atol=1e-7, msg=key)
        model.zero_grad(set_to_none=True)
        gc.collect()
        measured = measure_peak(lambda: _loss(model, args, kwargs).backward()).peak_bytes
        shape_plan = plan.current
        assert shape_plan is not None and shape_plan.options
        assert measured <= shape_plan.budget_bytes, (measured, shape_plan.budget_bytes)
        assert abs(measured / shape_plan.predicted_peak_bytes - 1) <= 0.05, (measured, shape_plan.predicted_peak_bytes)
    finally:
        plan.remove()


@pytest.mark.slow
@pytest.mark.usefixtures("flop_priced_plans")
@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("name", ["auraflow", "qwen_image", "wan"])
def test_held_out_architectures_over_a_quantized_base(kind: str, name: str) -> None:
    """Architectures nothing here was tuned on, at half the naive peak (or the lowest budget).
    Priced by FLOPs, so that a failure replays with its plan."""
    model, args, kwargs = _quantized_lora(HELD_OUT[name], kind)
    _loss(model, args, kwargs).backward()
    reference = _gradients(model)
    model.zero_grad(set_to_none=True)
    try:
        plan = rematerialize(model, *args, memory_budget=0.5, **kwargs)
    except InfeasibleBudgetError as error:
        plan = rematerialize(model, *args, memory_budget=error.minimum_budget_bytes, **kwargs)
    try:
        _loss(model, args, kwargs).backward()
        for key, value in reference.items():
            torch.testing.assert_close(model.get_parameter(key).grad, value, rtol=1e-5, atol=1e-7, msg=key)
        model.zero_grad(set_to_none=True)
        gc.collect()
        measured = measure_peak(lambda: _loss(model, args, kwargs).backward()).peak_bytes
        shape_plan = plan.current
        assert shape_plan is not None
        assert measured <= shape_plan.budget_bytes
        assert abs(measured / shape_plan.predicted_peak_bytes - 1) <= 0.05, (measured, shape_plan.predicted_peak_bytes)
    finally:
        plan.remove()


class _BlockEndingInAQuantizedLayer(nn.Module):
    """A block whose last layer is frozen and quantized, with no adapter: the last tensor it
    saves is that layer's weight, packed by its autograd Function after its ops ran."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


@pytest.mark.usefixtures("flop_priced_plans")
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_recomputation_runs_on_to_a_quantized_weight_the_block_saves_last(kind: str) -> None:
    """torch stops a checkpoint's recomputation early only once every tensor the block saved is
    back, its quantized weights' packs included: the recomputation runs through the block's
    last layer (its dequantization and outputs), and the plan predicts the step that does (at
    the lowest budget, an NF4 plan that stopped short measured over its budget)."""
    torch.manual_seed(0)
    # a narrow head: the loss, which the plan only estimates, stays small beside the step
    model = nn.Sequential(*(_BlockEndingInAQuantizedLayer() for _ in range(4)), nn.Linear(64, 4))
    quantize_base(model, kind)
    add_lora(model, LoraOptions(4, target_modules=("up",)))
    x = torch.randn(4, 32, 64)
    with pytest.raises(InfeasibleBudgetError) as error:
        rematerialize(model, x, memory_budget=1)
    plan = rematerialize(model, x, memory_budget=error.value.minimum_budget_bytes)
    try:
        shape_plan = plan.current
        assert shape_plan is not None and Option.FULL in shape_plan.options.values()
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        gc.collect()
        measured = measure_peak(lambda: model(x).square().mean().backward()).peak_bytes
        assert measured <= shape_plan.budget_bytes
        assert abs(measured / shape_plan.predicted_peak_bytes - 1) <= 0.05, (measured, shape_plan.predicted_peak_bytes)
    finally:
        plan.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_base_keeps_no_dequantized_copy_for_the_backward(dtype: torch.dtype) -> None:
    """torchao's own int8 linear keeps a dequantized copy of its weight for the backward; the
    base's layers save the int8 weight instead, with the input's gradient equal to torchao's
    within float rounding (float32), or both within bfloat16's rounding of the exact product."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    ours, theirs = nn.Linear(512, 256, dtype=dtype), nn.Linear(512, 256, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    for layer in (ours, theirs):
        layer.requires_grad_(False)
    quantize_base(ours, "int8")
    quantize_(theirs, Int8WeightOnlyConfig())
    x = torch.randn(8, 512, dtype=dtype, requires_grad=True)
    held = {}
    for name, layer in (("ours", ours), ("theirs", theirs)):
        gc.collect()
        reading = measure_peak(lambda layer=layer, name=name: held.setdefault(name, layer(x)))
        held[name + "_bytes"] = reading.net_bytes
    output_bytes = 8 * 256 * x.element_size()
    assert held["ours_bytes"] == output_bytes
    assert held["theirs_bytes"] >= output_bytes + 512 * 256 * x.element_size()  # the dequantized copy
    torch.testing.assert_close(held["ours"], held["theirs"], rtol=0, atol=0)
    grad = torch.randn_like(held["ours"])
    (ours_grad,) = torch.autograd.grad(held["ours"], x, grad)
    (theirs_grad,) = torch.autograd.grad(held["theirs"], x, grad)
    if dtype == torch.float32:
        torch.testing.assert_close(ours_grad, theirs_grad)
    else:  # both round to bfloat16 by different paths: each within its rounding of the exact product
        exact = grad.float() @ ours.weight.dequantize().float()
        rounding = 2**-7 * exact.abs().max().item()
        for computed in (ours_grad, theirs_grad):
            torch.testing.assert_close(computed.float(), exact, rtol=0, atol=rounding)


def test_the_recipe_refuses_what_it_cannot_do_by_name() -> None:
    config = {"sample_size": 8, "in_channels": 1, "out_channels": 1, "block_out_channels": [8], "norm_num_groups": 4}
    config |= {"layers_per_block": 1, "down_block_types": ["AttnDownBlock2D"], "up_block_types": ["AttnUpBlock2D"]}
    with pytest.raises(ValueError, match="needs lora_rank"):
        DiffusionModule(model_config=config, base_quantization="int8")
    averaged = DiffusionModule(model_config=config, base_quantization="int8", lora_rank=2, ema_decay=0.9)
    assert averaged.ema is not None  # of the adapters alone (test_lora.py): no copy of the quantized base
    with pytest.raises(ValueError, match="must be one of int8, nf4"):
        quantize_base(nn.Sequential(nn.Linear(64, 64)), "int4")
    module = DiffusionModule(model_config=config, base_quantization="nf4", lora_rank=2, sample_images=0)
    assert any(type(p).__name__ == "NF4Tensor" for p in module.model.parameters())
