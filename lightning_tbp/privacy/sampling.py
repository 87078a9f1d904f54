"""Poisson sampling of logical batches, split into micro-batches for gradient accumulation.

DP-SGD's privacy analysis (and every Opacus accountant) assumes each optimizer step sees a batch
in which every example took part independently with probability q. With gradient accumulation
the unit is the *logical* batch: it is drawn once by Poisson sampling and then cut into the
micro-batches that the Trainer accumulates, so one noise draw and one accountant step cover it.
Opacus's ``UniformWithReplacementSampler`` draws the batches but cannot split them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset


class PoissonBatchSampler:
    """Yields ``micro_batches`` index lists per logical batch; ``steps`` logical batches per epoch.

    Each example joins a logical batch with probability ``sample_rate``; ``steps`` defaults to
    ``round(1 / sample_rate)``, one expected pass over the data.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        micro_batches: int = 1,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.micro_batches = micro_batches
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))
        self.generator = generator

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            indices = mask.nonzero().flatten()
            for chunk in torch.tensor_split(indices, self.micro_batches):
                yield chunk.tolist()


def poisson_loader(loader: DataLoader, micro_batches: int, generator: torch.Generator | None = None) -> DataLoader:
    """``loader`` re-made with Poisson logical batches of expected size ``batch_size · micro_batches``."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("DP needs a map-style dataset for Poisson sampling; got an IterableDataset")
    if loader.batch_size is None:
        raise ValueError(
            "DP needs the train DataLoader's batch_size (the expected micro-batch size) to set the "
            "sampling rate; a loader with a custom batch_sampler has none"
        )
    dataset: Dataset = loader.dataset
    num_samples = len(dataset)
    logical = loader.batch_size * micro_batches
    if logical > num_samples:
        raise ValueError(f"the logical batch ({logical}) is larger than the data set ({num_samples} samples)")
    sampler = PoissonBatchSampler(num_samples, logical / num_samples, micro_batches, generator=generator)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        worker_init_fn=loader.worker_init_fn,
    )
