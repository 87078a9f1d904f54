"""What the training loop keeps on the device beside the planned module's step.

The plan traces one call of the module; the step the user runs holds more: the batch in hand
(the loop keeps it until the next one), the module's inputs, and whatever ``training_step`` made
before the call (noise, noisy latents, targets, timesteps). On a model whose activations dwarf
its latents that is a few percent; on a small model or a large batch of small samples it is the
difference between a kept budget and a broken one (an MLP whose batch was 8% of its step
peaked 1.08-1.17x its prediction on every step before this was counted).

:class:`AlongsideMeter` measures it where the plan is made, at the module's call, before
planning allocates anything: the batch's and the inputs' storages by inspection, and what
``training_step`` made besides by the step's own meter (the loop watch's exact region, or
CUDA's allocated bytes), less the gradients the strategy freed in between. Without a meter
(a step nobody meters on CPU) only the batch and the inputs are counted.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from lightning_tbp.compat import tree_flatten
from lightning_tbp.memory.breakdown import plain_tensors
from lightning_tbp.remat.step import Alongside
from lightning_tbp.strategies.loop import gradient_bytes


def storages_on(tensors: object, device: torch.device) -> dict[int, int]:
    """The distinct storages of the tensors in ``tensors`` that live on ``device``'s type: data
    pointer -> bytes."""
    # a quantized weight by its inner tensors, an FSDP2 shard by this process's part
    plain = (t.to_local() if isinstance(t, DTensor) else t for t in plain_tensors(tree_flatten(tensors)[0]))
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in plain if t.device.type == device.type}


class AlongsideMeter:
    """Measures :class:`~lightning_tbp.remat.step.Alongside` for the plan (its ``alongside``):
    told each batch as it starts, asked at a call of the planned module.

    ``made_since_batch_start``: the step's exact meter, if it runs (net bytes allocated since the
    batch started; None when the step is not metered)."""

    def __init__(
        self,
        module: pl.LightningModule,
        device: torch.device,
        made_since_batch_start: Callable[[], int | None],
    ) -> None:
        self.module, self.device = module, device
        self._made_since_batch_start = made_since_batch_start
        self._batch: dict[int, int] = {}
        self._gradients_at_start = 0
        self._allocated_at_start: int | None = None

    def batch_started(self, batch: object) -> None:
        self._batch = storages_on(batch, self.device)
        self._gradients_at_start = gradient_bytes(self.module.parameters())
        cuda = self.device.type == "cuda"
        self._allocated_at_start = torch.cuda.memory_allocated(self.device) if cuda else None

    @property
    def batch_bytes(self) -> int:
        """Bytes of the batch in hand, on the device."""
        return sum(self._batch.values())

    def __call__(self, args: tuple, kwargs: dict) -> Alongside:
        owned = storages_on([*self.module.parameters(), *self.module.buffers()], self.device)
        inputs = {
            ptr: nbytes
            for ptr, nbytes in storages_on((args, kwargs), self.device).items()
            if ptr not in self._batch and ptr not in owned
        }
        through = self.batch_bytes + sum(inputs.values())
        made = self._made()
        if made is None:
            return Alongside(through, 0)
        # gradients the strategy freed since the batch started came off the level
        freed = self._gradients_at_start - gradient_bytes(self.module.parameters())
        return Alongside(through, max(0, made + freed - sum(inputs.values())))

    def _made(self) -> int | None:
        made = self._made_since_batch_start()
        if made is None and self._allocated_at_start is not None:
            made = torch.cuda.memory_allocated(self.device) - self._allocated_at_start
        return made
