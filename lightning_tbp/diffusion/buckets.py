"""Aspect-ratio buckets: every image trained near its own shape, at about the same pixel count.

Square crops throw away the sides of every landscape and portrait photo and teach the model to
frame that way. Instead each image goes to the bucket (a width and height, multiples of the
VAE's ``step``, with about ``resolution`` squared pixels) whose aspect ratio is nearest its own,
is scaled to cover it and centre-cropped to it; batches are drawn from one bucket at a time. The
crop's top-left corner and the original size are kept: SDXL takes them as conditioning
(``time_ids``). kohya, musubi and SimpleTuner bucket the same way (steps of 64 px for SD-class
VAEs, 16 for Flux-class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True, order=True)
class Bucket:
    width: int
    height: int

    @property
    def aspect(self) -> float:
        return self.width / self.height

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Placement:
    """How one image fills its bucket."""

    bucket: Bucket
    original_size: tuple[int, int]  # (height, width), as SDXL's time_ids take it
    crop_top_left: tuple[int, int]  # (top, left) of the crop in the scaled image


def bucket_sizes(resolution: int, step: int, max_aspect: float = 4.0) -> list[Bucket]:
    """Every bucket of at most ``resolution``² pixels whose sides are multiples of ``step`` and
    whose aspect ratio lies within ``max_aspect`` either way, the largest for each width."""
    if resolution < step or resolution % step:
        raise ValueError(f"resolution {resolution} must be a positive multiple of the bucket step {step}")
    if max_aspect < 1:
        raise ValueError(f"max_aspect must be >= 1, got {max_aspect}")
    area = resolution * resolution
    buckets = set()
    width = step
    while width <= resolution * max_aspect:
        height = min(area // width // step * step, int(width * max_aspect) // step * step)
        if height >= step and width / height <= max_aspect:
            buckets.add(Bucket(width, height))
        width += step
    return sorted(buckets, key=lambda b: (b.aspect, b.width))


def place(size: tuple[int, int], buckets: list[Bucket]) -> Placement:
    """The bucket for an image of ``size`` (width, height): nearest in log aspect ratio, then the
    largest; and where the centre crop of the image scaled to cover it starts."""
    width, height = size
    aspect = math.log(width / height)
    bucket = min(buckets, key=lambda b: (abs(math.log(b.aspect) - aspect), -b.width * b.height))
    scaled_w, scaled_h = _cover(size, bucket)
    return Placement(bucket, (height, width), ((scaled_h - bucket.height) // 2, (scaled_w - bucket.width) // 2))


def fill(image: Image.Image, placement: Placement) -> Image.Image:
    """``image`` scaled to cover its bucket (Lanczos) and cropped to it as ``placement`` says."""
    bucket = placement.bucket
    scaled = image.resize(_cover(image.size, bucket), Image.Resampling.LANCZOS)
    top, left = placement.crop_top_left
    return scaled.crop((left, top, left + bucket.width, top + bucket.height))


def _cover(size: tuple[int, int], bucket: Bucket) -> tuple[int, int]:
    """The smallest size of ``size``'s aspect that covers ``bucket``."""
    width, height = size
    scale = max(bucket.width / width, bucket.height / height)
    return max(bucket.width, round(width * scale)), max(bucket.height, round(height * scale))
