"""What each text-to-image pipeline family brings to fine-tuning, read from diffusers, not re-derived.

A user arrives with a local pipeline folder (SD 1.5, SDXL, SD3, Flux). From it the data side
needs the VAE (latents, with the VAE's own ``scaling_factor`` and ``shift_factor``) and the
pipeline's text encoders, run through the pipeline's own ``encode_prompt`` (two CLIPs and the
pooled embedding for SDXL, three encoders for SD3, CLIP pooled and T5 for Flux: each pipeline's
text handling is reused as diffusers wrote it); the export side the pipeline's
``save_lora_weights``, which writes the component prefix ``load_lora_weights`` looks for. This
module holds, per ``DiffusionModule`` family, the few facts that tie those together.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Files whose bytes identify a component (its weights are identified by size and first MiB).
_CONFIG_SUFFIXES = frozenset({".json", ".txt", ".model"})
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth"})


@dataclass(frozen=True)
class PipelineKind:
    """A text-to-image pipeline family as fine-tuning uses it."""

    family: str  # the ``DiffusionModule`` family that trains its denoiser
    pipeline_class: str  # diffusers' pipeline class
    denoiser: str  # the pipeline component trained: "unet" or "transformer"
    native_resolution: int  # the side of the pixel area its released models train at
    bucket_step: int  # sides are multiples of this (the VAE's factor times the denoiser's own)
    #: ``encode_prompt``'s outputs, in order, as the batch keys they become (None: not used)
    text_outputs: tuple[str | None, ...]
    #: the text components ``encode_prompt`` runs (their files identify a text cache)
    text_components: tuple[str, ...]

    def pipeline_type(self) -> Any:
        import diffusers

        return getattr(diffusers, self.pipeline_class)


KINDS = {
    kind.family: kind
    for kind in (
        PipelineKind(
            "unet2d_condition",
            "StableDiffusionPipeline",
            "unet",
            512,
            64,
            ("encoder_hidden_states", None),
            ("text_encoder", "tokenizer"),
        ),
        PipelineKind(
            "sdxl",
            "StableDiffusionXLPipeline",
            "unet",
            1024,
            64,
            ("encoder_hidden_states", None, "text_embeds", None),
            ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
        ),
        PipelineKind(
            "sd3",
            "StableDiffusion3Pipeline",
            "transformer",
            1024,
            16,
            ("encoder_hidden_states", None, "pooled_projections", None),
            ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"),
        ),
        PipelineKind(
            "flux",
            "FluxPipeline",
            "transformer",
            1024,
            16,
            ("encoder_hidden_states", "pooled_projections", None),
            ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
        ),
    )
}


def pipeline_kind(family: str) -> PipelineKind:
    """The pipeline family a ``DiffusionModule`` family fine-tunes, or a ValueError naming them."""
    if family not in KINDS:
        raise ValueError(
            f"family {family!r} has no text-to-image pipeline to take captions and a VAE from; captioned image "
            f"folders train {', '.join(sorted(KINDS))}"
        )
    return KINDS[family]


def pipeline_folder(path: str | Path, kind: PipelineKind) -> Path:
    """``path`` checked as a local pipeline folder of ``kind`` (model_index.json, a VAE, the text
    components), or a FileNotFoundError naming what is missing."""
    folder = Path(path)
    index = folder / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"{folder} is not a diffusers pipeline folder (no model_index.json): captioned images need the pipeline's "
            "VAE and text encoders; give the folder diffusers' save_pretrained wrote (no hub downloads at run time)"
        )
    declared = json.loads(index.read_text()).get("_class_name")
    if declared != kind.pipeline_class:
        raise ValueError(f"{folder} holds a {declared}, but family {kind.family!r} fine-tunes a {kind.pipeline_class}")
    missing = [name for name in ("vae", *kind.text_components) if not (folder / name).is_dir()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks the pipeline component(s) {', '.join(missing)}")
    return folder


def components_identity(folder: Path, names: tuple[str, ...]) -> str:
    """A hash of the components ``names`` of a pipeline folder as their files stand: the bytes of
    their configs and vocabularies, the size and first MiB of their weights. A cache keyed by it
    is never read for another model (or another version of these weights)."""
    digest = hashlib.sha256()
    for name in names:
        for path in sorted((folder / name).rglob("*")):
            if not path.is_file():
                continue
            digest.update(str(path.relative_to(folder)).encode())
            if path.suffix in _CONFIG_SUFFIXES:
                digest.update(path.read_bytes())
            elif path.suffix in _WEIGHT_SUFFIXES:
                digest.update(str(path.stat().st_size).encode())
                with path.open("rb") as handle:
                    digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


def load_encoders(folder: Path, kind: PipelineKind, device: torch.device, dtype: torch.dtype) -> Any:
    """The pipeline of ``folder`` without its denoiser: the VAE, the text encoders and their
    tokenizers, on ``device`` in ``dtype`` and in eval mode, loaded from local files only."""
    pipeline = kind.pipeline_type().from_pretrained(
        folder, **{kind.denoiser: None}, torch_dtype=dtype, local_files_only=True
    )
    pipeline.to(device)
    for name in ("vae", *kind.text_components):
        component = getattr(pipeline, name, None)
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    return pipeline


@torch.no_grad()
def encode_captions(
    pipeline: Any, kind: PipelineKind, captions: list[str], max_sequence_length: int | None = None
) -> dict[str, torch.Tensor]:
    """The pipeline's own ``encode_prompt`` on ``captions`` (no classifier-free guidance pair), as
    the batch keys of :attr:`PipelineKind.text_outputs`, on the CPU in float32."""
    accepted = inspect.signature(pipeline.encode_prompt).parameters
    arguments: dict[str, Any] = {"prompt": captions, "device": pipeline.device, "num_images_per_prompt": 1}
    if "do_classifier_free_guidance" in accepted:
        arguments["do_classifier_free_guidance"] = False
    for extra in ("prompt_2", "prompt_3"):  # the same captions for every encoder
        if extra in accepted:
            arguments[extra] = None
    if max_sequence_length is not None and "max_sequence_length" in accepted:
        arguments["max_sequence_length"] = max_sequence_length
    outputs = pipeline.encode_prompt(**arguments)
    return {key: value.float().cpu() for key, value in zip(kind.text_outputs, outputs, strict=False) if key}


@torch.no_grad()
def encode_images(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Latents of ``pixels`` ([B, 3, H, W] in [-1, 1]) as the pipelines scale them: the mean of the
    VAE's distribution, less its ``shift_factor`` (SD3, Flux), times its ``scaling_factor``; on
    the CPU in float32."""
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((latents - shift) * vae.config.scaling_factor).float().cpu()


def _config(folder: Path, name: str) -> dict[str, Any]:
    for file in ("config.json", "tokenizer_config.json"):
        path = folder / name / file
        if path.is_file():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"{folder / name} has no config.json or tokenizer_config.json")


def _tokens(folder: Path, name: str, cap: int | None = None) -> int:
    length = int(_config(folder, name).get("model_max_length", 77))
    return length if cap is None else cap


def _width(config: dict[str, Any]) -> int:
    width = config.get("hidden_size") or config.get("d_model")
    if width is None:
        raise ValueError(f"a text encoder's config names neither hidden_size nor d_model: {sorted(config)}")
    return int(width)


def conditioning_shapes(
    folder: Path, kind: PipelineKind, max_sequence_length: int | None
) -> dict[str, tuple[int, ...]]:
    """Per-sample shapes of the text conditioning ``encode_prompt`` gives, from the components'
    configs alone (``tbp estimate`` sizes a step without running the encoders)."""
    if kind.family == "unet2d_condition":
        return {"encoder_hidden_states": (_tokens(folder, "tokenizer"), _width(_config(folder, "text_encoder")))}
    first, second = _config(folder, "text_encoder"), _config(folder, "text_encoder_2")
    if kind.family == "sdxl":
        tokens = _tokens(folder, "tokenizer")
        return {
            "encoder_hidden_states": (tokens, _width(first) + _width(second)),
            "text_embeds": (int(second["projection_dim"]),),
            "time_ids": (6,),
        }
    if kind.family == "sd3":
        t5 = _width(_config(folder, "text_encoder_3"))
        tokens = _tokens(folder, "tokenizer") + (max_sequence_length or 256)
        return {
            "encoder_hidden_states": (tokens, t5),
            "pooled_projections": (int(first["projection_dim"]) + int(second["projection_dim"]),),
        }
    return {  # flux: T5's states, CLIP's pooled output (a CLIPTextModel's, of its width)
        "encoder_hidden_states": (max_sequence_length or 512, _width(second)),
        "pooled_projections": (_width(first),),
    }


def latent_shape(folder: Path, side: tuple[int, int]) -> tuple[int, int, int]:
    """The latents' per-sample shape for an image of ``side`` (width, height): the VAE's channels
    at its downsampling factor."""
    vae = _config(folder, "vae")
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    width, height = side
    return int(vae["latent_channels"]), height // factor, width // factor
