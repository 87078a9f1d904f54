"""Latents and text embeddings computed once, kept on disk, keyed by what they were made from.

Training runs neither the VAE nor the text encoders: each image's latents and each caption's
embeddings are encoded once, before the first step, and read from disk after. Keys are content,
never position (a cache indexed by step pairs the wrong latents with captions once the loader
shuffles, diffusers #14430): a latent's key hashes the image's bytes, its bucket and crop, and
the VAE's identity; a caption's, its text and the text encoders' identity
(``pipelines.components_identity``). So a second run encodes nothing, a changed image or caption
re-encodes only itself, and a cache made by another model is never read. Each entry is one
safetensors file, written to a temporary name and renamed: a run killed mid-write leaves no file
that reads as whole.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from tqdm.auto import tqdm


def entry_key(*parts: object) -> str:
    """A file name for what ``parts`` describe (a short sha256 of their text)."""
    return hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).hexdigest()[:32]


class EncodingCache:
    """One folder of entries (``latents/<key>.safetensors``, ``text/<key>.safetensors``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def write(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one entry atomically (a temporary file, renamed over the final name)."""
        path = self.path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        safetensors.torch.save_file({name: t.contiguous() for name, t in tensors.items()}, str(partial))
        os.replace(partial, path)

    def read(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        return safetensors.torch.load_file(str(self.path(kind, key)))

    def fill(
        self,
        kind: str,
        wanted: Iterable[tuple[str, Any]],
        encode: Callable[[list[Any]], list[dict[str, torch.Tensor]]],
        batch_size: int,
        describe: str,
    ) -> tuple[int, float]:
        """Encode and write every ``(key, source)`` of ``wanted`` not cached yet, ``batch_size``
        sources per call of ``encode`` (which returns one entry per source); returns how many
        were encoded and the seconds it took. A progress bar shows the rate."""
        missing = [(key, source) for key, source in dict(wanted).items() if not self.has(kind, key)]
        if not missing:
            return 0, 0.0
        started = time.perf_counter()
        with tqdm(total=len(missing), desc=describe, unit="item") as bar:
            for first in range(0, len(missing), batch_size):
                chunk = missing[first : first + batch_size]
                for (key, _), tensors in zip(chunk, encode([source for _, source in chunk]), strict=True):
                    self.write(kind, key, tensors)
                bar.update(len(chunk))
        return len(missing), time.perf_counter() - started
