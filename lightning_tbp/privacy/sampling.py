"""Poisson sampling of logical batches, split into micro-batches for gradient accumulation.

DP-SGD's privacy analysis (and every Opacus accountant) assumes each optimizer step sees a batch
in which every example took part independently with probability q. With gradient accumulation
the unit is the *logical* batch: it is drawn once by Poisson sampling and then cut into the
micro-batches that the Trainer accumulates, so one noise draw and one accountant step cover it.
Opacus's ``UniformWithReplacementSampler`` draws the batches but cannot split them.

With several processes each one draws from its own share of the data (every ``world_size``-th
example) with the same rate, from its own random stream: every example still joins the global
logical batch independently with probability q, and every process yields the same number of
micro-batches, so their optimizer steps stay in lock-step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from scipy.stats import binom
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_tbp.compat import tree_flatten, tree_unflatten


class PoissonBatchSampler:
    """Yields ``micro_batches`` index lists per logical batch; ``steps`` logical batches per epoch.

    Each example joins a logical batch with probability ``sample_rate``; ``steps`` defaults to
    ``round(1 / sample_rate)``, one expected pass over the data. ``rank``/``world_size``: this
    process draws only from examples ``rank, rank + world_size, ...``.
    """

    # a micro-batch above micro_batch_ceiling() is this unlikely per logical batch
    CEILING_TAIL = 1e-6

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        micro_batches: int = 1,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.micro_batches = micro_batches
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))
        self.generator = generator
        self.candidates = torch.arange(rank, num_samples, world_size)

    def micro_batch_ceiling(self) -> int:
        """A micro-batch size this process exceeds with probability below ``CEILING_TAIL`` per step."""
        logical = int(binom.ppf(1 - self.CEILING_TAIL, len(self.candidates), self.sample_rate))
        return max(1, -(-logical // self.micro_batches))

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(len(self.candidates), generator=self.generator) < self.sample_rate
            indices = self.candidates[mask]
            for chunk in torch.tensor_split(indices, self.micro_batches):
                yield chunk.tolist()


class EmptyAwareCollate:
    """``collate_fn`` that turns an empty draw into a batch of 0 samples with the right structure.

    Poisson sampling can draw no sample at all, and most collate functions fail on an empty list
    (the default one reads ``batch[0]``). The empty batch is made by collating the first example
    and cutting every tensor to length 0, so shapes past the batch dimension and dtypes are
    right; the strategy sees it is empty and skips the forward. A class, not a closure, so
    loader workers can pickle it."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> Any:
        if samples:
            return self.collate_fn(samples)
        leaves, spec = tree_flatten(self.collate_fn([self.dataset[0]]))
        return tree_unflatten(
            [leaf[:0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf for leaf in leaves], spec
        )


def poisson_loader(
    loader: DataLoader,
    micro_batches: int,
    rank: int = 0,
    world_size: int = 1,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """``loader`` re-made with Poisson logical batches of expected size ``batch_size · micro_batches``
    per process (so ``world_size`` times that in all).

    With several processes and no ``generator``, each process gets its own stream, seeded from
    torch's seed and the rank: the same seed on every rank would draw the same pattern on every
    share, so examples would not join independently."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("DP needs a map-style dataset for Poisson sampling; got an IterableDataset")
    if loader.batch_size is None:
        raise ValueError(
            "DP needs the train DataLoader's batch_size (the expected micro-batch size) to set the "
            "sampling rate; a loader with a custom batch_sampler has none"
        )
    dataset = loader.dataset
    if not isinstance(dataset, Sized):
        raise ValueError("DP needs a dataset with a length (``len(dataset)``) to set the sampling rate")
    num_samples = len(dataset)
    logical = loader.batch_size * micro_batches * world_size
    if logical > num_samples:
        raise ValueError(f"the logical batch ({logical}) is larger than the data set ({num_samples} samples)")
    if generator is None and world_size > 1:
        generator = torch.Generator().manual_seed(torch.initial_seed() + 1_000_003 * rank)
    sampler = PoissonBatchSampler(
        num_samples, logical / num_samples, micro_batches, generator=generator, rank=rank, world_size=world_size
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=EmptyAwareCollate(dataset, loader.collate_fn),
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        worker_init_fn=loader.worker_init_fn,
    )
