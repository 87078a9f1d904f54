"""Training data for the diffusion recipes: a local image folder, digits that ship with
scikit-learn, or a file of precomputed latents and text embeddings.

Batches are dicts: ``images`` (float [B, C, S, S]: pixels in [-1, 1], or latents), ``labels``
(long [B]) and, when the data carries precomputed conditioning, its tensors
(``encoder_hidden_states`` [B, T, D] for ``UNet2DConditionModel``; SD3's also
``pooled_projections`` [B, P]).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset, random_split
from typing_extensions import override

from lightning_tbp.diffusion.image_files import IMAGE_SUFFIXES, UnreadableImageError, load_rgb, to_pixels


def images_in_batch(batch: dict[str, Any]) -> int:
    """Samples in a batch (for Lightning's ``ThroughputMonitor(batch_size_fn=...)``)."""
    return batch["images"].shape[0]


class _DictDataset(Dataset):
    """Tensors indexed together, returned as a dict per sample."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.tensors.items()}


class _SplitDataModule(L.LightningDataModule):
    """Shared loaders: a seeded train/validation split of one dataset."""

    def __init__(self, batch_size: int, val_fraction: float, num_workers: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.batch_size, self.val_fraction, self.num_workers, self.seed = batch_size, val_fraction, num_workers, seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _dataset(self) -> Dataset:
        raise NotImplementedError

    def _conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sample shapes of the batch's conditioning tensors besides images and labels."""
        return {}

    def example_batch(self) -> dict[str, torch.Tensor]:
        """A training batch's shapes and dtypes without reading any data (``tbp estimate`` builds
        it under fake tensors): zeros, ``batch_size`` samples."""
        size, channels, n = self.image_size, self.channels, self.batch_size
        batch = {"images": torch.zeros(n, channels, size, size), "labels": torch.zeros(n, dtype=torch.long)}
        batch.update({key: torch.zeros(n, *shape) for key, shape in self._conditioning_shapes().items()})
        return batch

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        dataset = self._dataset()
        n_val = int(len(dataset) * self.val_fraction)
        if self.val_fraction > 0 and n_val == 0:
            n_val = 1
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = random_split(dataset, [len(dataset) - n_val, n_val], generator=generator)

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle and len(dataset) >= self.batch_size,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if not self.val_set or len(self.val_set) == 0:
            return []
        return self._loader(self.val_set, shuffle=False)


def load_digits_images(image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as a float tensor [N, 1, S, S] in [-1, 1], and their labels [N]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError("the bundled digits data set comes with scikit-learn: pip install scikit-learn") from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return images.clamp(0, 1) * 2 - 1, torch.tensor(digits.target)


class DigitsDataModule(_SplitDataModule):
    """scikit-learn's 8x8 handwritten digits (real images, no download), resized; labels 0-9."""

    num_classes = 10
    channels = 1

    def __init__(
        self, image_size: int = 32, batch_size: int = 32, val_fraction: float = 0.1, num_workers: int = 0, seed: int = 0
    ) -> None:
        super().__init__(batch_size, val_fraction, num_workers, seed)
        if image_size < 8 or image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 and at least 8, got {image_size}")
        self.image_size = image_size

    def _dataset(self) -> Dataset:
        images, labels = load_digits_images(self.image_size)
        return _DictDataset(images=images, labels=labels)


class LatentsDataModule(_SplitDataModule):
    """Precomputed latents and conditioning from one file, as latent-diffusion fine-tunes train
    (the VAE and the text encoders run once, beforehand, not in every step).

    Args:
        path: a ``torch.save``'d dict of tensors with one row per sample: ``latents``
            [N, C, S, S] as the model trains on them (the VAE's shift and scale applied), and the
            conditioning the model's family takes (SD3: ``encoder_hidden_states`` [N, T, D],
            ``pooled_projections`` [N, P]); ``labels`` [N] if any. It is memory-mapped, not read
            whole.
    """

    def __init__(
        self, path: str, batch_size: int = 8, val_fraction: float = 0.1, num_workers: int = 0, seed: int = 0
    ) -> None:
        super().__init__(batch_size, val_fraction, num_workers, seed)
        self.path = path
        self._tensors: dict[str, torch.Tensor] | None = None

    def _load(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            if not Path(self.path).is_file():
                raise FileNotFoundError(f"latents file {self.path!r} does not exist")
            tensors = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(tensors, dict) or "latents" not in tensors:
                raise ValueError(f"{self.path!r} must hold a dict of tensors with 'latents' [N, C, S, S]")
            rows = {key: len(value) for key, value in tensors.items()}
            if len(set(rows.values())) != 1:
                raise ValueError(f"every tensor in {self.path!r} needs one row per sample; rows: {rows}")
            self._tensors = tensors
        return self._tensors

    def _dataset(self) -> Dataset:
        tensors = dict(self._load())
        latents = tensors.pop("latents")
        labels = tensors.pop("labels", torch.zeros(len(latents), dtype=torch.long))
        return _DictDataset(images=latents, labels=labels, **tensors)

    @override
    def example_batch(self) -> dict[str, torch.Tensor]:
        tensors = self._load()
        batch = {
            "images" if key == "latents" else key: torch.zeros(self.batch_size, *value.shape[1:], dtype=value.dtype)
            for key, value in tensors.items()
        }
        batch.setdefault("labels", torch.zeros(self.batch_size, dtype=torch.long))
        return batch


class ImageFolder(Dataset):
    """Images under ``root``; one level of subfolders, if present, names the classes (sorted)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        image_size: int,
        channels: int = 3,
        random_flip: bool = True,
        center_crop: bool = True,
        embeddings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {str(self.root)!r} does not exist (or is not a directory)")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
        self.image_size, self.channels = image_size, channels
        self.random_flip, self.center_crop = random_flip, center_crop
        subfolders = sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        self.classes = [p.name for p in subfolders] or [""]
        self.files: list[tuple[Path, int]] = []
        for label, folder in enumerate(subfolders or [self.root]):
            for path in sorted(folder.iterdir()):
                if path.name.startswith(".") or path.is_dir():
                    continue
                if path.suffix.lower() not in IMAGE_SUFFIXES:
                    raise ValueError(
                        f"{path} is not an image file (accepted suffixes: {', '.join(sorted(IMAGE_SUFFIXES))}); "
                        "move it out of the image folder"
                    )
                self.files.append((path, label))
        if not self.files:
            raise ValueError(f"image folder {str(self.root)!r} holds no images (looked for {sorted(IMAGE_SUFFIXES)})")
        self.embeddings = None
        if embeddings is not None:
            missing = [name for name in self.classes if name not in embeddings]
            if missing:
                raise ValueError(f"the embeddings file has no entry for classes {missing}")
            self.embeddings = [embeddings[name] for name in self.classes]

    def __len__(self) -> int:
        return len(self.files)

    def _load(self, path: Path) -> torch.Tensor:
        try:
            image = load_rgb(path)
        except UnreadableImageError as error:
            raise ValueError(f"cannot read image {path}: {error}") from error
        if self.channels == 1:
            image = image.convert("L")
        scale = self.image_size / min(image.size)
        size = (max(self.image_size, round(image.width * scale)), max(self.image_size, round(image.height * scale)))
        pixels = to_pixels(image.resize(size, Image.Resampling.BICUBIC))
        height, width = pixels.shape[1:]
        if self.center_crop:
            top, left = (height - self.image_size) // 2, (width - self.image_size) // 2
        else:
            top = int(torch.randint(0, height - self.image_size + 1, ()))
            left = int(torch.randint(0, width - self.image_size + 1, ()))
        pixels = pixels[:, top : top + self.image_size, left : left + self.image_size]
        if self.random_flip and torch.rand(()) < 0.5:
            pixels = pixels.flip(-1)
        return pixels

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        path, label = self.files[index]
        sample = {"images": self._load(path), "labels": torch.tensor(label)}
        if self.embeddings is not None:
            sample["encoder_hidden_states"] = self.embeddings[label]
        return sample


class ImageFolderDataModule(_SplitDataModule):
    """Any local folder of images (optional class subfolders as labels), resized, cropped, flipped.

    Args:
        root: the folder. Images directly inside it get label 0; with subfolders, each subfolder
            is a class (sorted by name) and files directly in ``root`` are ignored.
        embeddings: a ``torch.save``'d dict class name -> tensor [T, D] of precomputed
            conditioning (e.g. text-encoder states of a prompt per class), for
            ``UNet2DConditionModel``; an unlabelled folder's class name is ``""``.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 64,
        batch_size: int = 16,
        channels: int = 3,
        random_flip: bool = True,
        center_crop: bool = True,
        val_fraction: float = 0.0,
        embeddings: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, val_fraction, num_workers, seed)
        if image_size < 8:
            raise ValueError(f"image_size must be at least 8, got {image_size}")
        self.root, self.image_size, self.channels = root, image_size, channels
        self.random_flip, self.center_crop, self.embeddings = random_flip, center_crop, embeddings
        self.num_classes: int | None = None

    def _dataset(self) -> Dataset:
        embeddings = None
        if self.embeddings is not None:
            if not Path(self.embeddings).is_file():
                raise FileNotFoundError(f"embeddings file {self.embeddings!r} does not exist")
            embeddings = torch.load(self.embeddings, map_location="cpu", weights_only=True)
        dataset = ImageFolder(
            self.root, self.image_size, self.channels, self.random_flip, self.center_crop, embeddings=embeddings
        )
        self.num_classes = len(dataset.classes)
        return dataset

    @override
    def _conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.embeddings is None:
            return {}
        embeddings = torch.load(self.embeddings, map_location="cpu", weights_only=True)
        return {"encoder_hidden_states": tuple(next(iter(embeddings.values())).shape)}
