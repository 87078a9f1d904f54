"""The DP engine against per-sample gradients from ``torch.func`` (vmap of grad), every mode.

Noise 0 and the clipping threshold at the median norm, so about half the samples are clipped:
every trainable parameter's gradient must equal ``Σ_i min(1, C/‖∇_i‖) ∇_i`` and the engine's
per-sample norms the reference norms (fp32, rtol 1e-5; the absolute tolerance is 1e-5 of the
largest gradient entry, for entries near 0 where both sides hold float32 rounding noise).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel, UNet2DConditionModel, UNet2DModel
from dp_reference import clipped_at_median, per_sample_grads
from torch import nn

from lightning_tbp.privacy import (
    BACKWARD_PASSES,
    MODES,
    CoverageError,
    PerSampleLossError,
    UnsupportedLayerError,
    attach,
)
from lightning_tbp.privacy.layers import outer
from lightning_tbp.remat import Option, Plan
from lightning_tbp.remat.apply import InstalledWrappers


class Toy(nn.Module):
    """Every supported layer kind: convs (padding modes, stride, groups, dilation, 1-D), norms with
    affine parameters, a Linear on a 4-D input, an Embedding, and attention from Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_reflect = nn.Conv2d(8, 8, 3, padding="same", padding_mode="reflect", dilation=1)
        self.conv_grouped = nn.Conv2d(8, 8, 3, stride=2, padding="valid", groups=2, dilation=1)
        self.conv_dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.lin4d = nn.Linear(3, 3)
        self.ln = nn.LayerNorm(8)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
        self.rms = nn.RMSNorm(8)
        self.conv1d = nn.Conv1d(8, 4, 2, stride=1, padding=1, padding_mode="circular")
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.conv(x) + self.emb(labels).sum(1)[:, :, None, None]
        h = self.conv_reflect(F.silu(self.gn(h)))
        h = self.conv_dilated(self.conv_grouped(h))  # [B, 8, 3, 3]
        t = self.ln(F.silu(self.lin4d(h)).flatten(2).transpose(1, 2))  # [B, 9, 8]
        attended = F.scaled_dot_product_attention(self.q(t)[:, None], self.k(t)[:, None], self.v(t)[:, None])
        t = self.rms(t + attended[:, 0])
        return self.out(self.conv1d(t.transpose(1, 2)).transpose(1, 2))


def toy_case(batch: int = 6):
    torch.manual_seed(0)
    model = Toy()
    labels = torch.randint(0, 10, (batch, 3))
    labels[0, 0] = 0  # a padding index
    data = {"x": torch.randn(batch, 3, 8, 8), "labels": labels, "y": torch.randn(batch, 10, 3)}

    def loss(call, b):
        return (call(b["x"], b["labels"]) - b["y"]).square().mean(dim=(1, 2))

    return model, data, loss, lambda b: ((b["x"], b["labels"]), {})


def unet_case(batch: int = 4):
    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=16,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4,
    )
    data = {
        "x": torch.randn(batch, 1, 16, 16),
        "t": torch.randint(0, 1000, (batch,)),
        "y": torch.randn(batch, 1, 16, 16),
    }

    def loss(call, b):
        return (call(b["x"], b["t"]).sample - b["y"]).square().mean(dim=(1, 2, 3))

    return model, data, loss, lambda b: ((b["x"], b["t"]), {})


def cond_unet_case(batch: int = 4):
    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=2,
        out_channels=2,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        norm_num_groups=4,
        attention_head_dim=4,
    )
    data = {
        "x": torch.randn(batch, 2, 8, 8),
        "t": torch.randint(0, 1000, (batch,)),
        "text": torch.randn(batch, 5, 8),
        "y": torch.randn(batch, 2, 8, 8),
    }

    def loss(call, b):
        return (call(b["x"], b["t"], encoder_hidden_states=b["text"]).sample - b["y"]).square().mean(dim=(1, 2, 3))

    return model, data, loss, lambda b: ((b["x"], b["t"]), {"encoder_hidden_states": b["text"]})


def dit_case(batch: int = 4):
    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=2,
        num_layers=2,
        patch_size=2,
        sample_size=8,
        num_embeds_ada_norm=10,
    ).eval()  # no label dropout: the reference and the engine must see the same labels
    data = {
        "x": torch.randn(batch, 2, 8, 8),
        "t": torch.randint(0, 1000, (batch,)),
        "labels": torch.randint(0, 10, (batch,)),
        "y": torch.randn(batch, 2, 8, 8),
    }

    def loss(call, b):
        return (call(b["x"], timestep=b["t"], class_labels=b["labels"]).sample - b["y"]).square().mean(dim=(1, 2, 3))

    return model, data, loss, lambda b: ((b["x"],), {"timestep": b["t"], "class_labels": b["labels"]})


class Shared(nn.Module):
    """One Linear applied twice in a forward: per-sample gradients must sum both uses before the norm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def shared_case(batch: int = 6):
    torch.manual_seed(0)
    data = {"x": torch.randn(batch, 3, 6), "y": torch.randn(batch, 3, 2)}

    def loss(call, b):
        return (call(b["x"]) - b["y"]).square().mean(dim=(1, 2))

    return Shared(), data, loss, lambda b: ((b["x"],), {})


CASES = {"shared": shared_case, "toy": toy_case, "unet": unet_case, "cond_unet": cond_unet_case, "dit": dit_case}
_REFERENCES: dict[str, tuple] = {}


def reference(name: str):
    """The model, its batch and loss, and the reference (clipped sum, norms, threshold), cached."""
    if name not in _REFERENCES:
        model, data, loss, call_args = CASES[name]()
        grads = per_sample_grads(model, loss, data)
        expected, norms, threshold = clipped_at_median(grads)
        _REFERENCES[name] = (model, data, loss, call_args, expected, norms, threshold)
    return _REFERENCES[name]


def assert_matches(model: nn.Module, expected: dict, norms: torch.Tensor, engine) -> None:
    torch.testing.assert_close(engine.per_sample_norms, norms, rtol=1e-5, atol=0)
    scale = max(float(g.abs().max()) for g in expected.values())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(
            param.grad, expected[name], rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def dp_step(name: str, mode: str, plan_budget: float | None = None):
    model, data, loss, call_args, expected, norms, threshold = reference(name)
    plan = None
    if plan_budget is not None:
        args, kwargs = call_args(data)
        plan = Plan(model, plan_budget, backward_passes=BACKWARD_PASSES[mode])
        with torch.enable_grad():
            plan.plan_for(args, kwargs)
    engine = attach(model, mode=mode, max_grad_norm=threshold, noise_multiplier=0.0)
    try:
        model.zero_grad(set_to_none=True)
        engine.backward(loss(model, data))
        assert_matches(model, expected, norms, engine)
        assert 0 < int((engine.clip_coefficients < 1).sum()) < len(norms)  # some clipped, some not
        if plan is not None:  # the plan really checkpoints something
            assert set(plan.current.options.values()) - {Option.KEEP}
    finally:
        engine.detach()
        if plan is not None:
            plan.remove()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_mode_equals_the_vmap_clipped_sum(name: str, mode: str) -> None:
    dp_step(name, mode)


@pytest.mark.usefixtures("flop_priced_plans")  # selective blocks win wherever a one-pass plan may use them
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["unet", "cond_unet", "dit"])
def test_every_mode_is_exact_with_the_rematerialization_plan(name: str, mode: str) -> None:
    # the tiny DiT's floor is higher: each of its many small checkpoints stashes a 5 KiB CPU RNG state
    dp_step(name, mode, plan_budget=0.85 if name == "dit" else 0.6)


def test_dp_plans_leave_selective_blocks_out_and_a_selective_block_fails_clearly() -> None:
    """Torch's selective checkpoint hands its cache to the first backward only; every DP mode
    backpropagates a graph more than once (ghost/flash's two passes, the first step's probe).
    Plans for them leave selective blocks out; a selective block met anyway stops the step with an
    error that says what to do."""
    model, data, loss, call_args, *_ = reference("unet")
    args, kwargs = call_args(data)
    for mode in MODES:
        plan = Plan(model, 0.6, backward_passes=BACKWARD_PASSES[mode])
        with torch.enable_grad():
            plan.plan_for(args, kwargs)
        assert Option.SELECTIVE not in set(plan.current.options.values()) and plan.current.options
        plan.remove()
    wrappers = InstalledWrappers(model, {"mid_block.resnets.0": Option.SELECTIVE}, {"mid_block.resnets.0": 99})
    wrappers.ensure(["mid_block.resnets.0"])
    engine = attach(model, mode="ghost", max_grad_norm=1.0, noise_multiplier=0.0)
    try:
        with pytest.raises(RuntimeError, match=rf"backward_passes={BACKWARD_PASSES['ghost']}"):
            engine.backward(loss(model, data))
    finally:
        engine.detach()
        wrappers.remove()
    with pytest.raises(ValueError, match="backward_passes"):
        Plan(model, 0.6, backward_passes=0)


def test_norm_methods_agree_and_the_cost_rule_picks_per_layer() -> None:
    torch.manual_seed(0)
    a, g = torch.randn(3, 2, 5, 7), torch.randn(3, 2, 5, 4)
    materialised = outer.weight_norm_sq(a, g, "materialise")
    torch.testing.assert_close(outer.ghost_norm_sq(a, g), materialised, rtol=1e-5, atol=0)
    torch.testing.assert_close(outer.chunked_flash_norm_sq(a, g, tile_bytes=1), materialised, rtol=1e-5, atol=0)
    assert outer.ghost_is_cheaper(torch.empty(1, 1, 2, 64), torch.empty(1, 1, 2, 64))  # 2·2² < 64·64
    assert not outer.ghost_is_cheaper(torch.empty(1, 1, 1024, 64), torch.empty(1, 1, 1024, 64))


def test_noise_has_std_sigma_times_c_and_is_added_once() -> None:
    layer = nn.Linear(200, 500)
    sigma, clip = 1.5, 0.25
    engine = attach(layer, mode="bookkeeping", max_grad_norm=clip, noise_multiplier=sigma)
    engine.generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 200)
    engine.backward(layer(x).sum(dim=1) * 0.0)  # zero per-sample gradients: what remains is the noise
    noise = torch.cat([layer.weight.grad.flatten(), layer.bias.grad])
    n = noise.numel()
    assert abs(float(noise.std()) / (sigma * clip) - 1) < 4 / (2 * n) ** 0.5  # 4 standard errors
    assert abs(float(noise.mean())) < 4 * sigma * clip / n**0.5
    layer.zero_grad(set_to_none=True)
    engine.backward(layer(x).sum(dim=1), add_noise=False)
    clean = layer.weight.grad.clone()
    engine.add_noise()
    assert not torch.equal(clean, layer.weight.grad)
    expected = x.norm(dim=1, keepdim=True).clamp(min=0)  # weight grad of sample i is 1 ⊗ x_i
    assert torch.all(engine.per_sample_norms > expected.squeeze(1))


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_accumulating_micro_batches_sums_their_clipped_gradients(mode: str) -> None:
    model, data, loss, _, expected, _, threshold = reference("toy")
    engine = attach(model, mode=mode, max_grad_norm=threshold, noise_multiplier=0.0)
    try:
        model.zero_grad(set_to_none=True)
        for part in (slice(0, 2), slice(2, 6)):
            engine.backward(loss(model, {k: v[part] for k, v in data.items()}), add_noise=False)
        scale = max(float(g.abs().max()) for g in expected.values())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-5 * scale)
    finally:
        engine.detach()


def test_bf16_autocast_is_as_close_to_fp32_as_plain_autograd_is() -> None:
    """Under bf16 autocast the clipped sum may differ from fp32 only as much as bf16 moves plain autograd."""
    model, data, loss, _, expected, norms, threshold = reference("toy")

    def flat(grads) -> torch.Tensor:
        return torch.cat([g.flatten() for g in grads])

    def plain_sum(autocast: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            per_sample = loss(model, data)
        per_sample.float().sum().backward()
        return flat(p.grad for p in model.parameters())

    exact = plain_sum(False)
    plain_error = float((plain_sum(True) - exact).norm() / exact.norm())
    engine = attach(model, mode="bookkeeping", max_grad_norm=threshold, noise_multiplier=0.0)
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            per_sample = loss(model, data)
        engine.backward(per_sample.float())
    finally:
        engine.detach()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    want = flat(expected[n] for n, _ in model.named_parameters())
    dp_error = float((flat(p.grad for p in model.parameters()) - want).norm() / want.norm())
    assert 0 < dp_error < 2 * plain_error, (dp_error, plain_error)
    torch.testing.assert_close(engine.per_sample_norms, norms, rtol=4 * plain_error, atol=0)


def test_detach_restores_plain_autograd() -> None:
    model, data, loss, *_ = reference("toy")
    model.zero_grad(set_to_none=True)
    loss(model, data).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine = attach(model, mode="ghost", max_grad_norm=1.0, noise_multiplier=0.0)
    engine.detach()
    assert not any("forward" in m.__dict__ for m in model.modules())
    model.zero_grad(set_to_none=True)
    loss(model, data).sum().backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, plain[name]), name


def test_a_frozen_module_is_left_alone() -> None:
    model, data, loss, *_ = reference("toy")
    model.out.requires_grad_(False)
    try:
        engine = attach(model, mode="bookkeeping", max_grad_norm=1.0, noise_multiplier=0.0)
        model.zero_grad(set_to_none=True)
        engine.backward(loss(model, data))
        assert model.out.weight.grad is None and model.conv.weight.grad is not None
        assert "forward" not in model.out.__dict__
        engine.detach()
    finally:
        model.out.requires_grad_(True)


def test_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown DP mode 'fast'"):
        attach(nn.Linear(2, 2), mode="fast")
    for bad in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="max_grad_norm must be positive and finite"):
            attach(nn.Linear(2, 2), max_grad_norm=bad)
    with pytest.raises(ValueError, match="noise_multiplier must be non-negative and finite"):
        attach(nn.Linear(2, 2), noise_multiplier=float("inf"))

    two = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    engine = attach(two, mode="ghost")
    with pytest.raises(CoverageError, match=r"not used in this forward.*'unused\.weight', 'unused\.bias'"):
        engine.backward(two["used"](torch.randn(4, 3)).sum(dim=1))
    engine.detach()

    layer = nn.Linear(3, 3)
    engine = attach(layer, mode="bookkeeping")
    with pytest.raises(PerSampleLossError, match=r"per-sample loss, shape \[batch\].*got shape \(\)"):
        engine.backward(layer(torch.randn(4, 3)).sum())
    with pytest.raises(PerSampleLossError, match=r"batch of 4 .* but the loss has 3 entries"):
        engine.backward(layer(torch.randn(4, 3)).sum(dim=0))
    engine.detach()

    embedding = nn.Embedding(5, 2, max_norm=1.0)
    attach(embedding)
    with pytest.raises(UnsupportedLayerError, match="max_norm"):
        embedding(torch.tensor([[1, 2]]))


@pytest.mark.slow
def test_triton_flash_kernel_matches_under_the_interpreter() -> None:
    """The CUDA kernel's arithmetic, checked on CPU through Triton's interpreter."""
    pytest.importorskip("triton")
    script = Path(__file__).parent / "scripts" / "flash_kernel_interpreted.py"
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr[-2000:]
    assert "max relative error" in completed.stdout
