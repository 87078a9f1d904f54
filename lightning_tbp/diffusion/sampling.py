"""Sampling a trained denoiser with a DDIM (or DDPM) scheduler, or a flow family's Euler steps,
and saving image grids."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler
from PIL import Image
from torch import nn

from lightning_tbp.diffusion.models import Family
from lightning_tbp.memory.homes import loaded_device


@torch.no_grad()
def sample(
    model: nn.Module,
    fam: Family,
    train_scheduler: DDPMScheduler | FlowMatchEulerDiscreteScheduler,
    shape: tuple[int, int, int, int],
    conditioning: dict[str, Any],
    steps: int = 50,
    sampler: str = "ddim",
    guidance_scale: float = 1.0,
    null_conditioning: dict[str, Any] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Images in [-1, 1] of ``shape`` from pure noise, ``steps`` denoising steps.

    With ``guidance_scale > 1`` and ``null_conditioning`` (the dropped-label or empty
    conditioning), each step mixes the conditional and unconditional predictions
    (classifier-free guidance). A flow family integrates its velocity from noise to data with
    Euler steps (``FlowMatchEulerDiscreteScheduler``, its training shift); ``sampler`` is then
    not used.
    """
    if sampler not in ("ddim", "ddpm"):
        raise ValueError(f"sampler must be 'ddim' or 'ddpm', got {sampler!r}")
    config = cast(Any, train_scheduler).config  # diffusers' ConfigMixin sets it
    flow = fam.objective == "flow"
    scheduler = (
        FlowMatchEulerDiscreteScheduler if flow else DDIMScheduler if sampler == "ddim" else DDPMScheduler
    ).from_config(config)
    scheduler.set_timesteps(steps)
    device = loaded_device(next(model.parameters()))  # streamed weights sit on the host
    x = torch.randn(shape, generator=generator, device="cpu").to(device)
    for t in scheduler.timesteps:
        timesteps = (
            torch.full((shape[0],), float(t), device=device)
            if flow
            else torch.full((shape[0],), int(t), device=device, dtype=torch.long)
        )
        prediction = fam.call(model, x, timesteps, conditioning)
        if guidance_scale != 1.0 and null_conditioning is not None:
            unconditional = fam.call(model, x, timesteps, null_conditioning)
            prediction = unconditional + guidance_scale * (prediction - unconditional)
        x = scheduler.step(prediction, t, x, generator=generator).prev_sample
    return x.clamp(-1, 1)


def save_image_grid(images: torch.Tensor, path: str | Path, columns: int | None = None) -> Path:
    """Write [N, C, H, W] images in [-1, 1] as one PNG grid (grey for C=1, RGB for C=3)."""
    n, channels, height, width = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    pixels = ((images.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    grid = torch.zeros(channels, rows * (height + 2) + 2, columns * (width + 2) + 2, dtype=torch.uint8)
    for index in range(n):
        row, column = divmod(index, columns)
        top, left = 2 + row * (height + 2), 2 + column * (width + 2)
        grid[:, top : top + height, left : left + width] = pixels[index]
    array = grid.permute(1, 2, 0).numpy()
    image = Image.fromarray(
        array[:, :, 0] if channels == 1 else np.ascontiguousarray(array), "L" if channels == 1 else "RGB"
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
