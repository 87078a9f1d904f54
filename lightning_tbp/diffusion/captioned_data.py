"""``CaptionedImagesDataModule``: a folder of captioned images as cached latents and text embeddings.

The fine-tuner's own data, in one step: ``prepare_data`` checks the folder
(``captioned_folder.py``: every image decoded, captions paired, unreadable files named and
skipped), places each image in an aspect-ratio bucket (``buckets.py``), and encodes what the
cache lacks (``encoding_cache.py``) with the pipeline's own VAE and ``encode_prompt``
(``pipelines.py``); the encoders then leave the device before training. ``setup`` reads the
manifest it wrote; batches come from one bucket at a time, as dicts the ``DiffusionModule``
family takes (``images``: latents; ``encoder_hidden_states``; SDXL's ``text_embeds`` and
``time_ids``; SD3's and Flux's ``pooled_projections``). Caption dropout swaps in the empty
caption's embeddings, for classifier-free guidance. Under DP, whose Poisson batches mix any
images, every image is trained at the one square bucket of the resolution.

The pipeline folder and family are the ``DiffusionModule``'s (``pretrained``, ``family``) unless
given here, so one command names each once:
``tbp fit -c configs/finetune_sdxl_lora.yaml --model.init_args.pretrained=PIPE --data.init_args.root=IMAGES``.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

from lightning_tbp.diffusion.buckets import Bucket, Placement, bucket_sizes, fill, place
from lightning_tbp.diffusion.captioned_folder import MissingCaption, Unreadable, scan_folder
from lightning_tbp.diffusion.encoding_cache import EncodingCache, entry_key
from lightning_tbp.diffusion.image_files import load_rgb, to_pixels
from lightning_tbp.diffusion.pipelines import (
    PipelineKind,
    components_identity,
    conditioning_shapes,
    encode_captions,
    encode_images,
    latent_shape,
    load_encoders,
    pipeline_folder,
    pipeline_kind,
)
from lightning_tbp.strategies.privacy import wants_per_sample_loss

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Record:
    """One training image as the cache holds it."""

    path: str
    latents: str  # its latents' cache key
    text: str  # its caption's cache key
    width: int  # its bucket
    height: int
    original_size: tuple[int, int]  # (height, width) before scaling, as SDXL's time_ids take it
    crop_top_left: tuple[int, int]


class _Cached(Dataset):
    def __init__(self, cache: EncodingCache, records: list[Record], empty_text: str | None, dropout: float) -> None:
        self.cache, self.records, self.empty_text, self.dropout = cache, records, empty_text, dropout

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        record = self.records[index]
        text = record.text
        if self.empty_text is not None and float(torch.rand(())) < self.dropout:
            text = self.empty_text
        sample = {"images": self.cache.read("latents", record.latents)["latents"]}
        sample.update(self.cache.read("text", text))
        sample["time_ids"] = torch.tensor(
            [*record.original_size, *record.crop_top_left, record.height, record.width], dtype=torch.float32
        )
        return sample


def _encode_images(pipeline: Any, batch: list[tuple[Path, Placement]]) -> list[dict[str, torch.Tensor]]:
    """Each image of ``batch`` filled into its bucket and encoded to latents by the pipeline's VAE."""
    return [
        {"latents": encode_images(pipeline.vae, to_pixels(fill(load_rgb(path), placement))[None])[0]}
        for path, placement in batch
    ]


def _encode_texts(
    pipeline: Any, kind: PipelineKind, max_sequence_length: int | None, batch: list[str]
) -> list[dict[str, torch.Tensor]]:
    """The captions of ``batch`` encoded by the pipeline's own ``encode_prompt``, one dict each."""
    encoded = encode_captions(pipeline, kind, [str(c) for c in batch], max_sequence_length)
    return [{name: tensor[i] for name, tensor in encoded.items()} for i in range(len(batch))]


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` indices of one bucket each (a bucket's last may be smaller),
    shuffled within buckets and in their order, anew each epoch (``set_epoch``)."""

    def __init__(self, buckets: list[tuple[int, int]], batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        self.buckets, self.batch_size, self.shuffle, self.seed, self.epoch = buckets, batch_size, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        by_bucket: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, bucket in enumerate(self.buckets):
            by_bucket[bucket].append(index)
        batches = []
        for bucket in sorted(by_bucket):
            indices = by_bucket[bucket]
            if self.shuffle:
                rng.shuffle(indices)
            batches += [indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()

    def __len__(self) -> int:
        return len(self._batches())


class CaptionedImagesDataModule(L.LightningDataModule):
    """A folder of images and captions, trained as cached latents and text embeddings.

    Args:
        root: the image folder (searched recursively; captions from ``metadata.jsonl``/``.csv``
            or same-stem ``.txt`` files: ``captioned_folder.py``).
        pretrained: the local pipeline folder whose VAE and text encoders encode the data
            (default: the ``DiffusionModule``'s ``pretrained``).
        family: ``unet2d_condition`` (SD 1.x/2.x), ``sdxl``, ``sd3`` or ``flux`` (default: the module's).
        resolution: the side of the buckets' pixel area (default: the family's native 512 or 1024).
        bucket_step: bucket sides are multiples of it (default: 64 for the U-Nets, 16 for SD3 and Flux).
        max_aspect: the most elongated bucket, either way.
        batch_size: samples per batch, all from one bucket.
        caption_dropout: the probability that a sample trains with the empty caption.
        cache_dir: where latents and embeddings are kept (default: ``<root>/.tbp_cache``).
        unreadable: ``"skip"`` (named in a warning) or ``"error"``, for a file that cannot be decoded.
        missing_caption: ``"empty"`` (trained unconditioned), ``"skip"`` or ``"error"``.
        max_sequence_length: T5's tokens for SD3 and Flux (default: their pipelines', 256 and 512).
        encode_batch_size: captions per ``encode_prompt`` call while caching.
        val_batches: validation batches, from the training images (fine-tuning sets are small:
            the validation loss is a sanity check; the module's validation prompts are the test).
    """

    def __init__(
        self,
        root: str,
        pretrained: str | None = None,
        family: str | None = None,
        resolution: int | None = None,
        bucket_step: int | None = None,
        max_aspect: float = 4.0,
        batch_size: int = 1,
        caption_dropout: float = 0.0,
        cache_dir: str | None = None,
        unreadable: Unreadable = "skip",
        missing_caption: MissingCaption = "empty",
        max_sequence_length: int | None = None,
        encode_batch_size: int = 8,
        num_workers: int = 0,
        val_batches: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 <= caption_dropout < 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1), got {caption_dropout}")
        if unreadable not in ("skip", "error"):
            raise ValueError(f"unreadable must be 'skip' or 'error', got {unreadable!r}")
        if missing_caption not in ("empty", "skip", "error"):
            raise ValueError(f"missing_caption must be 'empty', 'skip' or 'error', got {missing_caption!r}")
        self.root = Path(root)
        self.pretrained, self.family = pretrained, family
        self.resolution, self.bucket_step, self.max_aspect = resolution, bucket_step, max_aspect
        self.batch_size, self.caption_dropout = batch_size, caption_dropout
        self.cache = EncodingCache(cache_dir or self.root / ".tbp_cache")
        self.unreadable, self.missing_caption = unreadable, missing_caption
        self.max_sequence_length, self.encode_batch_size = max_sequence_length, encode_batch_size
        self.num_workers, self.val_batches, self.seed = num_workers, val_batches, seed
        self.dataset: _Cached | None = None
        self.last_encoded: dict[str, float] = {}  # what the last prepare_data encoded, and how fast

    # -- which pipeline -------------------------------------------------------------------------
    def use_module(self, module: L.LightningModule) -> None:
        """Take the pipeline folder and family from ``module`` (a ``DiffusionModule``) where not given."""
        hparams = getattr(module, "hparams", {})
        self.pretrained = self.pretrained or hparams.get("pretrained")
        self.family = self.family or hparams.get("family")

    def _pipeline(self) -> tuple[Path, PipelineKind]:
        if (self.pretrained is None or self.family is None) and self.trainer is not None:
            self.use_module(self.trainer.lightning_module)
        if self.family is None or self.pretrained is None:
            raise ValueError(
                "CaptionedImagesDataModule needs the pipeline folder and family: give pretrained= and family=, or "
                "train a DiffusionModule that has them"
            )
        kind = pipeline_kind(self.family)
        return pipeline_folder(self.pretrained, kind), kind

    def _private(self) -> bool:
        """Whether the run trains with DP, whose Poisson batches mix any images: one square bucket then."""
        return self.trainer is not None and wants_per_sample_loss(self.trainer)

    def _buckets(self, kind: PipelineKind) -> list[Bucket]:
        side = self.resolution or kind.native_resolution
        if self._private():
            return [Bucket(side, side)]
        return bucket_sizes(side, self.bucket_step or kind.bucket_step, self.max_aspect)

    def _text_key(self, caption: str, text_id: str) -> str:
        return entry_key("text", caption, text_id, self.max_sequence_length)

    # -- Lightning's hooks --------------------------------------------------------------------------
    @override
    def prepare_data(self) -> None:
        """Check the folder, encode what the cache lacks, write the manifest ``setup`` reads."""
        folder, kind = self._pipeline()
        scan = scan_folder(self.root, self.unreadable, self.missing_caption)
        buckets = self._buckets(kind)
        vae_id, text_id = components_identity(folder, ("vae",)), components_identity(folder, kind.text_components)
        records, sources = [], {}
        for entry in scan.entries:
            placement = place(entry.size, buckets)
            latents = entry_key("latents", entry.content_hash, placement.bucket, placement.crop_top_left, vae_id)
            sources[latents] = (entry.path, placement)
            records.append(
                Record(
                    str(entry.path),
                    latents,
                    self._text_key(entry.caption, text_id),
                    placement.bucket.width,
                    placement.bucket.height,
                    placement.original_size,
                    placement.crop_top_left,
                )
            )
        captions = {self._text_key(e.caption, text_id): e.caption for e in scan.entries}
        if self.caption_dropout > 0:
            captions[self._text_key("", text_id)] = ""
        missing_latents = [k for k in sources if not self.cache.has("latents", k)]
        missing_text = [k for k in captions if not self.cache.has("text", k)]
        if missing_latents or missing_text:
            self._encode(folder, kind, {k: sources[k] for k in missing_latents}, {k: captions[k] for k in missing_text})
        else:
            self.last_encoded = {"latents": 0, "captions": 0}
        self._write_manifest(records, self._text_key("", text_id) if self.caption_dropout > 0 else None)
        counts: dict[str, int] = defaultdict(int)
        for record in records:
            counts[f"{record.width}x{record.height}"] += 1
        rank_zero_info(
            f"CaptionedImagesDataModule: {scan.summary()}; buckets "
            + ", ".join(f"{size} ({n})" for size, n in sorted(counts.items()))
            + f"; encoded {self.last_encoded.get('latents', 0)} latents and {self.last_encoded.get('captions', 0)} "
            f"captions, the rest from the cache at {self.cache.root}"
        )

    def _encode(
        self,
        folder: Path,
        kind: PipelineKind,
        images: dict[str, tuple[Path, Placement]],
        captions: dict[str, str],
    ) -> None:
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        pipeline = load_encoders(folder, kind, device, dtype)
        try:
            n_latents, latent_seconds = self.cache.fill(
                "latents", images.items(), functools.partial(_encode_images, pipeline), 1, "encoding images"
            )
            n_text, text_seconds = self.cache.fill(
                "text",
                captions.items(),
                functools.partial(_encode_texts, pipeline, kind, self.max_sequence_length),
                self.encode_batch_size,
                "encoding captions",
            )
        finally:
            del pipeline  # the encoders leave the device before training
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        self.last_encoded = {
            "latents": n_latents,
            "captions": n_text,
            "images_per_second": n_latents / latent_seconds if latent_seconds else 0.0,
            "captions_per_second": n_text / text_seconds if text_seconds else 0.0,
        }

    def _write_manifest(self, records: list[Record], empty_text: str | None) -> None:
        path = self.cache.root / MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{MANIFEST}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"empty_text": empty_text, "records": [asdict(r) for r in records]}))
        os.replace(partial, path)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.dataset is not None:
            return
        path = self.cache.root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: prepare_data() makes it (Lightning runs it before setup)")
        manifest = json.loads(path.read_text())
        records = [
            Record(**{**r, "original_size": tuple(r["original_size"]), "crop_top_left": tuple(r["crop_top_left"])})
            for r in manifest["records"]
        ]
        self.dataset = _Cached(self.cache, records, manifest["empty_text"], self.caption_dropout)

    def _loader(self, shuffle: bool, limit: int | None = None) -> DataLoader:
        assert self.dataset is not None, "setup() first"
        if self._private():  # one bucket (``_buckets``): a plain loader, which DP's Poisson sampling replaces
            return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers)
        sampler = BucketBatchSampler(
            [(r.width, r.height) for r in self.dataset.records], self.batch_size, shuffle, self.seed
        )
        if limit is not None:
            sampler = _First(sampler, limit)  # type: ignore[assignment]
        return DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader | list:
        return self._loader(shuffle=False, limit=self.val_batches) if self.val_batches > 0 else []

    def example_batch(self) -> dict[str, torch.Tensor]:
        """A batch's shapes at the square bucket of the resolution, from the pipeline's configs
        alone (``tbp estimate``: no image read, no encoder run)."""
        folder, kind = self._pipeline()
        side = self.resolution or kind.native_resolution
        n = self.batch_size
        batch = {"images": torch.zeros(n, *latent_shape(folder, (side, side)))}
        shapes = conditioning_shapes(folder, kind, self.max_sequence_length)
        batch.update({key: torch.zeros(n, *shape) for key, shape in shapes.items()})
        return batch


class _First(Sampler[list[int]]):
    """The first ``limit`` batches of a batch sampler."""

    def __init__(self, batches: Sampler[list[int]], limit: int) -> None:
        self.batches, self.limit = batches, limit

    def __iter__(self) -> Iterator[list[int]]:
        for number, batch in enumerate(self.batches):
            if number >= self.limit:
                return
            yield batch

    def __len__(self) -> int:
        return min(self.limit, len(self.batches))  # type: ignore[arg-type]
