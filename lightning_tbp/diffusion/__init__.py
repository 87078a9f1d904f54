"""Diffusion training with diffusers models: the LightningModule, data modules, sampling."""

from lightning_tbp.optional_imports import import_torchao_quietly

import_torchao_quietly()  # before diffusers and peft import it, and say so at length

from lightning_tbp.diffusion.captioned_data import CaptionedImagesDataModule  # noqa: E402
from lightning_tbp.diffusion.data import DigitsDataModule, ImageFolderDataModule, LatentsDataModule, images_in_batch  # noqa: E402
from lightning_tbp.diffusion.lora import LoraOptions, add_lora, load_lora, save_lora  # noqa: E402
from lightning_tbp.diffusion.models import FAMILIES, build_model, small_unet_config  # noqa: E402
from lightning_tbp.diffusion.module import DiffusionModule  # noqa: E402
from lightning_tbp.diffusion.sampling import sample, save_image_grid  # noqa: E402

__all__ = [
    "FAMILIES",
    "CaptionedImagesDataModule",
    "DiffusionModule",
    "DigitsDataModule",
    "ImageFolderDataModule",
    "LatentsDataModule",
    "LoraOptions",
    "add_lora",
    "build_model",
    "images_in_batch",
    "load_lora",
    "sample",
    "save_image_grid",
    "save_lora",
    "small_unet_config",
]
