"""A zoo of diffusers architectures, each small enough for a CPU and built from a config.

Every entry gives a model, one call of it (inputs seeded) and a training loss, so the zoo
benchmark and the tests check every promise of the planner on the same models: plain U-Nets, an
SDXL-style conditional U-Net, a ControlNet, a VAE, transformers with cross attention (DiT,
PixArt, Sana), joint text-image attention (SD3, Flux) and a video transformer (CogVideoX).

Widths and resolutions are scaled down; the structure (block types, skip connections, the
joint-attention streams, the temporal axis) is the full models'.

``HELD_OUT`` holds more architectures that no part of the planner or the DP engine was built or
tuned on; the tests check every promise on them once (``zoo.py --held-out`` benchmarks them).
``DP_HELD_OUT`` holds architectures checked so far under DP only (per-sample clipping against
the reference): the planner's promises have not been run on them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_tbp.compat import tree_map


@dataclass(frozen=True)
class Architecture:
    name: str
    family: str  # what the model stands for, for tables
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator, int], tuple[tuple, dict[str, Any]]]  # (generator, batch) -> call

    def case(self, batch: int = 2, seed: int = 0, device: torch.device | str = "cpu") -> ZooCase:
        """The model and its seeded inputs, built on the CPU (the same weights and inputs on any
        device) and moved to ``device``."""
        torch.manual_seed(seed)
        model = self.build()
        generator = torch.Generator().manual_seed(seed + 1)
        args, kwargs = self.inputs(generator, batch)
        with torch.no_grad():
            out = sample(model(*args, **kwargs))
        target = torch.randn(out.shape, generator=generator)
        model, target = model.to(device), target.to(device)
        args, kwargs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        return ZooCase(self, model, args, kwargs, target)


@dataclass
class ZooCase:
    """One architecture with its inputs: ``step()`` is forward, MSE to a fixed target, backward."""

    architecture: Architecture
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    target: torch.Tensor

    def loss(self, forward: Callable[..., Any] | None = None) -> torch.Tensor:
        out = sample((forward or self.model)(*self.args, **self.kwargs))
        return (out.float() - self.target).square().mean()

    def step(self, forward: Callable[..., Any] | None = None) -> None:
        self.loss(forward).backward()

    def to_channels_last(self) -> ZooCase:
        """The model and its image inputs in channels-last memory format, as diffusers advises
        for convolutional models on GPUs (in place; returns the case)."""
        self.model = self.model.to(memory_format=torch.channels_last)
        self.args, self.kwargs = tree_map(
            lambda x: x.contiguous(memory_format=torch.channels_last) if _is_image(x) else x, (self.args, self.kwargs)
        )
        return self


def _is_image(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 4


def sample(out: Any) -> torch.Tensor:
    """The tensor a diffusers model returns (its ``.sample``, or the first of a tuple)."""
    if hasattr(out, "sample"):
        return out.sample
    return out[0] if isinstance(out, tuple) else out


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _timesteps(generator: torch.Generator, batch: int) -> torch.Tensor:
    return torch.randint(0, 1000, (batch,), generator=generator)


def _unet2d() -> nn.Module:
    from diffusers import UNet2DModel

    from lightning_tbp.diffusion import small_unet_config

    return UNet2DModel(**small_unet_config(32, 3))  # the recipes' small DDPM U-Net, RGB


def _sdxl_unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 2),
        cross_attention_dim=32,
        norm_num_groups=8,
        attention_head_dim=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
        use_linear_projection=True,
    )


def _sdxl_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (_randn(generator, batch, 4, 16, 16), _timesteps(generator, batch)), {
        "encoder_hidden_states": _randn(generator, batch, 7, 32),
        "added_cond_kwargs": {"text_embeds": _randn(generator, batch, 32), "time_ids": _randn(generator, batch, 6)},
    }


def _controlnet() -> nn.Module:
    from diffusers import ControlNetModel

    return ControlNetModel(
        in_channels=4,
        conditioning_channels=3,
        block_out_channels=(32, 64),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=8,
        attention_head_dim=8,
        conditioning_embedding_out_channels=(16, 32),
    )


class _ControlNetOutputs(nn.Module):
    """A ControlNet's residuals summed into one tensor, so the zoo's loss sees them all."""

    def __init__(self) -> None:
        super().__init__()
        self.controlnet = _controlnet()

    @override
    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond):
        out = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond, return_dict=False)
        down, mid = out
        return mid.mean(dim=(2, 3)) + sum(d.mean(dim=(1, 2, 3))[:, None] for d in down)


def _controlnet_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (
        _randn(generator, batch, 4, 16, 16),
        _timesteps(generator, batch),
        _randn(generator, batch, 7, 32),
        _randn(generator, batch, 3, 32, 32),
    ), {}


def _vae() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
    )


def _dit() -> nn.Module:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        num_layers=4,
        patch_size=2,
        sample_size=16,
        num_embeds_ada_norm=10,
    )


def _pixart() -> nn.Module:
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        cross_attention_dim=64,
        sample_size=16,
        patch_size=2,
        caption_channels=32,
    )


def _sana() -> nn.Module:
    from diffusers import SanaTransformer2DModel

    return SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=16,
        num_layers=4,
        num_cross_attention_heads=4,
        cross_attention_head_dim=16,
        cross_attention_dim=64,
        caption_channels=32,
        sample_size=16,
        patch_size=1,
    )


def _sd3() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=64,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
    )


def _sd3_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (_randn(generator, batch, 4, 16, 16),), {
        "encoder_hidden_states": _randn(generator, batch, 12, 32),
        "pooled_projections": _randn(generator, batch, 32),
        "timestep": _timesteps(generator, batch),
    }


def _flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def _flux_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    height = width = 8  # a 16x16 latent packed 2x2
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return (_randn(generator, batch, height * width, 16),), {
        "encoder_hidden_states": _randn(generator, batch, 12, 32),
        "pooled_projections": _randn(generator, batch, 32),
        "timestep": torch.rand(batch, generator=generator),
        "img_ids": ids.reshape(-1, 3),
        "txt_ids": torch.zeros(12, 3),
    }


def _cogvideox() -> nn.Module:
    from diffusers import CogVideoXTransformer3DModel

    return CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=32,
        text_embed_dim=32,
        num_layers=4,
        sample_width=16,
        sample_height=16,
        sample_frames=9,
        patch_size=2,
        max_text_seq_length=12,
        temporal_compression_ratio=4,
    )


def _cogvideox_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (_randn(generator, batch, 3, 4, 16, 16), _randn(generator, batch, 12, 32), _timesteps(generator, batch)), {}


def _image_inputs(channels: int, size: int) -> Callable[[torch.Generator, int], tuple[tuple, dict[str, Any]]]:
    return lambda generator, batch: ((_randn(generator, batch, channels, size, size), _timesteps(generator, batch)), {})


def _dit_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (_randn(generator, batch, 4, 16, 16),), {
        "timestep": _timesteps(generator, batch),
        "class_labels": torch.randint(0, 10, (batch,), generator=generator),
    }


def _caption_inputs(pixart: bool) -> Callable[[torch.Generator, int], tuple[tuple, dict[str, Any]]]:
    def inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
        kwargs = {"encoder_hidden_states": _randn(generator, batch, 12, 32), "timestep": _timesteps(generator, batch)}
        if pixart:
            kwargs["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
        return (_randn(generator, batch, 4, 16, 16),), kwargs

    return inputs


def _vae_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (_randn(generator, batch, 3, 64, 64),), {}


ZOO = {
    arch.name: arch
    for arch in (
        Architecture("unet2d", "DDPM UNet2DModel", _unet2d, _image_inputs(3, 32)),
        Architecture("sdxl_unet", "UNet2DCondition, SDXL-style added conditioning", _sdxl_unet, _sdxl_inputs),
        Architecture("controlnet", "ControlNet", _ControlNetOutputs, _controlnet_inputs),
        Architecture("vae", "AutoencoderKL", _vae, _vae_inputs),
        Architecture("dit", "DiT (class-conditional)", _dit, _dit_inputs),
        Architecture("pixart", "PixArt-alpha", _pixart, _caption_inputs(pixart=True)),
        Architecture("sana", "Sana (linear attention)", _sana, _caption_inputs(pixart=False)),
        Architecture("sd3", "SD3 MMDiT (joint attention)", _sd3, _sd3_inputs),
        Architecture("flux", "Flux (joint + single-stream)", _flux, _flux_inputs),
        Architecture("cogvideox", "CogVideoX (video)", _cogvideox, _cogvideox_inputs),
    )
}


def _reference_unet() -> nn.Module:
    from cases import REFERENCE_UNET
    from diffusers import UNet2DModel

    return UNet2DModel(**REFERENCE_UNET, sample_size=64)


def _video_unet(channels: tuple[int, int] = (32, 64)) -> nn.Module:
    from diffusers import UNet3DConditionModel

    return UNet3DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=channels,
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        cross_attention_dim=16,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def _animatediff() -> nn.Module:
    from diffusers import UNetMotionModel

    return UNetMotionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"),
        cross_attention_dim=16,
        num_attention_heads=2,
        motion_num_attention_heads=2,
        motion_max_seq_length=8,
        norm_num_groups=8,
    )


def _video_inputs(frames: int, size: int) -> Callable[[torch.Generator, int], tuple[tuple, dict[str, Any]]]:
    def inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
        video = _randn(generator, batch, 4, frames, size, size)
        return (video, _timesteps(generator, batch)), {"encoder_hidden_states": _randn(generator, batch, 5, 16)}

    return inputs


def _motion_inputs(frames: int, size: int) -> Callable[[torch.Generator, int], tuple[tuple, dict[str, Any]]]:
    """AnimateDiff's call: the text repeated for every frame, as its pipeline repeats it."""

    def inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
        video = _randn(generator, batch, 4, frames, size, size)
        text = _randn(generator, batch, 5, 16).repeat_interleave(frames, dim=0)
        return (video, _timesteps(generator, batch)), {"encoder_hidden_states": text}

    return inputs


#: Benchmarked on request (``zoo.py --arch``, ``dp_zoo.py --arch``) but not part of the zoo the
#: tests sweep: the reference U-Net of ``remat_pareto.py`` (64x64), for timings at diffusers' peak
#: in interleaved rounds; a video U-Net whose layers run on frames and positions folded into the
#: batch (the DP engine's folded rows, ``docs/privacy.md``; the DP tests build it too), a
#: wider one (channels 128/256, 8 frames of 8x8, ~20M parameters) whose convolutions' per-sample
#: gradients are large next to its activations, as in real video models, and AnimateDiff's
#: UNetMotionModel, which calls some layers by keyword (``layer(input=x)``).
BENCH_ONLY = {
    "reference_unet": Architecture(
        "reference_unet", "reference UNet2DModel, 64x64", _reference_unet, _image_inputs(3, 64)
    ),
    "video_unet": Architecture("video_unet", "UNet3DCondition (video, folds)", _video_unet, _video_inputs(3, 16)),
    "video_unet_wide": Architecture(
        "video_unet_wide",
        "UNet3DCondition 128/256, 8 frames of 8x8",
        functools.partial(_video_unet, (128, 256)),
        _video_inputs(8, 8),
    ),
    "animatediff": Architecture(
        "animatediff", "UNetMotion (AnimateDiff: a U-Net with motion modules)", _animatediff, _motion_inputs(3, 16)
    ),
}


# -- held out: architectures nothing was tuned on --------------------------------------------------


def _wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=128,
        num_layers=3,
        rope_max_seq_len=64,
    )


def _wan_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    video = _randn(generator, batch, 4, 3, 16, 16)
    return (video, _timesteps(generator, batch), _randn(generator, batch, 12, 32)), {}


def _ltx() -> nn.Module:
    from diffusers import LTXVideoTransformer3DModel

    return LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=4,
        attention_head_dim=16,
        cross_attention_dim=64,
        num_layers=3,
        caption_channels=32,
    )


def _ltx_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    frames, height, width = 3, 8, 8  # latent tokens, packed
    tokens = _randn(generator, batch, frames * height * width, 8)
    text, mask = _randn(generator, batch, 12, 32), torch.ones(batch, 12)
    return (tokens, text, _timesteps(generator, batch), mask), {"num_frames": frames, "height": height, "width": width}


def _auraflow() -> nn.Module:
    from diffusers import AuraFlowTransformer2DModel

    return AuraFlowTransformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=2,
        num_single_dit_layers=3,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=64,
    )


def _auraflow_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    latents, text = _randn(generator, batch, 4, 16, 16), _randn(generator, batch, 12, 32)
    return (latents,), {"encoder_hidden_states": text, "timestep": _timesteps(generator, batch)}


def _svd_unet() -> nn.Module:
    from diffusers import UNetSpatioTemporalConditionModel

    return UNetSpatioTemporalConditionModel(
        sample_size=16,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        block_out_channels=(32, 64),
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24,
        layers_per_block=1,
        cross_attention_dim=32,
        num_attention_heads=(2, 4),
        num_frames=3,
    )


def _svd_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    video = _randn(generator, batch, 3, 8, 16, 16)  # frames before channels, as SVD takes them
    image, added_time_ids = _randn(generator, batch, 1, 32), _randn(generator, batch, 3)
    return (video, _timesteps(generator, batch).float(), image, added_time_ids), {}


def _hunyuan_video() -> nn.Module:
    from diffusers import HunyuanVideoTransformer3DModel

    return HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=32,
        pooled_projection_dim=32,
        rope_axes_dim=(4, 6, 6),
        guidance_embeds=True,
    )


def _hunyuan_video_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    video, text = _randn(generator, batch, 4, 3, 16, 16), _randn(generator, batch, 12, 32)
    pooled = _randn(generator, batch, 32)
    guidance = torch.full((batch,), 3500.0)
    return (video, _timesteps(generator, batch), text, torch.ones(batch, 12), pooled), {"guidance": guidance}


def _lumina2() -> nn.Module:
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        hidden_size=64,
        num_layers=3,
        num_refiner_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(64, 32, 32),
        cap_feat_dim=32,
    )


def _lumina2_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    text, mask = _randn(generator, batch, 12, 32), torch.ones(batch, 12, dtype=torch.bool)
    return (_randn(generator, batch, 4, 16, 16), torch.rand(batch, generator=generator), text, mask), {}


def _qwen_image() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def _qwen_image_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    latents = _randn(generator, batch, 64, 16)  # an 8x8 grid of packed 2x2 patches
    return (latents,), {
        "encoder_hidden_states": _randn(generator, batch, 12, 32),
        "encoder_hidden_states_mask": torch.ones(batch, 12),
        "timestep": torch.rand(batch, generator=generator),
        "img_shapes": [[(1, 8, 8)]] * batch,
    }


HELD_OUT = {
    arch.name: arch
    for arch in (
        Architecture("wan", "Wan 2.x (video transformer, 3-D RoPE)", _wan, _wan_inputs),
        Architecture("ltx", "LTX-Video (video transformer)", _ltx, _ltx_inputs),
        Architecture("auraflow", "AuraFlow (MMDiT, cropped learned positions)", _auraflow, _auraflow_inputs),
        Architecture("svd_unet", "Stable Video Diffusion U-Net (spatio-temporal)", _svd_unet, _svd_inputs),
        Architecture("hunyuan_video", "HunyuanVideo (token refiner, guidance)", _hunyuan_video, _hunyuan_video_inputs),
        Architecture("lumina2", "Lumina 2 (grouped-query attention, caption refiner)", _lumina2, _lumina2_inputs),
        Architecture("qwen_image", "Qwen-Image (MMDiT)", _qwen_image, _qwen_image_inputs),
    )
}


def _omnigen() -> nn.Module:
    from diffusers import OmniGenTransformer2DModel

    return OmniGenTransformer2DModel(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=32,
        num_layers=2,
        pad_token_id=0,
        vocab_size=100,
        in_channels=4,
        time_step_dim=4,
        rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]},
    )


_OMNIGEN_TEXT = 24


def _omnigen_inputs(with_image: bool) -> Callable[[torch.Generator, int], tuple[tuple, dict[str, Any]]]:
    """OmniGen's call: text tokens, then (``with_image``) one conditioning image whose 16 patch
    tokens its forward writes, in place, over the first 16 text tokens of sample 0, as its
    pipeline places an image in a prompt."""

    def inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
        length = _OMNIGEN_TEXT + 1 + 16  # text, the time token, the 4x4 patches of an 8x8 latent
        ids = torch.randint(1, 10, (batch, _OMNIGEN_TEXT), generator=generator)
        images = [_randn(generator, 1, 4, 8, 8)] if with_image else []
        sizes = {0: [[0, 16]]} if with_image else {}
        mask, positions = torch.ones(batch, length, length), torch.arange(length).repeat(batch, 1)
        return (_randn(generator, batch, 4, 8, 8), torch.rand(batch, generator=generator), ids, images, sizes), {
            "attention_mask": mask,
            "position_ids": positions,
        }

    return inputs


def _glm_image() -> nn.Module:
    from diffusers import GlmImageTransformer2DModel

    return GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=32,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=64,
    )


def _glm_image_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    """GLM-Image's call: one prior token per 2x2 patch of an 8x8 latent; its forward zeroes the
    dropped ones' embeddings in place."""
    prior = torch.randint(0, 64, (batch, 16), generator=generator)
    size, crop = torch.tensor([[8.0, 8.0]] * batch), torch.zeros(batch, 2)
    latents, text = _randn(generator, batch, 4, 8, 8), _randn(generator, batch, 12, 32)
    drop = torch.zeros(batch, 16, dtype=torch.bool)
    return (latents, text, prior, drop, _timesteps(generator, batch), size, crop), {}


def _hunyuan_video_vae() -> nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )


def _hunyuan_video_vae_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    return (_randn(generator, batch, 3, 5, 16, 16),), {"sample_posterior": False}


def _kandinsky5() -> nn.Module:
    from diffusers import Kandinsky5Transformer3DModel

    return Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        in_text_dim=16,
        in_text_dim2=8,
        time_dim=8,
        out_visual_dim=4,
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(4, 2, 2),
    )


def _kandinsky5_inputs(generator: torch.Generator, batch: int) -> tuple[tuple, dict[str, Any]]:
    frames, size, text = 2, 4, 3
    video, caption = _randn(generator, batch, frames, size, size, 4), _randn(generator, batch, text, 16)
    grid = (torch.arange(frames), torch.arange(size // 2), torch.arange(size // 2))
    time, pooled = torch.rand(batch, generator=generator), _randn(generator, batch, 8)
    return (video, caption, time, pooled, grid, torch.arange(text)), {}


DP_HELD_OUT = {
    arch.name: arch
    for arch in (
        Architecture("omnigen", "OmniGen (text tokens, no conditioning image)", _omnigen, _omnigen_inputs(False)),
        Architecture("omnigen_image", "OmniGen (a conditioning image in the prompt)", _omnigen, _omnigen_inputs(True)),
        Architecture("glm_image", "GLM-Image (prior tokens, in-place drop)", _glm_image, _glm_image_inputs),
        Architecture(
            "hunyuan_video_vae", "HunyuanVideo VAE (causal 3-D)", _hunyuan_video_vae, _hunyuan_video_vae_inputs
        ),
        Architecture("kandinsky5", "Kandinsky 5 (video transformer)", _kandinsky5, _kandinsky5_inputs),
    )
}
