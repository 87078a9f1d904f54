"""Tiny models the tests plan, each built from a config (no weights are downloaded)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from diffusers import DiTTransformer2DModel, FluxTransformer2DModel, UNet2DConditionModel, UNet2DModel
from torch import nn

from lightning_tbp.remat.pricing import price_by_flops
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.trace import Trace
from lightning_tbp.testing.zoo_models import ZOO


class ResidualMLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def mlp_chain(depth: int = 12, width: int = 64) -> nn.Module:
    return nn.Sequential(*(ResidualMLPBlock(width) for _ in range(depth)), nn.Linear(width, width))


def tiny_unet() -> UNet2DModel:
    return UNet2DModel(
        sample_size=32,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
    )


class Unrolled(nn.Module):
    """``calls`` steps of a denoiser with gradients through every one: ``x <- x - 0.1 * f(x, t - i)``."""

    def __init__(self, denoiser: nn.Module, calls: int, **conditioning: torch.Tensor) -> None:
        super().__init__()
        self.denoiser, self.calls, self.conditioning = denoiser, calls, conditioning

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for i in range(self.calls):
            x = x - 0.1 * self.denoiser(x, t - i, **self.conditioning).sample
        return x


def chain_trace(calls: int, per_op_ns: float = 0.0) -> Trace:
    """An unrolled chain of tiny U-Net calls priced by FLOPs (plus ``per_op_ns`` per op): the
    solver's searches on it are deterministic."""
    torch.manual_seed(0)
    model = Unrolled(tiny_unet(), calls=calls)
    trace = record_trace(model, (torch.randn(2, 3, 32, 32), torch.tensor([500, 700])), {}, measure=False)
    price_by_flops(trace)
    if per_op_ns:  # 1 GFLOP/s and a fixed cost per op, as a CPU's dispatch
        trace.event_cost = [flops / 1e3 + per_op_ns for flops in trace.event_flops]
    return trace


def tiny_cond_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=8,
        attention_head_dim=8,
    )


def tiny_dit(dropout: float = 0.1) -> DiTTransformer2DModel:
    return DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        num_layers=3,
        dropout=dropout,
        patch_size=2,
        sample_size=8,
        num_embeds_ada_norm=10,
    )


@dataclass
class Case:
    """A model and one call of it: ``call(model)`` returns the output tensor."""

    name: str
    build: Callable[[], nn.Module]
    args: Callable[[], tuple]
    kwargs: Callable[[], dict]
    output: Callable[[object], torch.Tensor]


def _sample(out: object) -> torch.Tensor:
    return out.sample if hasattr(out, "sample") else out  # diffusers returns *Output dataclasses


CASES = [
    Case("mlp_chain", mlp_chain, lambda: (torch.randn(512, 64),), dict, _sample),
    Case(
        "unet2d_attention",
        tiny_unet,
        lambda: (torch.randn(2, 3, 32, 32), torch.tensor([3, 700])),
        dict,
        _sample,
    ),
    Case(
        "unet2d_condition_cross_attention",
        tiny_cond_unet,
        lambda: (torch.randn(2, 4, 16, 16), torch.tensor([10, 500])),
        lambda: {"encoder_hidden_states": torch.randn(2, 7, 32)},
        _sample,
    ),
    Case(
        "dit_dropout",
        tiny_dit,
        lambda: (torch.randn(2, 4, 8, 8),),
        lambda: {"timestep": torch.tensor([1, 900]), "class_labels": torch.tensor([0, 7])},
        _sample,
    ),
]


def make_case(case: Case, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(seed)
    model = case.build()
    return model, case.args(), case.kwargs()


def training_step(model: nn.Module, case: Case, args: tuple, kwargs: dict, seed: int = 1234):
    """One forward + backward from a fixed RNG state; returns the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = case.output(model(*args, **kwargs))
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def max_relative_difference(grads: dict, reference: dict) -> float:
    assert grads.keys() == reference.keys()
    worst = 0.0
    for name, ref in reference.items():
        scale = ref.abs().max().clamp_min(torch.finfo(ref.dtype).tiny)
        worst = max(worst, ((grads[name] - ref).abs().max() / scale).item())
    return worst


def parameter_bytes(model: nn.Module) -> int:
    """What a byte budget, the device's total, holds of ``model`` outside its step: its parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def feasible_range(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(minimum feasible budget, naive peak) as byte budgets, the device's totals (the model's
    parameters included), as the planner's infeasibility error names them."""
    from lightning_tbp import InfeasibleBudgetError, rematerialize

    try:
        rematerialize(model, *args, memory_budget=1, **kwargs)
    except InfeasibleBudgetError as error:
        return error.minimum_budget_bytes, error.naive_bytes + error.held_bytes
    raise AssertionError("a 1-byte budget cannot be feasible")


class Denoiser(L.LightningModule):
    """A tiny U-Net denoiser trained with Adam: the LightningModule of the strategy and callback tests."""

    def __init__(self, net: nn.Module | None = None) -> None:
        super().__init__()
        self.net = net if net is not None else tiny_unet()
        self.head = nn.Identity()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = self.net(x, t)
        return out.sample if hasattr(out, "sample") else out

    def training_step(self, batch, batch_idx):
        (x,) = batch
        t = torch.arange(x.shape[0], device=x.device) * 97 % 1000
        noise = torch.randn_like(x)
        loss = (self(x + noise, t) - noise).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class WritesAndViews(torch.nn.Module):
    """Cheap ops whose outputs are written in place (``mul_``, ``+=`` through a slice, an in-place
    ReLU) or saved through views (chunks, a transpose): what a lazy block rebuilds must be what
    autograd saved."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.GroupNorm(4, channels)
        self.conv = torch.nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.norm(x))
        h.mul_(2.0)
        h[:, :4] += 1.0
        a, b = self.act(self.conv(h) * 0.5).chunk(2, dim=1)
        return x + a * torch.sigmoid(b).transpose(2, 3)


class ChunkedGate(torch.nn.Module):
    """A gate made of two chunks of one SiLU output: the product saves both views."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(channels, 2 * channels, 1)
        self.norm = torch.nn.GroupNorm(4, 2 * channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.nn.functional.silu(self.norm(self.proj(x))).chunk(2, dim=1)
        return x + a * b


def tiny_flux_dev() -> nn.Module:
    """The zoo's Flux transformer of FLUX.1-dev's kind: with its guidance embedding."""
    config = {key: value for key, value in ZOO["flux"].build().config.items() if not key.startswith("_")}
    return FluxTransformer2DModel(**{**config, "guidance_embeds": True})


def write_latents(path: Path, samples: int) -> Path:
    """A ``LatentsDataModule`` file both the zoo's SD3 and its Flux take: seeded latents
    [N, 4, 16, 16], text embeddings [N, 12, 32] and pooled projections [N, 32]."""
    generator = torch.Generator().manual_seed(0)
    rows = {"latents": (4, 16, 16), "encoder_hidden_states": (12, 32), "pooled_projections": (32,)}
    torch.save({key: torch.randn(samples, *shape, generator=generator) for key, shape in rows.items()}, path)
    return path
