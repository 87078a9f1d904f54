"""A folder of captioned images, checked once before training.

Images are found recursively. Each caption comes from, in order: ``metadata.jsonl`` or
``metadata.csv`` in the root (Hugging Face's imagefolder layout: ``file_name`` relative to the
root, and ``text``), or the image's same-stem ``.txt`` file (kohya's layout). Every image is
decoded here, before the first step: one that cannot be read is named and skipped (or, with
``unreadable="error"``, refused), so a corrupt file never stops a run at step 9. A missing
caption is named and, as configured, trained with an empty caption, skipped, or refused. Each
entry carries the hash of its file's bytes: the cache keys on content, never on position.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from tqdm.auto import tqdm

from lightning_tbp.diffusion.image_files import IMAGE_SUFFIXES, UnreadableImageError, load_rgb

Unreadable = Literal["skip", "error"]
MissingCaption = Literal["empty", "skip", "error"]
METADATA_FILES = ("metadata.jsonl", "metadata.csv")


class DatasetError(ValueError):
    """The image folder cannot be trained as configured (named files, and the option that changes it)."""


@dataclass(frozen=True)
class Entry:
    path: Path
    caption: str
    size: tuple[int, int]  # (width, height), upright
    content_hash: str  # sha256 of the file's bytes


@dataclass
class FolderScan:
    root: Path
    entries: list[Entry] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # skipped, and why
    uncaptioned: list[Path] = field(default_factory=list)  # handled as ``missing_caption`` says

    def summary(self) -> str:
        parts = [f"{len(self.entries)} images"]
        if self.unreadable:
            parts.append(f"{len(self.unreadable)} unreadable skipped")
        if self.uncaptioned:
            parts.append(f"{len(self.uncaptioned)} without a caption")
        return f"{self.root}: " + ", ".join(parts)


def image_files(root: Path) -> Iterator[Path]:
    """Image files under ``root``, recursively, in a stable order (hidden folders skipped)."""
    for path in sorted(root.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
        if path.is_file() and not hidden and path.suffix.lower() in IMAGE_SUFFIXES:
            yield path


def metadata_captions(root: Path) -> dict[Path, str] | None:
    """Captions from the root's ``metadata.jsonl`` or ``metadata.csv`` (None: neither exists)."""
    jsonl, table = root / METADATA_FILES[0], root / METADATA_FILES[1]
    rows: list[dict[str, str]]
    if jsonl.is_file():
        rows = []
        for number, line in enumerate(jsonl.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DatasetError(f"{jsonl}:{number} is not a JSON object ({error})") from None
        source = jsonl
    elif table.is_file():
        with table.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        source = table
    else:
        return None
    captions: dict[Path, str] = {}
    for number, row in enumerate(rows, 1):
        if "file_name" not in row or "text" not in row:
            raise DatasetError(f"{source} row {number} needs 'file_name' and 'text' (the imagefolder layout): {row}")
        captions[(root / row["file_name"]).resolve()] = str(row["text"]).strip()
    return captions


def scan_folder(
    root: str | Path, unreadable: Unreadable = "skip", missing_caption: MissingCaption = "empty"
) -> FolderScan:
    """Every image under ``root`` with its caption, decoded once (see the module's notes)."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root} is not a folder of images")
    from_metadata = metadata_captions(root)
    scan = FolderScan(root)
    files = list(image_files(root))
    if not files:
        raise DatasetError(f"{root} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}), in any subfolder")
    for path in tqdm(files, desc="checking images", unit="img", leave=False):
        data = path.read_bytes()
        try:
            image = load_rgb(io.BytesIO(data))
        except UnreadableImageError as error:
            if unreadable == "error":
                raise DatasetError(
                    f"{path} cannot be decoded ({error}); remove it, or pass unreadable='skip'"
                ) from None
            scan.unreadable.append((path, str(error)))
            continue
        caption = _caption(path, from_metadata)
        if caption is None:
            scan.uncaptioned.append(path)
            if missing_caption == "error":
                raise DatasetError(
                    f"{path} has no caption (no {path.with_suffix('.txt').name}"
                    f"{', no row in the metadata file' if from_metadata is not None else ''}); add one, or pass "
                    "missing_caption='empty' (train it unconditioned) or 'skip'"
                )
            if missing_caption == "skip":
                continue
            caption = ""
        scan.entries.append(Entry(path, caption, image.size, hashlib.sha256(data).hexdigest()))
    if scan.unreadable:
        named = "; ".join(f"{path} ({why})" for path, why in scan.unreadable[:5])
        more = f" and {len(scan.unreadable) - 5} more" if len(scan.unreadable) > 5 else ""
        rank_zero_warn(f"skipping {len(scan.unreadable)} unreadable image(s): {named}{more}")
    if scan.uncaptioned and missing_caption != "error":
        how = "trained with an empty caption" if missing_caption == "empty" else "skipped"
        named = ", ".join(str(path) for path in scan.uncaptioned[:5])
        more = f" and {len(scan.uncaptioned) - 5} more" if len(scan.uncaptioned) > 5 else ""
        rank_zero_warn(f"{len(scan.uncaptioned)} image(s) have no caption, {how}: {named}{more}")
    if not scan.entries:
        raise DatasetError(f"{scan.summary()}: nothing left to train")
    return scan


def _caption(path: Path, from_metadata: dict[Path, str] | None) -> str | None:
    if from_metadata is not None:
        caption = from_metadata.get(path.resolve())
        if caption is not None:
            return caption
    text = path.with_suffix(".txt")
    return text.read_text(encoding="utf-8").strip() if text.is_file() else None
