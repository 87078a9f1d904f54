"""The U-Nets the memory benchmarks train, by profile, and one training step of each.

| profile | model | input | precision | meant for |
| --- | --- | --- | --- | --- |
| ``small`` | the reference ``UNet2DModel`` of ``remat_pareto.py`` | 32x32 RGB, batch 4 | fp32 | this CPU |
| ``medium`` | the DDPM U-Net of ``configs/ddpm_unet.yaml`` | 128x128 RGB, batch 8 | fp32 | a GPU |
| ``large`` | a Stable-Diffusion-1.5-size ``UNet2DConditionModel`` | 64x64x4 latents, batch 8 | bf16 | a GPU |
| ``conditioned_small`` | the same layout at channels 64/128/256/256 | 32x32x4 latents, batch 4 | bf16 | this CPU |

The conditioned profiles condition on 77 random text-encoder states of width 768 and train under
bf16 autocast with fp32 weights (the precision of Lightning's "bf16-mixed"; autocast's cache on,
as torch's default, where Lightning turns it off).
Sizes and batches can be overridden (``high_res.py`` searches over them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from diffusers import UNet2DConditionModel, UNet2DModel
from torch import nn

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

REFERENCE_UNET = {
    "block_out_channels": (32, 64, 64, 128),
    "layers_per_block": 2,
    "down_block_types": ("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
}

SD15_UNET = {
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
}
TEXT_TOKENS = 77


def ddpm_unet_config() -> dict[str, Any]:
    """The U-Net of the DDPM recipe, read from its YAML so the benchmark trains what users train."""
    recipe = yaml.safe_load((CONFIGS / "ddpm_unet.yaml").read_text())
    return dict(recipe["model"]["init_args"]["model_config"])


@dataclass(frozen=True)
class Profile:
    name: str
    family: str  # "unet2d" or "unet2d_condition"
    size: int
    batch: int
    bf16: bool  # train under bf16 autocast (weights stay fp32, as Lightning's "bf16-mixed")

    def config(self) -> dict[str, Any]:
        if self.family == "unet2d_condition":
            channels = {"block_out_channels": (64, 128, 256, 256)} if self.name == "conditioned_small" else {}
            return {**SD15_UNET, **channels, "sample_size": self.size}
        base = REFERENCE_UNET if self.name == "small" else ddpm_unet_config()
        return {**base, "sample_size": self.size}

    def describe(self) -> dict[str, Any]:
        return {
            "profile": self.name,
            "family": self.family,
            "size": self.size,
            "batch": self.batch,
            "precision": "bf16-mixed" if self.bf16 else "fp32",
            "model_config": self.config(),
        }


PROFILES = {
    "small": Profile("small", "unet2d", size=32, batch=4, bf16=False),
    "medium": Profile("medium", "unet2d", size=128, batch=8, bf16=False),
    "large": Profile("large", "unet2d_condition", size=64, batch=8, bf16=True),
    "conditioned_small": Profile("conditioned_small", "unet2d_condition", size=32, batch=4, bf16=True),
}


def get_profile(name: str, size: int | None = None, batch: int | None = None) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}: choose from {', '.join(PROFILES)}")
    profile = PROFILES[name]
    if size is not None:
        profile = replace(profile, size=size)
    if batch is not None:
        profile = replace(profile, batch=batch)
    if profile.size < 8 or profile.batch < 1:
        raise ValueError(f"size must be at least 8 and batch positive, got size {profile.size}, batch {profile.batch}")
    return profile


def build_model(profile: Profile, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    cls = UNet2DConditionModel if profile.family == "unet2d_condition" else UNet2DModel
    return cls(**profile.config()).to(device)


@dataclass
class Case:
    """A model and one call of it; :meth:`step` is forward, MSE against a fixed target, backward."""

    profile: Profile
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    target: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.target.device

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.profile.bf16)

    def step(self, forward: Callable[..., Any] | None = None) -> None:
        with self.autocast():
            out = (self.model if forward is None else forward)(*self.args, **self.kwargs)
            out = out.sample if hasattr(out, "sample") else out
            loss = torch.nn.functional.mse_loss(out.float(), self.target)
        loss.backward()


def build_case(profile: Profile, device: torch.device, model: nn.Module | None = None) -> Case:
    """Inputs for ``profile`` (seeded); pass ``model`` to reuse one across sizes or batches."""
    model = model if model is not None else build_model(profile, device)
    generator = torch.Generator().manual_seed(1)
    channels = model.config.in_channels
    x = torch.randn(profile.batch, channels, profile.size, profile.size, generator=generator).to(device)
    t = torch.randint(0, 1000, (profile.batch,), generator=generator).to(device)
    kwargs: dict[str, Any] = {}
    if profile.family == "unet2d_condition":
        text = torch.randn(profile.batch, TEXT_TOKENS, model.config.cross_attention_dim, generator=generator)
        kwargs["encoder_hidden_states"] = text.to(device)
    target = torch.randn(x.shape, generator=generator).to(device)
    return Case(profile, model, (x, t), kwargs, target)
