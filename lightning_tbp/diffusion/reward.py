"""Reward fine-tuning through the sampling chain (DRaFT-K style), with LoRA.

The denoiser samples a batch with a few DDIM steps, a differentiable reward scores the result,
and the loss is the negative reward, backpropagated through the last ``grad_steps`` steps of
the chain (DRaFT-K; all of them by default). Every step calls the same denoiser, so the step's
memory grows with the steps' activations; under ``Trainer(strategy=TinyBackpropStrategy())``
each call of the denoiser (and of each of its blocks) is a block of the plan of its own
(``remat/trace.py``: per-call keys), planned against the budget like any other. The chain and
the reward model are one module (:class:`ScoredChain`, the strategy's default target), so the
reward's forward and backward are in the plan as well.

The reward model is the user's (an aesthetic or preference model, frozen); :class:`ConvReward`
is a small stand-in built from a seed, for tests and examples that must not download weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast

import lightning as L
import torch
from diffusers import DDIMScheduler
from torch import nn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_tbp.diffusion.lora import add_lora, lora_options, save_lora
from lightning_tbp.diffusion.models import Family, build_model, sample_input_channels, sample_size
from lightning_tbp.diffusion.models import family as family_spec
from lightning_tbp.optim.choice import OptimizerName, make_optimizer
from lightning_tbp.strategies.privacy import wants_per_sample_loss


class DenoisingChain(nn.Module):
    """``steps`` deterministic DDIM steps of ``denoiser`` from the noise it is given, with
    gradients through the last ``grad_steps`` of them (the earlier ones run without)."""

    def __init__(self, denoiser: nn.Module, fam: Family, scheduler: DDIMScheduler, steps: int, grad_steps: int) -> None:
        super().__init__()
        if not 1 <= grad_steps <= steps:
            raise ValueError(f"grad_steps must be between 1 and sampling_steps ({steps}), got {grad_steps}")
        self.denoiser, self.family = denoiser, fam
        self.scheduler: Any = scheduler  # diffusers' scheduler API is untyped (ConfigMixin)
        self.grad_steps = grad_steps
        self.scheduler.set_timesteps(steps)

    @override
    def forward(self, noise: torch.Tensor, conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        x = noise
        timesteps = self.scheduler.timesteps
        for index, t in enumerate(timesteps):
            with torch.set_grad_enabled(torch.is_grad_enabled() and index >= len(timesteps) - self.grad_steps):
                steps = torch.full((noise.shape[0],), int(t), device=noise.device, dtype=torch.long)
                prediction = self.family.call(self.denoiser, x, steps, conditioning)
                x = self.scheduler.step(prediction, t, x, eta=0.0).prev_sample
        return x


class ScoredChain(nn.Module):
    """The sampling chain and the reward of its samples, as one module: what a reward
    fine-tune's step backpropagates through, so a plan of it counts the reward model too.

    Planned apart (``target="chain"``), the reward's forward and backward are the loss, computed
    outside the plan's module, which no trace sees: the plan counts a few KiB for it until a
    step measures it, and a reward model is no small loss (a 16-wide :class:`ConvReward` held a
    tenth of a small DiT chain's planned step, whose prediction then read 1.05x)."""

    def __init__(self, chain: DenoisingChain, reward_model: nn.Module) -> None:
        super().__init__()
        self.chain = chain
        self.reward_model = reward_model.requires_grad_(False)

    @override
    def forward(self, noise: torch.Tensor, conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.reward_model(self.chain(noise, conditioning))


class ConvReward(nn.Module):
    """A small frozen convolutional scorer, one reward per image: a stand-in for a learned reward
    model (built from ``seed``, so a test or example needs no download)."""

    def __init__(self, channels: int = 3, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 1),
        )
        with torch.no_grad():
            for parameter in self.net.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
        self.requires_grad_(False)

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.float()).squeeze(1)


class NoiseBatches(Dataset):
    """``length`` starting noises of ``shape`` (and a class label each, for class-conditional
    models), the same for an index in every epoch."""

    def __init__(self, length: int, shape: tuple[int, ...], classes: int | None = None, seed: int = 0) -> None:
        self.length, self.shape, self.classes, self.seed = length, tuple(shape), classes, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        item = {"noise": torch.randn(self.shape, generator=generator)}
        if self.classes is not None:
            item["labels"] = torch.randint(0, self.classes, (), generator=generator)
        return item


class RewardFineTuneModule(L.LightningModule):
    """Fine-tune a diffusers denoiser's LoRA adapters (or all its weights) to maximise a reward
    of its samples, backpropagating through the sampling chain.

    Args:
        reward_model: scores a batch of sampled images (or latents): ``[B, C, H, W] -> [B]``,
            differentiable; frozen here.
        family, model_config, pretrained, prediction_type, num_train_timesteps, beta_schedule:
            the denoiser and its noise schedule, as ``DiffusionModule`` takes them.
        sampling_steps: DDIM steps per sample (each a call of the denoiser).
        grad_steps: backpropagate through the last this many steps (DRaFT-K); default all.
        lr, weight_decay, optimizer: as ``DiffusionModule``.
        lora_rank, lora_alpha, lora_target_modules: adapters to train (None: the whole model).
        export_dir: write the adapters (diffusers' LoRA format) or the model here at the end of fit.
    """

    def __init__(
        self,
        reward_model: nn.Module,
        family: Literal["unet2d", "dit", "unet2d_condition"] = "unet2d",
        model_config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        prediction_type: Literal["epsilon", "v_prediction"] = "epsilon",
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        sampling_steps: int = 4,
        grad_steps: int | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        optimizer: OptimizerName = "adamw",
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: list[str] | None = None,
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["reward_model"])
        self.family = family_spec(family)
        denoiser = build_model(family, model_config, pretrained)
        if lora_rank is not None:
            add_lora(denoiser, lora_options(lora_rank, lora_alpha, lora_target_modules))
        scheduler = DDIMScheduler(
            num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule, prediction_type=prediction_type
        )
        chain = DenoisingChain(denoiser, self.family, scheduler, sampling_steps, grad_steps or sampling_steps)
        self.scored = ScoredChain(chain, reward_model)
        self.optimizer_name, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.export_dir, self.trains_adapters = export_dir, lora_rank is not None

    @property
    def chain(self) -> DenoisingChain:
        """The sampling chain alone (``target="chain"`` plans it without the reward model)."""
        return self.scored.chain

    @property
    def reward_model(self) -> nn.Module:
        return self.scored.reward_model

    @property
    def denoiser(self) -> nn.Module:
        return self.chain.denoiser

    def sample_shape(self, batch: int) -> tuple[int, int, int, int]:
        """The shape of ``batch`` starting noises for this denoiser."""
        size = sample_size(self.denoiser)
        return (batch, sample_input_channels(self.denoiser), size, size)

    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample rewards of the chain's samples from the batch's noise, shape [B]."""
        conditioning = {key: value for key, value in batch.items() if key != "noise"}
        return self.scored(batch["noise"], conditioning)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        rewards = self.rewards(batch)
        self.log("train/reward", rewards.mean().detach(), prog_bar=True)
        return -rewards if wants_per_sample_loss(self._trainer) else -rewards.mean()

    @override
    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.denoiser.parameters() if p.requires_grad]
        return make_optimizer(self.optimizer_name, trainable, self.lr, self.weight_decay)

    @override
    def on_fit_end(self) -> None:
        if self.export_dir is not None and self.trainer.is_global_zero:
            directory = Path(self.export_dir)
            if self.trains_adapters:
                save_lora(self.denoiser, directory)
            else:
                cast(Any, self.denoiser).save_pretrained(directory / self.family.pipeline_subfolder)
