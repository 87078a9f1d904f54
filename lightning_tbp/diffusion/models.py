"""The diffusers denoisers the recipes train, behind one small interface per family.

A family knows how to build its model from a config, where it sits in a pipeline folder
(``unet`` or ``transformer``), and how to call it on a batch. Loading is local only:
``from_pretrained`` on a directory, never the hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (
    DiTTransformer2DModel,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    UNet2DModel,
)
from torch import nn

from lightning_tbp.compat import fake_mode_active


@dataclass(frozen=True)
class Family:
    """``objective``: ``"ddpm"`` (a DDPM noise schedule, epsilon or v targets) or ``"flow"``
    (rectified flow: the straight path from data to noise, its velocity the target, as SD3 and
    Flux train); ``conditioning``: the batch keys its call needs besides the images;
    ``flow_shift``: a flow family's usual shift of its noise levels (its released scheduler's,
    where that shifts a fixed table: SD3's 3.0; Flux shifts by resolution at sampling and
    trains unshifted in diffusers' script: 1.0)."""

    name: str
    model_class: type[nn.Module]
    pipeline_subfolder: str
    call: Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]
    objective: Literal["ddpm", "flow"] = "ddpm"
    conditioning: tuple[str, ...] = ()
    flow_shift: float = 1.0


def _call_unet(model: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    return model(noisy, timesteps).sample


def _call_dit(model: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    # diffusers' DiT drops 10% of the labels to its null class while training (classifier-free guidance).
    out = model(noisy, timestep=timesteps, class_labels=batch["labels"]).sample
    return out[:, : noisy.shape[1]]  # a DiT that learns the variance too returns 2C channels


def _conditioning(model: nn.Module, batch: dict[str, Any], keys: tuple[str, ...]) -> list[torch.Tensor]:
    missing = [key for key in keys if key not in batch]
    if missing:
        raise ValueError(
            f"{type(model).__name__} needs precomputed conditioning: batches must carry {', '.join(map(repr, keys))} "
            f"(missing {', '.join(map(repr, missing))}; ImageFolderDataModule(embeddings=...) and "
            "LatentsDataModule provide them)"
        )
    return [batch[key] for key in keys]


def _call_conditional_unet(
    model: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, Any]
) -> torch.Tensor:
    (states,) = _conditioning(model, batch, ("encoder_hidden_states",))
    return model(noisy, timesteps, encoder_hidden_states=states).sample


SDXL_CONDITIONING = ("encoder_hidden_states", "text_embeds", "time_ids")


def _call_sdxl(model: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """SDXL's U-Net: the text states, and its added conditioning, the pooled text embedding and
    ``time_ids`` (original size, crop's top-left, target size: six numbers per sample)."""
    states, pooled, time_ids = _conditioning(model, batch, SDXL_CONDITIONING)
    added = {"text_embeds": pooled, "time_ids": time_ids}
    return model(noisy, timesteps, encoder_hidden_states=states, added_cond_kwargs=added).sample


SD3_CONDITIONING = ("encoder_hidden_states", "pooled_projections")


def _call_sd3(model: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    states, pooled = _conditioning(model, batch, SD3_CONDITIONING)
    return model(noisy, encoder_hidden_states=states, pooled_projections=pooled, timestep=timesteps).sample


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Flux's tokens: each 2x2 patch of a latent [B, C, S, S] as one [B, (S/2)^2, 4C] row."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """:func:`pack_latents` undone."""
    b, _, packed = tokens.shape
    c = packed // 4
    return tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def _call_flux(model: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    states, pooled = _conditioning(model, batch, SD3_CONDITIONING)
    height, width = noisy.shape[-2:]
    if height % 2 or width % 2:
        raise ValueError(
            f"Flux packs its latents in 2x2 patches: their height and width must be even, got {height}x{width}"
        )
    image_ids = torch.zeros(height // 2, width // 2, 3, device=noisy.device)
    image_ids[..., 1] = torch.arange(height // 2, device=noisy.device)[:, None]
    image_ids[..., 2] = torch.arange(width // 2, device=noisy.device)[None, :]
    guidance = batch.get("guidance")
    if model.config.guidance_embeds and guidance is None:
        raise ValueError(
            "this Flux transformer embeds a guidance value (FLUX.1-dev's distillation): set the module's "
            "guidance_embedding (diffusers' Flux LoRA script trains at 3.5)"
        )
    if guidance is not None and not model.config.guidance_embeds:
        raise ValueError(
            "this Flux transformer has no guidance embedding (FLUX.1-schnell's kind): unset guidance_embedding"
        )
    out = model(
        pack_latents(noisy),
        encoder_hidden_states=states,
        pooled_projections=pooled,
        timestep=timesteps / 1000,  # Flux scales its timestep by 1000 itself
        img_ids=image_ids.reshape(-1, 3),
        txt_ids=torch.zeros(states.shape[1], 3, device=noisy.device),
        guidance=guidance,
    ).sample
    return unpack_latents(out, height, width)


FAMILIES = {
    "unet2d": Family("unet2d", UNet2DModel, "unet", _call_unet),
    "dit": Family("dit", DiTTransformer2DModel, "transformer", _call_dit),
    "unet2d_condition": Family(
        "unet2d_condition",
        UNet2DConditionModel,
        "unet",
        _call_conditional_unet,
        conditioning=("encoder_hidden_states",),
    ),
    "sdxl": Family("sdxl", UNet2DConditionModel, "unet", _call_sdxl, conditioning=SDXL_CONDITIONING),
    "sd3": Family("sd3", SD3Transformer2DModel, "transformer", _call_sd3, "flow", SD3_CONDITIONING, 3.0),
    "flux": Family("flux", FluxTransformer2DModel, "transformer", _call_flux, "flow", SD3_CONDITIONING),
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def model_directory(path: str | os.PathLike[str], subfolder: str) -> Path:
    """The folder holding the model's ``config.json``: ``path`` itself or its pipeline's
    ``subfolder`` (``unet``, ``transformer``, ``vae``)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"pretrained model directory {str(root)!r} does not exist; give a local diffusers model folder "
            f"(config.json + weights) or a pipeline folder with a '{subfolder}' subfolder "
            "(no hub downloads at run time)"
        )
    for candidate in (root, root / subfolder):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{str(root)!r} is neither a diffusers model folder nor a pipeline folder: no config.json in it or in "
        f"its '{subfolder}' subfolder"
    )


WeightsDtype = Literal["float32", "bfloat16", "float16"]


def build_model(
    family_name: str,
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    dtype: WeightsDtype | None = None,
) -> nn.Module:
    """A fresh model from ``config``, or the weights in the local directory ``pretrained``; in train
    mode, its weights in ``dtype`` (None: float32, as diffusers loads them). Under ``tbp
    estimate``'s fake tensors the folder's config alone is read: the estimate needs the weights'
    shapes, and their values cannot be loaded into fake tensors."""
    fam = family(family_name)
    torch_dtype = None if dtype is None else getattr(torch, dtype)
    if pretrained is None:
        return fam.model_class(**(config or {})).to(torch_dtype)
    if config:
        raise ValueError("give either model_config (a fresh model) or pretrained (local weights), not both")
    directory = model_directory(pretrained, fam.pipeline_subfolder)
    declared = json.loads((directory / "config.json").read_text()).get("_class_name")
    if declared not in (None, fam.model_class.__name__):
        raise ValueError(
            f"{directory} holds a {declared}, but model family {fam.name!r} trains {fam.model_class.__name__}"
        )
    if fake_mode_active():
        return fam.model_class.from_config(fam.model_class.load_config(directory)).to(torch_dtype).train()
    try:
        model = fam.model_class.from_pretrained(directory, local_files_only=True, torch_dtype=torch_dtype)
    except (OSError, ValueError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot load {fam.model_class.__name__} from {directory}: {error}") from error
    # from_pretrained returns eval mode and Lightning keeps submodule modes: fine-tuning would
    # otherwise run without dropout, the only sign a generic "modules in eval mode" warning
    return model.train()


def sample_input_channels(model: nn.Module) -> int:
    """The channels of what the model denoises (Flux's ``in_channels`` count packed 2x2 patches)."""
    channels = int(model.config.in_channels)
    return channels // 4 if isinstance(model, FluxTransformer2DModel) else channels


def sample_size(model: nn.Module) -> int:
    if isinstance(model, FluxTransformer2DModel):
        raise ValueError(
            "a Flux transformer has no fixed latent size to sample at: draw samples with diffusers' FluxPipeline "
            "and the exported transformer"
        )
    size = model.config.sample_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def small_unet_config(image_size: int = 32, channels: int = 1) -> dict[str, Any]:
    """A small pixel-space U-Net with attention at the middle resolution (fast on CPU)."""
    return {
        "sample_size": image_size,
        "in_channels": channels,
        "out_channels": channels,
        "block_out_channels": (32, 64, 64),
        "layers_per_block": 2,
        "norm_num_groups": 8,
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        "attention_head_dim": 8,
    }


def pipeline_directory(pretrained: str | os.PathLike[str] | None) -> Path | None:
    """``pretrained`` where it is a whole pipeline folder (``model_index.json``), else None."""
    if pretrained is None:
        return None
    folder = Path(pretrained)
    return folder if (folder / "model_index.json").is_file() else None


def scheduler_config(pretrained: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The noise schedule a pretrained pipeline was trained with (its ``scheduler`` subfolder's
    config: beta schedule, prediction type, timestep spacing), or {} where ``pretrained`` has none."""
    if pretrained is None:
        return {}
    path = Path(pretrained) / "scheduler" / "scheduler_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
