"""Real images that need no network: scikit-learn's bundled handwritten digits.

The 1,797 digits are 8x8 grey images shipped inside scikit-learn; they are scaled to [-1, 1]
and resized to ``image_size`` so a U-Net with a few resolution levels can train on them.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def load_digits_images(image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """All digits as a float tensor [N, 1, S, S] in [-1, 1], and their labels [N]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the bundled digits data set comes with scikit-learn: pip install scikit-learn "
            "(or install lightning-tbp with the [dev] extra)"
        ) from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return images.clamp(0, 1) * 2 - 1, torch.tensor(digits.target)


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's handwritten digits as a diffusion training set (no download)."""

    def __init__(self, image_size: int = 32, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        if image_size < 8 or image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 and at least 8, got {image_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.image_size, self.batch_size, self.seed = image_size, batch_size, seed
        self.dataset: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is None:
            self.dataset = TensorDataset(*load_digits_images(self.image_size))

    def train_dataloader(self) -> DataLoader:
        assert self.dataset is not None
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=generator)
