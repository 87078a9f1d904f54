"""Diffusion training pieces: data that ships with installed packages and a DDPM LightningModule."""

from lightning_tbp.diffusion.data import DigitsDataModule
from lightning_tbp.diffusion.ddpm import DDPMModule, small_unet_config

__all__ = ["DDPMModule", "DigitsDataModule", "small_unet_config"]
