"""Well-known training setups through ``tbp estimate``'s Python API: the device sizes they need.

Each setup builds a diffusers model at its real size from its published configuration (no
weights, no hub), a batch of its real shapes and its optimizer (AdamW, or torchao's 8-bit
AdamW), under fake tensors, with the optimizer stepped after the backward or each parameter
inside it (``in_backward``), its state and step on the host (``state_on_host``; with float32
masters of bf16 weights, ``masters``), or DP-SGD's step (``dp``); the estimate gives the naive device peak
and the smallest device a plan reaches, so whether it fits 12/16/24/40/80 GiB as is, with a
plan, or not at all. Every
setup runs in this one process, one after the other; the script reports each estimate's wall
time and the process's peak resident memory (what an estimate costs this machine).

    python benchmarks/estimate_table.py --out docs/benchmarks/estimate [--only sd15_lora]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel, FluxTransformer2DModel, UNet2DConditionModel
from torch import nn

from lightning_tbp.diffusion.lora import LoraOptions, add_lora
from lightning_tbp.diffusion.quantized_base import quantize_base
from lightning_tbp.estimate import CUDA, TrainingStep, estimate_dict, estimate_step
from lightning_tbp.optim.choice import make_optimizer
from lightning_tbp.privacy import attach
from lightning_tbp.remat.budget import format_bytes

GiB = 1024**3
DEVICES = (12 * GiB, 16 * GiB, 24 * GiB, 40 * GiB, 80 * GiB)


def sd15_unet() -> nn.Module:
    return UNet2DConditionModel(cross_attention_dim=768)  # diffusers' defaults are SD 1.x's U-Net


def sdxl_unet() -> nn.Module:
    return UNet2DConditionModel(
        sample_size=128,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(320, 640, 1280),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )


def dit_l(patch: int) -> Callable[[], nn.Module]:
    return lambda: DiTTransformer2DModel(
        num_attention_heads=16, attention_head_dim=64, num_layers=24, sample_size=32, patch_size=patch,
        in_channels=4, out_channels=8,
    )  # fmt: skip


def flux() -> nn.Module:
    return FluxTransformer2DModel(guidance_embeds=True)  # diffusers' defaults are FLUX.1's 12B transformer


def wan_14b() -> nn.Module:
    """Wan 2.1's 14B text-to-video transformer, as its published configuration gives it."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6,
    )  # fmt: skip


def unet_call(model: nn.Module, latents: torch.Tensor, text: torch.Tensor, sdxl: bool) -> torch.Tensor:
    t = torch.zeros(latents.shape[0], dtype=torch.long)
    extra = {}
    if sdxl:
        extra = {
            "added_cond_kwargs": {
                "text_embeds": torch.zeros(latents.shape[0], 1280),
                "time_ids": torch.zeros(latents.shape[0], 6),
            }
        }
    return model(latents, t, encoder_hidden_states=text, **extra).sample


#: exact fp32 AdamW with its state and step on the host needs the step inside the backward and the host tier
STATE_ON_HOST = dict(in_backward=True, host_tier=True, state_on_host=True)

SETUPS: dict[str, dict] = {
    "sd15_full_512_b4": dict(model=sd15_unet, latent=64, batch=4, text=(77, 768), kind="unet"),
    "sd15_lora_512_b4": dict(model=sd15_unet, latent=64, batch=4, text=(77, 768), kind="unet", lora=16),
    "sdxl_lora_1024_b1": dict(model=sdxl_unet, latent=128, batch=1, text=(77, 2048), kind="sdxl", lora=16),
    "sdxl_lora_1024_b4": dict(model=sdxl_unet, latent=128, batch=4, text=(77, 2048), kind="sdxl", lora=16),
    "sdxl_full_1024_b1": dict(model=sdxl_unet, latent=128, batch=1, text=(77, 2048), kind="sdxl"),
    "sd15_full_512_b4_in_backward": dict(
        model=sd15_unet, latent=64, batch=4, text=(77, 768), kind="unet", in_backward=True
    ),
    "sd15_full_512_b4_adamw8bit_in_backward": dict(
        model=sd15_unet, latent=64, batch=4, text=(77, 768), kind="unet", in_backward=True, optimizer="adamw8bit"
    ),
    "sdxl_full_1024_b1_in_backward": dict(
        model=sdxl_unet, latent=128, batch=1, text=(77, 2048), kind="sdxl", in_backward=True
    ),
    "sdxl_full_1024_b1_adamw8bit_in_backward": dict(
        model=sdxl_unet, latent=128, batch=1, text=(77, 2048), kind="sdxl", in_backward=True, optimizer="adamw8bit"
    ),
    "dit_l2_256_b32": dict(model=dit_l(2), latent=32, batch=32, kind="dit"),
    "dit_l8_256_b32": dict(model=dit_l(8), latent=32, batch=32, kind="dit"),
    "flux_lora_1024_b1": dict(model=flux, latent=128, batch=1, kind="flux", lora=16),
    "flux_lora_1024_b1_int8_base": dict(model=flux, latent=128, batch=1, kind="flux", lora=16, base="int8"),
    "flux_lora_1024_b1_nf4_base": dict(model=flux, latent=128, batch=1, kind="flux", lora=16, base="nf4"),
    # the host tier on top (host_tier="auto" takes it where the device alone cannot meet a budget)
    "sdxl_lora_1024_b4_host_tier": dict(
        model=sdxl_unet, latent=128, batch=4, text=(77, 2048), kind="sdxl", lora=16, host_tier=True
    ),
    "sdxl_full_1024_b1_adamw8bit_in_backward_host_tier": dict(
        model=sdxl_unet,
        latent=128,
        batch=1,
        text=(77, 2048),
        kind="sdxl",
        in_backward=True,
        optimizer="adamw8bit",
        host_tier=True,
    ),
    "flux_lora_1024_b1_host_tier": dict(model=flux, latent=128, batch=1, kind="flux", lora=16, host_tier=True),
    # exact fp32 AdamW, its state and step on the host, each parameter stepped inside the backward
    "sdxl_full_1024_b1_state_on_host": dict(
        model=sdxl_unet, latent=128, batch=1, text=(77, 2048), kind="sdxl", **STATE_ON_HOST
    ),
    "sd15_full_512_b4_state_on_host": dict(
        model=sd15_unet, latent=64, batch=4, text=(77, 768), kind="unet", **STATE_ON_HOST
    ),
    # trained in bf16 (precision="bf16-true") with float32 masters and AdamW state on the host
    "sdxl_full_1024_b1_bf16_fp32_masters": dict(
        model=sdxl_unet,
        latent=128,
        batch=1,
        text=(77, 2048),
        kind="sdxl",
        weights="bf16",
        masters=True,
        **STATE_ON_HOST,
    ),
    # 480x832, 81 frames: 21 latent frames of 60x104 (the VAE compresses 4x in time, 8x in space)
    # DP-SGD (bookkeeping) on the adapters: the book holds each adapter's input to the backward's end
    "flux_lora_1024_b4_dp_bookkeeping": dict(model=flux, latent=128, batch=4, kind="flux", lora=16, dp="bookkeeping"),
    "flux_lora_1024_b4_dp_bookkeeping_host_tier": dict(
        model=flux, latent=128, batch=4, kind="flux", lora=16, dp="bookkeeping", host_tier=True
    ),
    "wan14b_lora_480p_81f_b1_host_tier": dict(
        model=wan_14b, latent=(21, 60, 104), batch=1, kind="wan", lora=16, host_tier=True
    ),
}


def made_in_bf16(make: Callable[[], nn.Module], base: str | None = None) -> nn.Module:
    """The model made in bf16 (fake tensors cannot be cast in place); ``base``: quantized as
    ``DiffusionModule(base_quantization=)`` does, before any adapters."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = make()
        if base is not None:
            quantize_base(model, base)
        return model
    finally:
        torch.set_default_dtype(default)


def build_for(setup: dict) -> Callable[[], TrainingStep]:
    def build() -> TrainingStep:
        lora = setup.get("lora")
        if setup.get("weights") == "bf16":  # every weight in bf16, trainable ones included
            model = made_in_bf16(setup["model"])
        elif lora:  # frozen base weights in bf16, adapters in fp32 (the usual LoRA recipe)
            model = made_in_bf16(setup["model"], setup.get("base"))
            add_lora(model, LoraOptions(lora, target_modules=("to_q", "to_k", "to_v", "to_out.0")))
        else:
            model = setup["model"]()
        n, s = setup["batch"], setup["latent"]
        channels = 16 if setup["kind"] in ("flux", "wan") else 4
        latents = torch.zeros(n, channels, *s) if setup["kind"] == "wan" else torch.zeros(n, channels, s, s)
        batch: dict[str, torch.Tensor] = {"latents": latents}
        if "text" in setup:
            batch["text"] = torch.zeros(n, *setup["text"])
        engine = attach(model, setup["dp"], max_grad_norm=1.0, noise_multiplier=1.0) if "dp" in setup else None
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(setup.get("optimizer", "adamw"), trainable, lr=1e-5, weight_decay=0.01)

        def predict() -> torch.Tensor:
            kind = setup["kind"]
            if kind in ("unet", "sdxl"):
                return unet_call(model, latents, batch["text"], kind == "sdxl")
            if kind == "wan":
                text = torch.zeros(n, 512, 4096)
                return model(latents, timestep=torch.zeros(n), encoder_hidden_states=text).sample
            if kind == "dit":
                return model(
                    latents, timestep=torch.zeros(n, dtype=torch.long), class_labels=torch.zeros(n, dtype=torch.long)
                ).sample[:, :4]
            tokens = (
                latents.reshape(n, channels, s // 2, 2, s // 2, 2)
                .permute(0, 2, 4, 1, 3, 5)
                .reshape(n, (s // 2) ** 2, channels * 4)
            )
            ids = torch.zeros((s // 2) ** 2, 3)
            text = torch.zeros(n, 512, 4096)
            return model(
                hidden_states=tokens, encoder_hidden_states=text, pooled_projections=torch.zeros(n, 768),
                timestep=torch.zeros(n), img_ids=ids, txt_ids=torch.zeros(512, 3), guidance=torch.ones(n),
            ).sample  # fmt: skip

        def forward_backward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                prediction = predict()
            if engine is not None:  # each sample's loss, clipped and noised by the engine
                per_sample = prediction.float().square().flatten(1).mean(1)
                engine.backward(per_sample)
                return per_sample
            loss = F.mse_loss(prediction.float(), torch.zeros_like(prediction, dtype=torch.float32))
            loss.backward()
            return loss

        return TrainingStep({"model": model}, model, batch, forward_backward, lambda c: optimizer.step(c), [optimizer])

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, setup in SETUPS.items():
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        estimate = estimate_step(
            build_for(setup),
            device=CUDA,
            step_in_backward=setup.get("in_backward", False),
            host_tier=setup.get("host_tier", False),
            state_on_host=setup.get("state_on_host", False),
            master_dtype=torch.float32 if setup.get("masters") else None,
        )
        # the smallest device with a plan bounds every larger one: it fits there with a plan too
        fits = {
            f"{size // GiB}GiB": "as is"
            if estimate.naive_peak_bytes <= size
            else ("plan" if estimate.minimum_device_bytes <= size else "no")
            for size in DEVICES
        }
        row = {
            "setup": name,
            "optimizer": setup.get("optimizer", "adamw"),
            "in_backward": setup.get("in_backward", False),
            "base_quantization": setup.get("base"),
            "host_tier": setup.get("host_tier", False),
            "state_on_host": setup.get("state_on_host", False),
            "weights": setup.get("weights", "fp32"),
            "dp": setup.get("dp"),
            **estimate_dict(estimate),
            "fits_by_device": fits,
            "wall_seconds": time.perf_counter() - started,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        rows.append(row)
        print(
            f"{name}: naive {format_bytes(row['naive_peak_bytes'])}, smallest with a plan "
            f"{format_bytes(row['minimum_device_bytes'])} (host {format_bytes(row['minimum_plan_host_bytes'])}), "
            f"{fits}, {row['wall_seconds']:.0f} s "
            f"(one estimate {estimate.estimate_seconds:.0f} s), max RSS {format_bytes(row['max_rss_bytes'])}",
            flush=True,
        )
    # rows run now replace their earlier runs; the others stay (``--only`` reruns a few)
    table = args.out / "estimate_table.json"
    earlier = json.loads(table.read_text()) if table.exists() else []
    fresh = {row["setup"] for row in rows}
    merged = [row for row in earlier if row["setup"] not in fresh and row["setup"] in SETUPS] + rows
    order = list(SETUPS)
    table.write_text(json.dumps(sorted(merged, key=lambda row: order.index(row["setup"])), indent=2))


if __name__ == "__main__":
    main()
