"""``DiffusionModule``: denoising diffusion training of a diffusers U-Net or transformer with Lightning.

One module for the five families (``unet2d`` DDPM, class-conditional ``dit``,
``unet2d_condition`` on precomputed conditioning, and ``sd3`` and ``flux``, SD3's and Flux's
transformers on precomputed latents and text embeddings). It trains epsilon or v-prediction with
a DDPM noise schedule, or for ``sd3`` and ``flux`` rectified flow (the velocity from data to
noise), keeps optional EMA weights,
samples an image grid after each validation (of images, not latents), reports FLOPs per batch
for Lightning's ``ThroughputMonitor``, and at the end of ``fit`` writes the (EMA) model with
``save_pretrained`` so a diffusers pipeline loads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from diffusers import DDPMPipeline, DDPMScheduler, FlowMatchEulerDiscreteScheduler
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from typing_extensions import override

from lightning_tbp.compat import unset_fake_temporarily
from lightning_tbp.diffusion.lora import LoraFormat, LoraOptions, add_lora, lora_options, save_lora, save_pipeline_lora
from lightning_tbp.diffusion.models import (
    WeightsDtype,
    build_model,
    pipeline_directory,
    sample_input_channels,
    sample_size,
    scheduler_config,
)
from lightning_tbp.diffusion.models import family as family_spec
from lightning_tbp.diffusion.pipeline_io import render_prompts, write_pipeline
from lightning_tbp.diffusion.pipelines import KINDS
from lightning_tbp.diffusion.quantized_base import BaseQuantization, quantize_base
from lightning_tbp.diffusion.sampling import sample, save_image_grid
from lightning_tbp.diffusion.sharded import gathered_copy, is_sharded, shard_like
from lightning_tbp.optim.choice import OptimizerName, make_optimizer
from lightning_tbp.strategies.privacy import wants_per_sample_loss


class TrainableWeights(nn.Module):
    """The trainable parameters of ``model`` (the same tensors), under their names with ``__`` for
    dots: what an EMA of a LoRA fine-tune averages, without a copy of the frozen base."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.register_parameter(name.replace(".", "__"), param)


class DiffusionModule(L.LightningModule):
    """Train a diffusers denoiser on batches of ``{"images", "labels", ["encoder_hidden_states"]}``.

    Args:
        family: ``"unet2d"`` (``UNet2DModel``), ``"dit"`` (``DiTTransformer2DModel``, class labels),
            ``"unet2d_condition"`` (``UNet2DConditionModel``, ``encoder_hidden_states``), ``"sd3"``
            (``SD3Transformer2DModel``, ``encoder_hidden_states`` and ``pooled_projections``,
            trained by rectified flow; its data are usually VAE latents, ``LatentsDataModule``) or
            ``"flux"`` (``FluxTransformer2DModel``, the same conditioning and objective; the
            latents are packed in 2x2 patches and given position ids as FluxPipeline does).
        model_config: keyword arguments of the model class (a fresh model).
        pretrained: a local diffusers model folder, or a pipeline folder whose ``unet`` /
            ``transformer`` subfolder holds it (fine-tuning). Exclusive with ``model_config``.
        weights_dtype: the dtype the model is made or loaded in (None: float32). Under
            ``precision="bf16-true"`` Lightning converts the weights only after they are loaded, so
            ``"bfloat16"`` here halves the host memory the load takes (a Flux transformer's 12B
            weights: 44 GiB in float32, 22 GiB in bfloat16).
        prediction_type: ``"epsilon"`` (predict the noise) or ``"v_prediction"`` (DDPM families;
            a flow family predicts the velocity). None: the pretrained pipeline's scheduler's
            (its ``scheduler/scheduler_config.json``), else epsilon.
        num_train_timesteps, beta_schedule: the DDPM noise schedule (a flow family's timesteps
            are its noise levels times ``num_train_timesteps``). None: the pretrained pipeline's
            scheduler's (SD's ``scaled_linear`` 0.00085-0.012, its spacing and offset), else
            1000 steps, linear.
        noise_offset: DDPM families: add this times a per-channel normal to the noise (offset
            noise: lets the model learn overall brightness, very dark and bright images).
        snr_gamma: DDPM families: weight each sample's loss by min(SNR, gamma) / SNR (epsilon) or
            min(SNR, gamma) / (SNR + 1) (v-prediction): min-SNR-gamma, 5 in its paper.
        guidance_embedding: the value a Flux transformer with a guidance embedding (FLUX.1-dev)
            is given in training (diffusers' Flux LoRA script: 3.5); required there, refused
            elsewhere.
        flow_shift: a flow family's shift of its noise levels s -> shift*s / (1 + (shift-1)*s), in
            training and sampling (None: the family's, SD3's 3.0 and Flux's 1.0, as diffusers'
            training scripts take them from the released schedulers: more steps at high noise
            where above 1). The levels are drawn logit-normal before the shift (SD3's paper).
        lr, weight_decay, lr_warmup_steps: the optimizer's, with a linear warm-up.
        optimizer: ``"adamw"``; ``"adamw8bit"``/``"adamw4bit"`` (torchao's low-bit state, about
            a quarter/eighth of AdamW's for large tensors; changes the numerics: your choice,
            counted by the plan as it is); ``"adafactor"`` (factored second moments).
        ema_decay: keep an exponential moving average of the weights (sampled and exported);
            under LoRA of the adapters only.
        sample_images, sample_steps, sampler, guidance_scale: the grid drawn after each
            validation (0 images: none); guidance applies to DiT labels.
        export, export_dir: write the model with ``save_pretrained`` at the end of fit, to
            ``export_dir`` (default ``<log_dir>/pretrained``).
        compute_flops: measure FLOPs per batch (on the meta device) for ``ThroughputMonitor``.
        lora_rank: fine-tune LoRA adapters of this rank instead of the whole model (peft; the
            base weights are frozen; export writes the adapters in diffusers' LoRA format).
        lora_alpha: the adapters' scale numerator (scale alpha/rank; default: the rank).
        lora_target_modules: names (or name suffixes) of the layers to adapt; default the
            attention projections ``to_q``, ``to_k``, ``to_v``, ``to_out.0``.
        lora_dropout: dropout on the adapters' input.
        lora_format: ``"diffusers"`` (default) or ``"kohya"``: with a pipeline folder as
            ``pretrained``, the adapters are written with the pipeline's ``save_lora_weights``
            (the ``unet.``/``transformer.`` prefix ``load_lora_weights`` needs); ``"kohya"`` also
            writes ``lora_kohya.safetensors`` (A1111, ComfyUI; the U-Net families). A full
            fine-tune of a pipeline folder is written as a whole pipeline folder.
        validation_prompts: prompts rendered through the whole pipeline (its text encoders and
            VAE from ``pretrained``, the current weights: EMA or LoRA included) after each
            validation, into ``samples/prompts_<step>.png``; with ``validation_steps`` denoising
            steps at ``validation_resolution`` (default: the family's native side) and
            ``guidance_scale``.
        base_quantization: with ``lora_rank``, store the frozen base's ``Linear`` weights as
            ``"int8"`` (torchao weight-only int8) or ``"nf4"`` (QLoRA's 4-bit NormalFloat):
            about a half or a quarter of their bytes. Changes the numerics (the adapters learn on
            the quantized base): your choice, counted by the plan as it is.
    """

    def __init__(
        self,
        family: Literal["unet2d", "dit", "unet2d_condition", "sdxl", "sd3", "flux"] = "unet2d",
        model_config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        weights_dtype: WeightsDtype | None = None,
        prediction_type: Literal["epsilon", "v_prediction"] | None = None,
        num_train_timesteps: int | None = None,
        beta_schedule: str | None = None,
        noise_offset: float = 0.0,
        snr_gamma: float | None = None,
        flow_shift: float | None = None,
        guidance_embedding: float | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        optimizer: OptimizerName = "adamw",
        lr_warmup_steps: int = 0,
        ema_decay: float | None = None,
        sample_images: int = 16,
        sample_steps: int = 50,
        sampler: Literal["ddim", "ddpm"] = "ddim",
        guidance_scale: float = 1.0,
        export: bool = True,
        export_dir: str | None = None,
        compute_flops: bool = True,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        lora_target_modules: list[str] | None = None,
        lora_dropout: float = 0.0,
        lora_format: LoraFormat = "diffusers",
        base_quantization: BaseQuantization | None = None,
        validation_prompts: list[str] | None = None,
        validation_steps: int = 20,
        validation_resolution: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if prediction_type not in (None, "epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
        if lora_format not in ("diffusers", "kohya"):
            raise ValueError(f"lora_format must be 'diffusers' or 'kohya', got {lora_format!r}")
        if snr_gamma is not None and snr_gamma <= 0:
            raise ValueError(f"snr_gamma must be positive, got {snr_gamma}")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {ema_decay}")
        self.family = family_spec(family)
        if lora_format == "kohya" and self.family.pipeline_subfolder != "unet":
            raise ValueError(
                f"lora_format='kohya' writes U-Net keys (lora_unet_*), for the U-Net families; {family!r} is a "
                "transformer, whose LoRA ComfyUI and diffusers read in diffusers' format (lora_format='diffusers')"
            )
        if self.family.objective == "flow" and (prediction_type, beta_schedule, snr_gamma) != (None, None, None):
            raise ValueError(
                f"family {family!r} trains by rectified flow (it predicts the velocity): no prediction_type, "
                "beta_schedule or snr_gamma"
            )
        if self.family.objective == "flow" and noise_offset:
            raise ValueError(f"noise_offset is a DDPM family's option; family {family!r} trains by rectified flow")
        if validation_prompts and pipeline_directory(pretrained) is None:
            raise ValueError(
                "validation_prompts are rendered through the pretrained pipeline (its text encoders and VAE): "
                "pretrained must be a pipeline folder (model_index.json)"
            )
        if guidance_embedding is not None and family != "flux":
            raise ValueError(f"guidance_embedding is a Flux transformer's input; family {family!r} has none")
        self.model = build_model(family, model_config, pretrained, weights_dtype)
        self.lora: LoraOptions | None = None
        if base_quantization is not None:
            if lora_rank is None:
                raise ValueError(
                    "base_quantization quantizes a frozen base, so it needs lora_rank (a full fine-tune trains every "
                    "weight in full precision)"
                )
            rank_zero_info(f"DiffusionModule: {quantize_base(self.model, base_quantization).describe()}")
        if lora_rank is not None:
            self.lora = lora_options(lora_rank, lora_alpha, lora_target_modules, lora_dropout)
            adapters = add_lora(self.model, self.lora)
            rank_zero_info(
                f"DiffusionModule: LoRA rank {lora_rank} on {', '.join(self.lora.target_modules)}: {adapters:,} "
                "trainable parameters "
                f"of {sum(p.numel() for p in self.model.parameters()):,}"
            )
        elif lora_alpha is not None or lora_target_modules is not None or lora_dropout:
            raise ValueError("lora_alpha, lora_target_modules and lora_dropout need lora_rank")
        if sample_images > 0 and sample_input_channels(self.model) not in (1, 3):
            raise ValueError(
                f"sample_images={sample_images}, but the model takes {sample_input_channels(self.model)} channels: "
                "latents, which a grid cannot show without their VAE; set sample_images=0"
            )
        self.noise_scheduler: DDPMScheduler | FlowMatchEulerDiscreteScheduler
        if self.family.objective == "flow":
            # its constructor reads its sigmas' values, which tbp estimate's fake tensors do not
            # have; the flow loss uses its config alone
            shift = self.family.flow_shift if flow_shift is None else flow_shift
            with unset_fake_temporarily():
                self.noise_scheduler = FlowMatchEulerDiscreteScheduler(
                    num_train_timesteps=num_train_timesteps or 1000, shift=shift
                )
        else:
            given = {"num_train_timesteps": num_train_timesteps, "beta_schedule": beta_schedule}
            given["prediction_type"] = prediction_type
            self.noise_scheduler = DDPMScheduler.from_config(
                {**scheduler_config(pretrained), **{k: v for k, v in given.items() if v is not None}}
            )
        self.ema: AveragedModel | None = None
        if ema_decay is not None:
            # Copied now, before a tiny_backprop plan wraps the model's blocks at the first batch;
            # under LoRA the adapters alone (a copy of the frozen base would average a constant)
            self.ema = AveragedModel(
                self._averaged_weights(), multi_avg_fn=get_ema_multi_avg_fn(ema_decay), use_buffers=True
            )
            self.ema.requires_grad_(False)
        self.flops_per_batch: int | None = None
        self.last_sample_grid: Path | None = None
        self.last_prompt_grid: Path | None = None
        self.exported_to: Path | None = None
        self._sample_conditioning: dict[str, torch.Tensor] | None = None

    # -- training ------------------------------------------------------------------------------

    def diffusion_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Per-sample denoising loss, shape [B]: the mean squared error of each sample's prediction
        (weighted by min-SNR-gamma where ``snr_gamma`` is set)."""
        images = batch["images"]
        noise = torch.randn_like(images)
        if self.hparams.noise_offset:
            offset = torch.randn(*images.shape[:2], *([1] * (images.dim() - 2)), device=images.device)
            noise = noise + self.hparams.noise_offset * offset.to(noise.dtype)
        noised = self._flow_point if self.family.objective == "flow" else self._ddpm_point
        noisy, timesteps, target = noised(images, noise)
        prediction = self.family.call(self.model, noisy, timesteps, self._guided(batch)).float()
        squared_error = F.mse_loss(prediction, target.float(), reduction="none")
        per_sample = squared_error.mean(dim=tuple(range(1, squared_error.dim())))
        if self.hparams.snr_gamma is None:
            return per_sample
        return per_sample * self._min_snr_weights(timesteps).to(per_sample.device)

    def _min_snr_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """min(SNR, gamma) / SNR (epsilon targets) or / (SNR + 1) (v targets), SNR = a / (1 - a)
        of the scheduler's cumulative alpha at each sample's timestep (Hang et al., 2303.09556)."""
        alphas = self.noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
        snr = alphas / (1 - alphas)
        clipped = snr.clamp(max=float(self.hparams.snr_gamma))
        v_targets = self.noise_scheduler.config.prediction_type == "v_prediction"
        return clipped / (snr + 1) if v_targets else clipped / snr

    def _ddpm_point(self, images: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A DDPM training point: the noisy input at a uniform timestep, and its target (the noise,
        or the velocity under v-prediction)."""
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (images.shape[0],), device=images.device
        )
        noisy = self.noise_scheduler.add_noise(images, noise, timesteps)
        if self.noise_scheduler.config.prediction_type == "epsilon":
            return noisy, timesteps, noise
        return noisy, timesteps, self.noise_scheduler.get_velocity(images, noise, timesteps)

    def _flow_point(self, images: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rectified flow: the sample at noise level s is (1 - s) x + s n, the model predicts its
        velocity n - x; s is drawn logit-normal (SD3's choice: the middle levels, where the
        prediction is hardest, most often), then shifted as the scheduler shifts its table."""
        shift = float(self.noise_scheduler.config.shift)
        drawn = torch.sigmoid(torch.randn(images.shape[0], device=images.device))
        sigmas = shift * drawn / (1 + (shift - 1) * drawn)
        shaped = sigmas.view(-1, *([1] * (images.dim() - 1))).to(images.dtype)
        noisy = (1 - shaped) * images + shaped * noise
        return noisy, sigmas * self.noise_scheduler.config.num_train_timesteps, noise - images

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        per_sample = self.diffusion_loss(batch)
        self.log("train/loss", per_sample.mean(), prog_bar=True)
        # DP strategies clip each sample's gradient, so they take the loss per sample.
        return per_sample if wants_per_sample_loss(self._trainer) else per_sample.mean()

    @override
    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        # A Poisson-sampled (DP) batch may be empty; SDXL's conditioning cannot reshape one.
        if self.hparams.compute_flops and self.flops_per_batch is None and len(batch["images"]):
            self.flops_per_batch = self._measure_flops(batch)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # Here, not at batch end: callbacks (ModelCheckpoint) see the batch end first, and a
        # checkpoint must hold the EMA of the weights it holds. Once per optimizer step.
        if self.ema is not None:
            self.ema.update_parameters(self._averaged_weights())

    @override
    def on_fit_start(self) -> None:
        self._shard_ema()

    @property
    def sharded_copies(self) -> tuple[str, ...]:
        """Children that hold a copy of the weights kept as shards like them under FSDP2 (the
        EMA): what ``tbp estimate`` divides per rank."""
        return ("ema",) if self.ema is not None else ()

    def _shard_ema(self) -> None:
        """Under FSDP2 the EMA is kept as shards laid out like the weights it follows (a
        collective; nothing to do otherwise): before the plan, which counts it, is made."""
        if self.ema is not None:
            shard_like(self.ema.module, self._averaged_weights())

    def _averaged_weights(self) -> nn.Module:
        """What the EMA averages: the model, or under LoRA its adapters alone."""
        return self.model if self.lora is None else TrainableWeights(self.model)

    def _guided(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with the guidance value a Flux transformer embeds, where the module has one."""
        if self.hparams.guidance_embedding is None:
            return batch
        images = batch["images"]
        return {
            **batch,
            "guidance": torch.full((images.shape[0],), float(self.hparams.guidance_embedding), device=images.device),
        }

    def _measure_flops(self, batch: dict[str, Any]) -> int:
        """Model FLOPs of one training step (forward + backward) on a meta-device copy: no memory, no time."""
        with torch.device("meta"):
            meta_model = self.family.model_class.from_config(self.model.config)
            meta_batch = self._guided(
                {k: torch.empty_like(v, device="meta") for k, v in batch.items() if torch.is_tensor(v)}
            )
            timesteps = torch.zeros(meta_batch["images"].shape[0], dtype=torch.long)
        return measure_flops(
            meta_model,
            lambda: self.family.call(meta_model, meta_batch["images"], timesteps, meta_batch),
            lambda out: out.sum(),
        )

    @override
    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # the adapters alone under LoRA
        optimizer = make_optimizer(self.hparams.optimizer, trainable, self.hparams.lr, self.hparams.weight_decay)
        warmup = self.hparams.lr_warmup_steps
        if warmup <= 0:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # -- validation: loss, then a grid of samples -----------------------------------------------

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self._sample_conditioning is None:
            self._sample_conditioning = {k: v for k, v in batch.items() if k != "images" and torch.is_tensor(v)}
        loss = self.diffusion_loss(batch).mean()
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)  # every rank validates its own batches
        return loss

    @contextlib.contextmanager
    def inference_model(self) -> Iterator[nn.Module]:
        """The model to sample and export: the EMA weights when kept, else the trained ones.
        Under LoRA (the EMA holds the adapters alone) or FSDP2 (the EMA holds shards, which only
        the sharded model gathers) the averaged weights are copied into the model for the block,
        and the trained ones back after it."""
        if self.ema is None or (self.lora is None and not is_sharded(self.model)):
            yield self.ema.module if self.ema is not None else self.model
            return
        self._shard_ema()  # outside a fit (validate, export) it may not be yet
        live = dict(self._averaged_weights().named_parameters())
        trained = {name: param.detach().clone() for name, param in live.items()}
        with torch.no_grad():
            for name, averaged in self.ema.module.named_parameters():
                live[name].copy_(averaged)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, param in live.items():
                    param.copy_(trained[name])

    def sample(self, n: int, steps: int | None = None, seed: int = 0) -> torch.Tensor:
        """``n`` images in [-1, 1] from the (EMA) model."""
        with self.inference_model() as model:
            return self._sample(model, n, steps, seed)

    def _sample(self, model: nn.Module, n: int, steps: int | None, seed: int) -> torch.Tensor:
        size, channels = sample_size(model), sample_input_channels(model)
        conditioning, null = self._conditioning_for(n)
        generator = torch.Generator().manual_seed(seed)
        return sample(
            model,
            self.family,
            self.noise_scheduler,
            (n, channels, size, size),
            conditioning,
            steps=steps or self.hparams.sample_steps,
            sampler=self.hparams.sampler,
            guidance_scale=self.hparams.guidance_scale,
            null_conditioning=null,
            generator=generator,
        )

    def _conditioning_for(self, n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        if self.family.name == "dit":
            classes = int(self.model.config.num_embeds_ada_norm)
            labels = torch.arange(n, device=self.device) % classes
            return {"labels": labels}, {"labels": torch.full_like(labels, classes)}
        keys = self.family.conditioning
        if keys:
            stored = self._sample_conditioning or {}
            if any(key not in stored for key in keys):
                raise RuntimeError(
                    f"sampling {self.family.model_class.__name__} needs conditioning: run a validation batch first"
                )
            picked = {
                key: stored[key][torch.arange(n, device=stored[key].device) % stored[key].shape[0]] for key in keys
            }
            return picked, {key: torch.zeros_like(value) for key, value in picked.items()}
        return {}, None

    @override
    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        root = self._output_root()  # every rank asks: on several devices Lightning broadcasts it
        if self.hparams.validation_prompts and self.trainer.is_global_zero:
            self._render_validation_prompts(root)
        if self.hparams.sample_images <= 0:
            return
        sharded = is_sharded(self.model)
        if not (self.trainer.is_global_zero or sharded):
            return
        images = self.sample(self.hparams.sample_images)  # sharded, every rank samples (the same grid)
        if not self.trainer.is_global_zero:
            return
        path = Path(root) / "samples" / f"step_{self.global_step:06d}.png"
        self.last_sample_grid = save_image_grid(images, path)
        experiment = getattr(self.logger, "experiment", None)
        if hasattr(experiment, "add_image"):
            experiment.add_image("samples", (images[:, :3] + 1) / 2, self.global_step, dataformats="NCHW")
        rank_zero_info(f"DiffusionModule: sample grid written to {path}")

    def _render_validation_prompts(self, root: str) -> None:
        """The validation prompts through the whole pretrained pipeline with the current weights."""
        pipeline = pipeline_directory(self.hparams.pretrained)
        kind = KINDS[self.family.name]
        assert pipeline is not None
        with self.inference_model() as model:
            images = render_prompts(
                pipeline,
                kind,
                model,
                list(self.hparams.validation_prompts),
                steps=self.hparams.validation_steps,
                resolution=self.hparams.validation_resolution or kind.native_resolution,
                guidance_scale=self.hparams.guidance_scale,
            )
        path = Path(root) / "samples" / f"prompts_{self.global_step:06d}.png"
        self.last_prompt_grid = save_image_grid(images, path)
        rank_zero_info(f"DiffusionModule: validation prompts rendered to {path}")

    # -- export -----------------------------------------------------------------------------------

    @override
    def on_fit_end(self) -> None:
        if not self.hparams.export:
            return
        default = Path(self._output_root()) / ("lora" if self.lora is not None else "pretrained")  # every rank asks
        if self.trainer.is_global_zero or is_sharded(self.model):  # sharded, every rank gathers the weights
            self.exported_to = self.export(self.hparams.export_dir or default)
        what = "LoRA adapters (diffusers' format)" if self.lora is not None else "model (diffusers save_pretrained)"
        rank_zero_info(f"DiffusionModule: {what} written to {self.exported_to}")

    def export(self, directory: str | Path) -> Path:
        """Write the (EMA) model and the noise scheduler as a diffusers folder.

        ``unet2d`` becomes a ``DDPMPipeline`` folder; the other families a pipeline-style folder
        with the model in ``transformer``/``unet`` and the scheduler in ``scheduler``. Under LoRA
        only the adapters are written (``pytorch_lora_weights.safetensors``, diffusers' format):
        the base weights are the pretrained folder's; with a pipeline folder as ``pretrained``
        through the pipeline's ``save_lora_weights`` (its component prefix, which
        ``load_lora_weights`` needs). A full fine-tune of a pipeline folder writes a whole
        pipeline folder: its other components copied, the trained denoiser in place of its own.
        """
        directory = Path(directory)
        with self.inference_model() as model:
            if is_sharded(model):  # a collective: each rank's shards gathered, written by rank 0
                model = gathered_copy(model, self._unsharded_model, self.trainer.is_global_zero)
                if model is None:
                    return directory
            pipeline = pipeline_directory(self.hparams.pretrained)
            kind = KINDS.get(self.family.name)
            if self.lora is not None and kind is not None and pipeline is not None:
                save_pipeline_lora(model, directory, kind.pipeline_type(), kind.denoiser, self.hparams.lora_format)
            elif self.lora is not None:
                save_lora(model, directory)
            elif kind is not None and pipeline is not None:
                write_pipeline(pipeline, kind.denoiser, model, directory)
            elif self.family.name == "unet2d":
                DDPMPipeline(unet=model, scheduler=self.noise_scheduler).save_pretrained(directory)
            else:
                model.save_pretrained(directory / self.family.pipeline_subfolder)
                self.noise_scheduler.save_pretrained(directory / "scheduler")
        return directory

    def _unsharded_model(self) -> nn.Module:
        """A fresh model of this module's structure (LoRA adapters included), on the CPU."""
        model = self.family.model_class.from_config(self.model.config)
        if self.lora is not None:
            add_lora(model, self.lora)
        return model

    def _output_root(self) -> str:
        return self.trainer.log_dir or self.trainer.default_root_dir
