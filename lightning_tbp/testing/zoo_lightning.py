"""A zoo architecture as a LightningModule: whole ``Trainer.fit`` runs of the zoo's models, for
the tests that check the loop's promises and the benchmarks that measure them."""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_tbp.compat import tree_flatten, tree_unflatten
from lightning_tbp.diffusion.lora import add_lora, lora_options
from lightning_tbp.optim.choice import OptimizerName, make_optimizer
from lightning_tbp.testing.zoo_models import HELD_OUT, ZOO, sample


class ZooModule(L.LightningModule):
    """The zoo's (or the held-out set's) ``name`` trained on its seeded inputs: a loader hands out rows of its batched
    inputs (those with the batch as their first dimension; ``rows``, the target last), the rest
    stay as they are. The loss is per sample under a DP strategy, its mean otherwise."""

    def __init__(
        self, name: str, batch: int, optimizer: OptimizerName = "adamw", lr: float = 1e-4, lora_rank: int = 0
    ) -> None:
        """``lora_rank``: freeze the model and train LoRA adapters of that rank on its attention
        projections (0: a full fine-tune)."""
        super().__init__()
        case = {**ZOO, **HELD_OUT}[name].case(batch=batch)
        self.model = case.model.train()
        if lora_rank:
            add_lora(self.model, lora_options(lora_rank))
        leaves, self._spec = tree_flatten((case.args, case.kwargs))
        self._batched = [isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch for x in leaves]
        self._leaves = leaves
        self.rows = [x for x, b in zip(leaves, self._batched, strict=True) if b] + [case.target]
        self.optimizer_name = optimizer
        self.lr = lr

    @override
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        columns = iter(batch[:-1])
        leaves = [next(columns) if b else x for x, b in zip(self._leaves, self._batched, strict=True)]
        args, kwargs = tree_unflatten(leaves, self._spec)
        error = (sample(self.model(*args, **kwargs)).float() - batch[-1]).square()
        per_sample = error.flatten(1).mean(dim=1)
        return per_sample if getattr(self.trainer.strategy, "privacy", None) is not None else per_sample.mean()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return make_optimizer(self.optimizer_name, trainable, lr=self.lr, weight_decay=0.01)
