"""Tiny text-to-image pipeline folders (SD 1.5, SDXL, SD3, Flux), made offline with random weights.

What a user brings, at the size of a test: a folder ``Pipeline.save_pretrained`` wrote, with its
VAE, text encoders, tokenizers, denoiser and scheduler, which ``from_pretrained`` loads with
nothing downloaded. The CLIP tokenizers are written from a vocabulary of characters (byte-level
BPE with no merges: every character a token, ``</w>`` marking a word's end); T5's is a Unigram
model trained with ``tokenizers`` on the captions given. Layer sizes follow diffusers' own tiny
test pipelines, widened where the real pipelines' arithmetic needs it (SD3 pads its two CLIPs'
states, side by side, to T5's width, so T5 is at least as wide).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

#: Tokens the tiny CLIP tokenizers take at most (the pipelines pad and truncate to it).
CLIP_TOKENS = 16
WIDTH = 32  # the text encoders' width
_CHARACTERS = string.ascii_lowercase + string.digits + ".,'!?-"


def clip_tokenizer() -> Any:
    """A byte-level BPE CLIP tokenizer over lower-case letters, digits and punctuation."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for character in _CHARACTERS:
        for token in (character, f"{character}</w>"):
            vocab[token] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_TOKENS)


def t5_tokenizer(captions: Iterable[str], max_length: int = 32) -> Any:
    """T5's tokenizer kind (Unigram, ``</s>`` at the end), trained on ``captions``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    model = Tokenizer(models.Unigram())
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=128, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    model.train_from_iterator([*captions, _CHARACTERS], trainer)
    vocab = [(piece, float(score)) for piece, score in json.loads(model.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _clip(projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=2 + 2 * len(_CHARACTERS),
        hidden_size=WIDTH,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_TOKENS,
        projection_dim=WIDTH,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(tokenizer: Any, width: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int, flow: bool) -> Any:
    from diffusers import AutoencoderKL

    extra = {"shift_factor": 0.0609, "scaling_factor": 1.5035} if flow else {"scaling_factor": 0.18215}
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        **extra,
    )


def _unet(cross_attention_dim: int, **extra: Any) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=8,
        **extra,
    )


def tiny_pipeline(family: str, captions: Iterable[str] = (), *, guidance_embeds: bool = False) -> Any:
    """A tiny pipeline of ``family`` (``unet2d_condition`` for SD 1.5, ``sdxl``, ``sd3``,
    ``flux``; FLUX.1-dev's guidance input with ``guidance_embeds``), its T5 tokenizer trained on
    ``captions``."""
    import diffusers

    torch.manual_seed(0)
    captions = list(captions) or ["a photo of a cat", "a painting of a dog"]
    if family == "unet2d_condition":
        return diffusers.StableDiffusionPipeline(
            vae=_vae(4, flow=False),
            text_encoder=_clip(projection=False),
            tokenizer=clip_tokenizer(),
            unet=_unet(WIDTH),
            scheduler=diffusers.PNDMScheduler(
                beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True, steps_offset=1
            ),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    if family == "sdxl":
        time_dim = 8
        return diffusers.StableDiffusionXLPipeline(
            vae=_vae(4, flow=False),
            text_encoder=_clip(projection=False),
            text_encoder_2=_clip(projection=True),
            tokenizer=clip_tokenizer(),
            tokenizer_2=clip_tokenizer(),
            unet=_unet(
                2 * WIDTH,
                addition_embed_type="text_time",
                addition_time_embed_dim=time_dim,
                projection_class_embeddings_input_dim=6 * time_dim + WIDTH,
            ),
            scheduler=diffusers.EulerDiscreteScheduler(
                beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
            ),
        )
    if family == "sd3":
        t5 = t5_tokenizer(captions)
        return diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(
                sample_size=16,
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                attention_head_dim=8,
                num_attention_heads=4,
                joint_attention_dim=2 * WIDTH,
                caption_projection_dim=32,
                pooled_projection_dim=2 * WIDTH,
                pos_embed_max_size=32,
            ),
            vae=_vae(4, flow=True),
            text_encoder=_clip(projection=True),
            text_encoder_2=_clip(projection=True),
            text_encoder_3=_t5(t5, 2 * WIDTH),
            tokenizer=clip_tokenizer(),
            tokenizer_2=clip_tokenizer(),
            tokenizer_3=t5,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
    if family == "flux":
        t5 = t5_tokenizer(captions)
        return diffusers.FluxPipeline(
            transformer=diffusers.FluxTransformer2DModel(
                patch_size=1,
                in_channels=16,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=WIDTH,
                pooled_projection_dim=WIDTH,
                guidance_embeds=guidance_embeds,
                axes_dims_rope=(4, 4, 8),
            ),
            vae=_vae(4, flow=True),
            text_encoder=_clip(projection=False),
            text_encoder_2=_t5(t5, WIDTH),
            tokenizer=clip_tokenizer(),
            tokenizer_2=t5,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        )
    raise ValueError(f"no tiny pipeline for family {family!r}: unet2d_condition, sdxl, sd3 or flux")


def write_tiny_pipeline(family: str, directory: str | Path, captions: Iterable[str] = (), **options: Any) -> Path:
    """:func:`tiny_pipeline` written with ``save_pretrained`` to ``directory``."""
    directory = Path(directory)
    tiny_pipeline(family, captions, **options).save_pretrained(directory)
    return directory


#: The captions :func:`write_captioned_images` gives its images (and T5 tokenizers train on).
CAPTIONS = ("a red cube on a table", "a blue ball on grass", "a green tree by a lake", "a yellow car at night")


def write_captioned_images(
    root: str | Path, sizes: Iterable[tuple[int, int]] = ((48, 32), (32, 48), (40, 40), (64, 32))
) -> Path:
    """A folder of random RGB images of ``sizes`` (width, height), half of them in a subfolder,
    each with a same-stem ``.txt`` caption from :data:`CAPTIONS`: what a user brings, tiny."""
    import numpy as np
    from PIL import Image

    root = Path(root)
    (root / "more").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index, (width, height) in enumerate(sizes):
        folder = root / "more" if index % 2 else root
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"image_{index}.png")
        (folder / f"image_{index}.txt").write_text(CAPTIONS[index % len(CAPTIONS)])
    return root
