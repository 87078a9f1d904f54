"""DDPM training of a diffusers ``UNet2DModel`` (epsilon prediction) as a LightningModule."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel


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


class DDPMModule(L.LightningModule):
    """Denoising diffusion training: predict the noise added at a random timestep."""

    def __init__(self, unet_config: dict[str, Any] | None = None, lr: float = 2e-4, num_train_timesteps: int = 1000):
        super().__init__()
        self.save_hyperparameters()
        self.unet = UNet2DModel(**(unet_config or small_unet_config()))
        self.scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        images = batch[0]
        noise = torch.randn_like(images)
        timesteps = torch.randint(0, self.scheduler.config.num_train_timesteps, (images.shape[0],), device=self.device)
        noisy = self.scheduler.add_noise(images, noise, timesteps)
        loss = F.mse_loss(self.unet(noisy, timesteps).sample, noise)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.unet.parameters(), lr=self.lr)
