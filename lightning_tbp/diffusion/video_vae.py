"""Fine-tune a video VAE (diffusers' ``AutoencoderKLWan``) on reconstruction.

Wan's VAE encodes a clip chunk by chunk over time (the first frame, then four frames at a time)
and decodes it latent frame by latent frame; each call of its causal blocks reads the last frames
the call before it left in a feature cache. The step's memory is every chunk's activations, and
under ``Trainer(strategy=TinyBackpropStrategy())`` each call of each block is a block of the plan
of its own (``unet.mid_block#3``-style keys: ``remat/trace.py``), planned against the budget like
any other; a recomputed call reads the cache as it was when it first ran.

The usual fine-tune trains the decoder alone (sharper reconstructions from latents a diffusion
model already uses; the encoder, frozen, keeps them), ``train="all"`` the whole autoencoder with
a KL term. :class:`MovingSquares` makes clips from a seed, so tests and the recipe need no data
download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from diffusers import AutoencoderKLWan
from torch import nn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_tbp.diffusion.models import model_directory
from lightning_tbp.optim.choice import OptimizerName, make_optimizer
from lightning_tbp.strategies.privacy import wants_per_sample_loss


def tiny_wan_vae_config(channels: int = 3) -> dict[str, Any]:
    """An ``AutoencoderKLWan`` of a few hundred thousand parameters with Wan's structure (causal
    3-D convolutions, temporal downsampling in its second stage, the feature cache)."""
    return {
        "base_dim": 16,
        "z_dim": 4,
        "dim_mult": [1, 2, 2],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True],
        "latents_mean": [0.0] * 4,
        "latents_std": [1.0] * 4,
        "in_channels": channels,
        "out_channels": channels,
    }


def load_video_vae(config: dict[str, Any] | None, pretrained: str | None) -> Any:
    """``AutoencoderKLWan`` from a local folder (the VAE's own, or a pipeline's with a ``vae``
    subfolder), else a fresh one of ``config`` (default :func:`tiny_wan_vae_config`)."""
    if pretrained is None:
        return AutoencoderKLWan(**(config or tiny_wan_vae_config()))
    if config is not None:
        raise ValueError("pass vae_config or pretrained, not both: a pretrained VAE brings its own config")
    try:
        directory = model_directory(pretrained, "vae")
    except FileNotFoundError as error:
        raise ValueError(f"{pretrained} holds no diffusers model: {error}") from error
    # in train mode: from_pretrained returns eval mode, which Lightning keeps for submodules
    return AutoencoderKLWan.from_pretrained(directory, local_files_only=True).train()


class Autoencoding(nn.Module):
    """A clip through the VAE and back, as one module (the strategy's default target): the
    reconstruction and each clip's KL divergence from the prior (zeros where the encoder is
    frozen: the decoder's fine-tune has no use for it)."""

    def __init__(self, vae: AutoencoderKLWan, sample_posterior: bool) -> None:
        super().__init__()
        self.vae: Any = vae  # diffusers' model classes read as lazily imported names to a type checker
        self.sample_posterior = sample_posterior

    @override
    def forward(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        posterior = self.vae.encode(video).latent_dist
        latents = posterior.sample() if self.sample_posterior else posterior.mode()
        reconstruction = self.vae.decode(latents).sample
        if any(p.requires_grad for p in self.vae.encoder.parameters()):
            kl = posterior.kl().flatten(1).sum(1)
        else:
            kl = reconstruction.new_zeros(video.shape[0])
        return reconstruction, kl


class MovingSquares(Dataset):
    """``length`` clips of ``frames`` frames: a bright square crossing a dark frame on a straight
    line, in [-1, 1], shape ``[channels, frames, size, size]``; the same clip for an index in
    every epoch (its path, size and colour drawn from ``seed`` and the index)."""

    def __init__(self, length: int, frames: int = 5, size: int = 32, channels: int = 3, seed: int = 0) -> None:
        if frames < 1 or size < 4:
            raise ValueError(f"clips need at least one frame and 4 pixels a side, got {frames} frames of {size}")
        self.length, self.frames, self.size, self.channels, self.seed = length, frames, size, channels, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        side = int(torch.randint(2, max(3, self.size // 3), (), generator=generator))
        start = torch.randint(0, self.size - side + 1, (2,), generator=generator)
        end = torch.randint(0, self.size - side + 1, (2,), generator=generator)
        colour = torch.rand(self.channels, generator=generator) * 2 - 1
        clip = torch.full((self.channels, self.frames, self.size, self.size), -1.0)
        for frame in range(self.frames):
            at = start + (end - start) * frame // max(1, self.frames - 1)
            row, column = int(at[0]), int(at[1])
            clip[:, frame, row : row + side, column : column + side] = colour[:, None, None]
        return clip


class VideoVAEFineTuneModule(L.LightningModule):
    """Fine-tune ``AutoencoderKLWan`` on reconstruction: mean absolute error per clip, plus
    ``kl_weight`` times its KL divergence where the encoder trains.

    Args:
        vae_config: a fresh VAE's ``AutoencoderKLWan`` arguments (default :func:`tiny_wan_vae_config`).
        pretrained: a local folder with the VAE (or a pipeline with a ``vae`` subfolder).
        train: ``"decoder"`` (the encoder frozen, its latents unchanged) or ``"all"``.
        kl_weight: of the KL term (``train="all"`` only).
        sample_posterior: decode a sample of the posterior (else its mean).
        lr, weight_decay, optimizer: as ``DiffusionModule``.
        export_dir: write the fine-tuned VAE here (``save_pretrained``) at the end of fit.
    """

    def __init__(
        self,
        vae_config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        train: Literal["decoder", "all"] = "decoder",
        kl_weight: float = 1e-6,
        sample_posterior: bool = True,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        optimizer: OptimizerName = "adamw",
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        if train not in ("decoder", "all"):
            raise ValueError(f"train must be 'decoder' or 'all', got {train!r}")
        self.save_hyperparameters()
        vae = load_video_vae(vae_config, pretrained)
        if train == "decoder":
            vae.encoder.requires_grad_(False)
            vae.quant_conv.requires_grad_(False)
        self.autoencoding = Autoencoding(vae, sample_posterior)
        self.kl_weight, self.optimizer_name, self.lr, self.weight_decay = kl_weight, optimizer, lr, weight_decay
        self.export_dir = export_dir

    @property
    def vae(self) -> Any:
        """The ``AutoencoderKLWan`` being fine-tuned."""
        return self.autoencoding.vae

    def losses(self, video: torch.Tensor) -> torch.Tensor:
        """Per-clip losses of a batch of clips ``[B, C, T, H, W]``, shape [B]."""
        reconstruction, kl = self.autoencoding(video)
        return (reconstruction - video).abs().flatten(1).mean(1) + self.kl_weight * kl

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        losses = self.losses(batch)
        self.log("train/loss", losses.mean().detach(), prog_bar=True)
        return losses if wants_per_sample_loss(self._trainer) else losses.mean()

    @override
    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.vae.parameters() if p.requires_grad]
        return make_optimizer(self.optimizer_name, trainable, self.lr, self.weight_decay)

    @override
    def on_fit_end(self) -> None:
        if self.export_dir is not None and self.trainer.is_global_zero:
            self.vae.save_pretrained(Path(self.export_dir))
