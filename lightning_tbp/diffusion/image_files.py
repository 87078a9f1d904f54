"""Reading a user's image files as RGB, every mode converted as a viewer would show it.

PIL's ``convert("RGB")`` is wrong for several modes found in real datasets: a 16-bit grayscale
PNG (``I;16``, ``I``) is clipped to 8 bits (a photo reads near-white), transparency is dropped
(the hidden colour of transparent pixels shows), and a phone photo's EXIF orientation is
ignored (it trains sideways). Here: 16-bit and 32-bit integer data are scaled to 8 bits,
transparency (alpha, a palette's transparent index, ``LA``) is composited over a background,
EXIF orientation is applied, and CMYK/YCbCr/LAB go through PIL's converters. A file that cannot
be decoded raises :class:`UnreadableImageError` naming it and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

#: The suffixes taken as images when a folder is scanned.
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
#: What transparent pixels are composited over (white, as most trainers and viewers show them).
BACKGROUND = (255, 255, 255)


class UnreadableImageError(ValueError):
    """An image file that cannot be decoded (truncated, corrupt, not an image)."""


def load_rgb(source: str | Path | BinaryIO) -> Image.Image:
    """``source`` (a path, or a file's bytes) decoded fully as an 8-bit RGB image, upright (see
    the module's notes); :class:`UnreadableImageError` says why it cannot be."""
    try:
        with Image.open(source) as opened:
            opened.load()  # decode everything now: a truncated file fails here, not in a worker later
            image = ImageOps.exif_transpose(opened)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise UnreadableImageError(str(error) or type(error).__name__) from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """An 8-bit RGB copy of ``image``, whatever its mode."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return _scaled_to_bytes(image)
    if image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        top = float(values.max()) if values.size else 1.0
        scaled = np.clip(values / (top if top > 1.0 else 1.0) * 255.0, 0, 255).astype(np.uint8)
        return Image.fromarray(scaled, "L").convert("RGB")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif image.mode in ("L", "1") and "transparency" in image.info:
        image = image.convert("LA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _scaled_to_bytes(image: Image.Image) -> Image.Image:
    """A 16-bit (or 32-bit integer) grayscale image scaled to 8 bits by its type's range."""
    values = np.asarray(image).astype(np.float64)
    top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) <= 65535 else float(values.max())
    scaled = np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8)
    return Image.fromarray(scaled, "L").convert("RGB")


def to_pixels(image: Image.Image) -> torch.Tensor:
    """An 8-bit image (RGB or L) as a float ``[C, H, W]`` tensor in [-1, 1], as the models train on it."""
    array = np.asarray(image, dtype=np.float32)
    return torch.from_numpy(array.copy()).reshape(array.shape[0], array.shape[1], -1).permute(2, 0, 1) / 127.5 - 1.0
