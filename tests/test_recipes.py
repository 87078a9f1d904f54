"""Recipes: every YAML config runs, the tiny recipe learns, fine-tuning round-trips through diffusers."""

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from diffusers import DDPMPipeline, DiffusionPipeline, DiTTransformer2DModel, SD3Transformer2DModel, UNet2DModel
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from PIL import Image
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_tbp.diffusion import DiffusionModule, DigitsDataModule, ImageFolderDataModule, load_lora
from lightning_tbp.diffusion.models import build_model, pipeline_directory
from lightning_tbp.lightning_cli import run_lightning_cli
from lightning_tbp.testing.zoo_models import ZOO

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def lora_tensors(model: torch.nn.Module) -> list[str]:
    """The LoRA adapters' tensors a model holds (peft's ``lora_A``/``lora_B`` weights)."""
    return [name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]


TINY_UNET = {
    "sample_size": 32,
    "block_out_channels": [16, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": 8,
}
TINY_DIT = {"sample_size": 32, "patch_size": 8, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2}


def tiny_unet_config(channels: int) -> dict:
    return {**TINY_UNET, "in_channels": channels, "out_channels": channels}


def tiny_dit_config(channels: int, classes: int) -> dict:
    return {**TINY_DIT, "in_channels": channels, "out_channels": channels, "num_embeds_ada_norm": classes}


def write_images(root: Path, classes: tuple[str, ...] = ("a", "b", "c"), per_class: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            pixels = rng.integers(0, 256, size=(36, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{index}.png")
    return root


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def pretrained_unet(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("pretrained") / "tiny-ddpm"
    UNet2DModel(**tiny_unet_config(3)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def latent_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny SD3 and Flux (with FLUX.1-dev's guidance input) transformers' folders, and a file of
    latents and text embeddings both take."""
    from models import tiny_flux_dev, write_latents

    root = tmp_path_factory.mktemp("latent_models")
    torch.manual_seed(0)
    ZOO["sd3"].build().save_pretrained(root / "sd3")
    tiny_flux_dev().save_pretrained(root / "flux")
    return {"sd3": root / "sd3", "flux": root / "flux", "latents": write_latents(root / "latents.pt", samples=12)}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    """Tiny pipeline folders of the captioned-image configs' families, and a captioned image folder."""
    from lightning_tbp.testing.tiny_pipelines import CAPTIONS, write_captioned_images, write_tiny_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    folders = {
        family: write_tiny_pipeline(family, root / family, CAPTIONS, guidance_embeds=family == "flux")
        for family in ("unet2d_condition", "sdxl", "sd3", "flux")
    }
    return {**folders, "images": write_captioned_images(root / "images")}


def captioned_overrides(text: str, pipelines: dict[str, Path]) -> list[str]:
    """A captioned-image config on a tiny pipeline of its family and tiny images."""
    family = next(f for f in ("unet2d_condition", "sdxl", "sd3", "flux") if f"family: {f}" in text)
    args = [f"--model.init_args.pretrained={pipelines[family]}", f"--data.init_args.root={pipelines['images']}"]
    args += ["--data.init_args.resolution=32", "--data.init_args.bucket_step=16", "--data.init_args.batch_size=1"]
    args += ["--model.init_args.sample_images=0", "--model.init_args.weights_dtype=null"]
    if family in ("sd3", "flux"):
        args.append("--data.init_args.max_sequence_length=16")
    return args


def config_overrides(
    name: str, image_folder: Path, pretrained_unet: Path, latent_models: dict[str, Path], pipelines: dict[str, Path]
) -> list[str]:
    """Shrink each recipe to a tiny model on tiny data; everything else stays as in the YAML."""
    text = (CONFIGS / name).read_text()
    image_data, latents = "ImageFolderDataModule" in text, "LatentsDataModule" in text
    channels = 3 if image_data else 1
    args = []
    if "CaptionedImagesDataModule" in text:
        args += captioned_overrides(text, pipelines)
    elif latents:
        args += [f"--data.init_args.path={latent_models['latents']}", "--data.init_args.batch_size=4"]
        args += ["--data.init_args.val_fraction=0.25", "--model.init_args.sample_images=0"]
        args += ["--model.init_args.weights_dtype=null"]  # the DP flag's run is in float32
    elif image_data:
        args += [f"--data.init_args.root={image_folder}", "--data.init_args.image_size=32"]
        args += ["--data.init_args.batch_size=4", "--data.init_args.num_workers=0", "--data.init_args.val_fraction=0.2"]
    else:
        args += ["--data.init_args.batch_size=4"]
    if "CaptionedImagesDataModule" in text:
        pass  # its tiny pipeline is given above
    elif "pretrained:" in text:
        family = "flux" if "family: flux" in text else "sd3"
        args.append(f"--model.init_args.pretrained={latent_models[family] if latents else pretrained_unet}")
    elif "family: dit" in text:
        args.append(f"--model.init_args.model_config={json.dumps(tiny_dit_config(channels, 3 if image_data else 10))}")
    else:
        args.append(f"--model.init_args.model_config={json.dumps(tiny_unet_config(channels))}")
    if "MemoryProfilerCallback" not in text:
        args.append("--trainer.callbacks+=MemoryProfilerCallback")
    return args


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_runs_with_the_strategy_and_callback(
    config, image_folder, pretrained_unet, latent_models, pipelines, tmp_path
) -> None:
    args = ["fit", "-c", str(CONFIGS / config), "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu"]
    args += [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    args += [
        "--trainer.strategy=tiny_backprop",
        "--model.init_args.sample_images=4",
        "--model.init_args.sample_steps=2",
    ]
    args += config_overrides(config, image_folder, pretrained_unet, latent_models, pipelines)
    cli = run_lightning_cli(args)
    module = cli.model
    assert cli.trainer.global_step == 1 and cli.trainer.strategy.plan.shape_plans  # planned (perhaps re-planned)
    if module.hparams.sample_images:  # none for latents
        assert module.last_sample_grid is not None and module.last_sample_grid.is_file()
    assert module.flops_per_batch > 0
    assert any(isinstance(c, Callback) and type(c).__name__ == "MemoryProfilerCallback" for c in cli.trainer.callbacks)
    pipeline = pipeline_directory(module.hparams.pretrained)
    if pipeline is not None and module.lora is not None:  # the pipeline's own loader reads every adapter
        pipe = DiffusionPipeline.from_pretrained(pipeline, local_files_only=True)
        pipe.load_lora_weights(module.exported_to)
        saved = load_file(str(module.exported_to / "pytorch_lora_weights.safetensors"))
        assert len(lora_tensors(getattr(pipe, module.family.pipeline_subfolder))) == len(saved)
    elif pipeline is not None:
        DiffusionPipeline.from_pretrained(module.exported_to, local_files_only=True)
    elif module.family.name in latent_models:
        load_lora(module.family.model_class.from_pretrained(latent_models[module.family.name]), module.exported_to)
    elif module.lora is not None:
        load_lora(UNet2DModel.from_pretrained(pretrained_unet), module.exported_to)
    elif module.family.name == "unet2d":
        pipeline = DDPMPipeline.from_pretrained(module.exported_to)
        assert pipeline.unet.config.sample_size == 32
    else:
        DiTTransformer2DModel.from_pretrained(module.exported_to / "transformer")


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_runs_with_the_dp_flag(
    config, image_folder, pretrained_unet, latent_models, pipelines, tmp_path
) -> None:
    args = ["fit", "-c", str(CONFIGS / config), "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu"]
    args += [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    args += ["--trainer.precision=32", "--model.init_args.sample_images=0"]
    args += ["--trainer.strategy=lightning_tbp.TinyBackpropStrategy", "--trainer.strategy.memory_budget=0.95"]
    args += ["--trainer.strategy.dp=ghost", "--trainer.strategy.noise_multiplier=1.0"]
    args += config_overrides(config, image_folder, pretrained_unet, latent_models, pipelines)
    if "CaptionedImagesDataModule" in (CONFIGS / config).read_text():
        args.append("--data.init_args.batch_size=4")  # every one of the 4 images sampled: the step plans
    cli = run_lightning_cli(args)
    privacy = cli.trainer.strategy.privacy
    assert cli.trainer.global_step == 1 and privacy.accountant.steps == 1 and 0 < privacy.epsilon() < float("inf")
    assert cli.trainer.strategy.plan.current is not None


def test_print_config_shows_the_recipe(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_lightning_cli(["fit", "-c", str(CONFIGS / "ddpm_unet_tiny.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "lightning_tbp.diffusion.DiffusionModule" in printed and "memory_budget: 0.5" in printed


@pytest.mark.parametrize(
    ("given", "printed"),
    [("1.0", "1.0"), ("0.5", "0.5"), ("1000000", "1000000"), ("24GiB", "24GiB"), ("auto", "auto"), ("null", "null")],
)
def test_the_cli_keeps_the_kind_of_a_memory_budget(given: str, printed: str, capsys) -> None:
    """The strategies' ``memory_budget`` hint is a union the CLI parses: a fraction stays a float
    (1.0 is the whole naive step, not one byte), bytes an int, a size or "auto" a string."""
    args = ["fit", "-c", str(CONFIGS / "ddpm_unet_tiny.yaml"), f"--trainer.strategy.memory_budget={given}"]
    with pytest.raises(SystemExit) as exit_info:
        run_lightning_cli([*args, "--print_config"])
    assert exit_info.value.code == 0
    assert f"memory_budget: {printed}\n" in capsys.readouterr().out


def fit(
    module: DiffusionModule, data: L.LightningDataModule, tmp_path: Path, ckpt_path: str | None = None, **trainer_kwargs
) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, "limit_val_batches": 0, **trainer_kwargs},
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


@pytest.mark.slow
def test_tiny_recipe_loss_goes_down_on_the_bundled_digits(tmp_path) -> None:
    L.seed_everything(0)
    losses = Losses()
    module = DiffusionModule(model_config=tiny_unet_config(1), lr=1e-3, sample_images=0, export=False)
    fit(module, DigitsDataModule(batch_size=16), tmp_path, max_steps=40, callbacks=[losses])
    assert np.mean(losses.values[-8:]) < 0.5 * np.mean(losses.values[:4])


@pytest.mark.parametrize("layout", ["model_folder", "pipeline_folder"])
def test_finetune_from_local_weights_and_reload_with_diffusers(layout, pretrained_unet, image_folder, tmp_path) -> None:
    source = pretrained_unet
    if layout == "pipeline_folder":
        source = tmp_path / "pipeline"
        DDPMPipeline(
            unet=UNet2DModel.from_pretrained(pretrained_unet), scheduler=DiffusionModule().noise_scheduler
        ).save_pretrained(source)
    initial = UNet2DModel.from_pretrained(pretrained_unet).state_dict()
    module = DiffusionModule(pretrained=str(source), lr=1e-2, sample_images=0, export_dir=str(tmp_path / "out"))
    assert all(torch.equal(initial[k], v) for k, v in module.model.state_dict().items())
    fit(module, ImageFolderDataModule(str(image_folder), image_size=32, batch_size=4), tmp_path, max_steps=2)

    pipeline = DDPMPipeline.from_pretrained(tmp_path / "out")
    reloaded = pipeline.unet.state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in module.model.state_dict().items())
    assert any(not torch.equal(initial[k], reloaded[k]) for k in initial)
    images = pipeline(batch_size=2, num_inference_steps=2, output_type="np").images
    assert images.shape == (2, 32, 32, 3) and np.isfinite(images).all()


def test_resume_from_a_checkpoint_continues_the_run(tmp_path) -> None:
    L.seed_everything(0)
    data = DigitsDataModule(batch_size=8)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    first = DiffusionModule(model_config=tiny_unet_config(1), ema_decay=0.9, sample_images=0, export=False)
    fit(first, data, tmp_path, max_steps=2, enable_checkpointing=True, callbacks=[checkpoints])
    saved = {k: v.clone() for k, v in first.state_dict().items()}

    class WeightsAtStart(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.step = trainer.global_step

    start = WeightsAtStart()
    second = DiffusionModule(model_config=tiny_unet_config(1), ema_decay=0.9, sample_images=0, export=False)
    trainer = fit(
        second, data, tmp_path, max_steps=4, callbacks=[start], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert start.step == 2 and trainer.global_step == 4
    assert all(torch.equal(saved[k], v) for k, v in start.weights.items())  # model and EMA weights restored
    adam_steps = {float(state["step"]) for state in trainer.optimizers[0].state.values()}
    assert adam_steps == {4.0}
    assert int(second.ema.n_averaged) == 4


def test_v_prediction_ema_and_flops(tmp_path) -> None:
    L.seed_everything(0)
    module = DiffusionModule(
        model_config=tiny_unet_config(1), prediction_type="v_prediction", ema_decay=0.5, sample_images=0, export=False
    )
    initial = {k: v.clone() for k, v in module.model.state_dict().items()}
    fit(module, DigitsDataModule(batch_size=4), tmp_path, max_steps=2)
    assert module.noise_scheduler.config.prediction_type == "v_prediction"
    trained, ema = module.model.state_dict(), module.ema.module.state_dict()
    changed = [k for k in trained if not torch.equal(trained[k], initial[k])]
    assert changed and all(not torch.equal(ema[k], trained[k]) for k in changed)

    # The meta-device count equals a real run's with the math attention kernel. (torch 2.13's
    # FlopCounter has no formula for the CPU flash-attention kernel, so a plain CPU count misses
    # attention entirely.)
    real = build_model("unet2d", tiny_unet_config(1))
    x, t = torch.randn(4, 1, 32, 32), torch.zeros(4, dtype=torch.long)
    with sdpa_kernel(SDPBackend.MATH):
        expected = measure_flops(real, lambda: real(x, t).sample, lambda out: out.sum())
    assert module.flops_per_batch == expected


def test_dit_and_conditional_unet_sample_grids(image_folder, tmp_path) -> None:
    L.seed_everything(0)
    dit = DiffusionModule(
        family="dit",
        model_config=tiny_dit_config(3, 3),
        sample_images=4,
        sample_steps=2,
        guidance_scale=2.0,
        export=False,
    )
    data = ImageFolderDataModule(str(image_folder), image_size=32, batch_size=4, val_fraction=0.25)
    fit(dit, data, tmp_path / "dit", max_steps=1, limit_val_batches=1, val_check_interval=1)
    assert Image.open(dit.last_sample_grid).size == (2 * 34 + 2, 2 * 34 + 2)

    torch.save({name: torch.randn(5, 16) for name in ("a", "b", "c")}, tmp_path / "embeddings.pt")
    config = {
        **tiny_unet_config(3),
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": 16,
    }
    conditional = DiffusionModule(family="unet2d_condition", model_config=config, sample_images=4, sample_steps=2)
    conditioned = ImageFolderDataModule(
        str(image_folder), image_size=32, batch_size=4, val_fraction=0.25, embeddings=str(tmp_path / "embeddings.pt")
    )
    fit(conditional, conditioned, tmp_path / "cond", max_steps=1, limit_val_batches=1, val_check_interval=1)
    assert conditional.last_sample_grid.is_file()
    assert (conditional.exported_to / "unet" / "config.json").is_file()


def test_a_latents_file_is_read_by_rows_and_refused_by_name_where_it_is_not_one(tmp_path) -> None:
    from lightning_tbp.diffusion import LatentsDataModule

    rows = {"latents": torch.randn(5, 4, 8, 8), "pooled_projections": torch.randn(5, 32), "labels": torch.arange(5)}
    torch.save(rows, tmp_path / "good.pt")
    data = LatentsDataModule(str(tmp_path / "good.pt"), batch_size=2, val_fraction=0.2)
    example = data.example_batch()
    assert {key: tuple(value.shape) for key, value in example.items()} == {
        "images": (2, 4, 8, 8),
        "pooled_projections": (2, 32),
        "labels": (2,),
    }
    data.setup()
    batch = next(iter(data.train_dataloader()))
    row = int(batch["labels"][0])  # each sample's tensors stay together
    assert torch.equal(batch["images"][0], rows["latents"][row])
    assert torch.equal(batch["pooled_projections"][0], rows["pooled_projections"][row])

    with pytest.raises(FileNotFoundError, match=r"latents file .* does not exist"):
        LatentsDataModule(str(tmp_path / "missing.pt")).setup()
    torch.save({"images": torch.zeros(2, 4, 8, 8)}, tmp_path / "no_latents.pt")
    with pytest.raises(ValueError, match="'latents'"):
        LatentsDataModule(str(tmp_path / "no_latents.pt")).setup()
    torch.save({"latents": torch.zeros(2, 4, 8, 8), "pooled_projections": torch.zeros(3, 32)}, tmp_path / "rows.pt")
    with pytest.raises(ValueError, match="one row per sample"):
        LatentsDataModule(str(tmp_path / "rows.pt")).setup()


def test_clear_errors_for_bad_data_and_model_folders(image_folder, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderDataModule(str(tmp_path / "missing")).setup()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        ImageFolderDataModule(str(tmp_path / "empty")).setup()
    mixed = write_images(tmp_path / "mixed", classes=("x",), per_class=1)
    (mixed / "x" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"notes\.txt is not an image file"):
        ImageFolderDataModule(str(mixed)).setup()
    broken = write_images(tmp_path / "broken", classes=("x",), per_class=1)
    (broken / "x" / "bad.png").write_bytes(b"this is not a png")
    data = ImageFolderDataModule(str(broken), image_size=16, batch_size=2)
    data.setup()
    with pytest.raises(ValueError, match=r"cannot read image .*bad\.png"):
        next(iter(data.train_dataloader()))

    with pytest.raises(FileNotFoundError, match=r"pretrained model directory .* does not exist"):
        DiffusionModule(pretrained=str(tmp_path / "no_model"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        DiffusionModule(pretrained=str(tmp_path / "empty"))
    DiTTransformer2DModel(**tiny_dit_config(3, 3)).save_pretrained(tmp_path / "dit")
    with pytest.raises(ValueError, match="holds a DiTTransformer2DModel"):
        DiffusionModule(family="unet2d", pretrained=str(tmp_path / "dit"))
    with pytest.raises(ValueError, match="unknown model family"):
        DiffusionModule(family="vae")


def test_the_reward_recipe_fine_tunes_through_the_chain_and_writes_its_adapters(tmp_path, capsys) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    try:
        from reward_finetune import main
    finally:
        sys.path.pop(0)
    model = main(["--steps", "3", "--max-steps", "2", "--batch-size", "2", "--out", str(tmp_path)])
    report = capsys.readouterr().out
    assert "#1" in report or "#2" in report, report  # a later call of the U-Net has a decision of its own
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert model.trainer.global_step == 2


def test_the_video_vae_recipe_fine_tunes_through_its_chunks_and_writes_the_vae(tmp_path, capsys) -> None:
    import sys

    from diffusers import AutoencoderKLWan

    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    try:
        from finetune_video_vae import main
    finally:
        sys.path.pop(0)
    model = main(["--max-steps", "2", "--memory-budget", "0.5", "--out", str(tmp_path)])
    report = capsys.readouterr().out
    assert "calls of vae.decoder" in report, report  # each chunk's call of the decoder planned on its own
    assert model.trainer.global_step == 2
    reloaded = AutoencoderKLWan.from_pretrained(tmp_path / "vae")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), model.vae.parameters(), strict=True))
    assert not any(p.requires_grad for p in model.vae.encoder.parameters())  # the decoder alone trains


def test_a_video_vae_loads_from_its_folder_or_a_pipelines_and_refuses_what_is_not_one(tmp_path) -> None:
    from diffusers import AutoencoderKLWan

    from lightning_tbp.diffusion.video_vae import VideoVAEFineTuneModule, tiny_wan_vae_config

    torch.manual_seed(0)
    AutoencoderKLWan(**tiny_wan_vae_config()).save_pretrained(tmp_path / "pipeline" / "vae")
    from_pipeline = VideoVAEFineTuneModule(pretrained=str(tmp_path / "pipeline"), train="all")
    from_folder = VideoVAEFineTuneModule(pretrained=str(tmp_path / "pipeline" / "vae"))
    for a, b in zip(from_pipeline.vae.parameters(), from_folder.vae.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(p.requires_grad for p in from_pipeline.vae.parameters())
    with pytest.raises(ValueError, match="holds no diffusers model"):
        VideoVAEFineTuneModule(pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        VideoVAEFineTuneModule(vae_config=tiny_wan_vae_config(), pretrained=str(tmp_path / "pipeline"))
    with pytest.raises(ValueError, match="'decoder' or 'all'"):
        VideoVAEFineTuneModule(train="encoder")  # type: ignore[arg-type]


def _flow_loss_and_its_draws(module: DiffusionModule, batch: dict) -> tuple[torch.Tensor, ...]:
    """A flow family's loss on ``batch``, and the noise, noise levels (logit-normal, then shifted
    as the scheduler shifts its table) and noisy input it drew (the same seed replayed)."""
    torch.manual_seed(5)
    loss = module.diffusion_loss(batch)
    torch.manual_seed(5)
    x = batch["images"]
    noise = torch.randn_like(x)
    drawn, shift = torch.sigmoid(torch.randn(len(x))), module.noise_scheduler.config.shift
    s = shift * drawn / (1 + (shift - 1) * drawn)
    return loss, noise, s, (1 - s.view(-1, 1, 1, 1)) * x + s.view(-1, 1, 1, 1) * noise


def test_sd3_trains_by_rectified_flow_on_latents_and_samples_along_the_flow(latent_models, tmp_path) -> None:
    """The ``sd3`` family's loss is rectified flow's: at noise level s (logit-normal, shifted by 3)
    the input is (1 - s) x + s n and the target the velocity n - x, the timestep s times 1000; its sampler integrates a
    velocity back to the data (a model that knows the data's velocity returns the data, under
    SD3's shift of 3). A LoRA fit on ``LatentsDataModule`` under the strategy writes adapters a
    fresh transformer loads, and a latent model refuses to draw image grids."""
    from types import SimpleNamespace

    from lightning_tbp import TinyBackpropStrategy
    from lightning_tbp.diffusion import LatentsDataModule
    from lightning_tbp.diffusion.sampling import sample

    pretrained, latents = latent_models["sd3"], latent_models["latents"]
    module = DiffusionModule(family="sd3", pretrained=str(pretrained), sample_images=0, export=False)
    assert module.noise_scheduler.config.shift == 3.0  # SD3's released scheduler's, as diffusers trains it
    batch = {key: value[:3] for key, value in torch.load(latents).items()}
    batch["images"] = batch.pop("latents")
    loss, noise, s, noisy = _flow_loss_and_its_draws(module, batch)
    x = batch["images"]
    with torch.no_grad():
        prediction = module.model(
            noisy,
            encoder_hidden_states=batch["encoder_hidden_states"],
            pooled_projections=batch["pooled_projections"],
            timestep=s * 1000,
        ).sample
    torch.testing.assert_close(loss.detach(), (prediction - (noise - x)).square().mean(dim=(1, 2, 3)))

    data = x[:2].clamp(-1, 1)

    class KnowsTheFlow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(()))

        def forward(self, noisy, timestep, **conditioning):  # type: ignore[no-untyped-def]
            level = (timestep / 1000).view(-1, 1, 1, 1)
            return SimpleNamespace(sample=(noisy - data) / level)

    conditioning = {key: batch[key][:2] for key in ("encoder_hidden_states", "pooled_projections")}
    drawn = sample(KnowsTheFlow(), module.family, module.noise_scheduler, tuple(data.shape), conditioning, steps=8)
    torch.testing.assert_close(drawn, data, atol=1e-4, rtol=0)

    with pytest.raises(ValueError, match="set sample_images=0"):
        DiffusionModule(family="sd3", pretrained=str(pretrained), sample_images=4)
    halved = DiffusionModule(family="sd3", pretrained=str(pretrained), weights_dtype="bfloat16", sample_images=0)
    assert {p.dtype for p in halved.model.parameters()} == {torch.bfloat16}  # loaded so, not converted later
    with pytest.raises(ValueError, match="rectified flow"):
        DiffusionModule(family="sd3", pretrained=str(pretrained), prediction_type="v_prediction", sample_images=0)

    lora = DiffusionModule(family="sd3", pretrained=str(pretrained), lora_rank=4, sample_images=0, ema_decay=0.9)
    data_module = LatentsDataModule(str(latents), batch_size=4, val_fraction=0.25)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        strategy=TinyBackpropStrategy(memory_budget=0.6),
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=1,
    )
    trainer.fit(lora, data_module)
    assert trainer.strategy.plan.current is not None
    steps = trainer.strategy.loop_steps()
    assert steps and all(step["peak_bytes"] <= step["budget_bytes"] for step in steps), steps
    loaded = load_lora(SD3Transformer2DModel.from_pretrained(pretrained), lora.exported_to)
    assert any("lora" in name for name, _ in loaded.named_parameters())


def test_flux_packs_its_latents_as_its_pipeline_and_fine_tunes_by_rectified_flow(latent_models, tmp_path) -> None:
    """The ``flux`` family packs latents in 2x2 patches as ``FluxPipeline`` does (and back), gives
    the transformer its timestep as the noise level (Flux scales it by 1000 itself) and, for a
    transformer with a guidance embedding, the module's ``guidance_embedding`` (refused without
    it, by name); a LoRA fit on latents under the strategy holds its budget and writes adapters a
    fresh transformer loads."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from lightning_tbp import TinyBackpropStrategy
    from lightning_tbp.diffusion import LatentsDataModule
    from lightning_tbp.diffusion.models import pack_latents, unpack_latents

    latents = torch.randn(2, 4, 8, 6)
    packed = pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 4, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), latents)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 48, 8), latents)

    flux, latents_file = str(latent_models["flux"]), str(latent_models["latents"])
    batch = {key: value[:2] for key, value in torch.load(latents_file).items()}
    batch["images"] = batch.pop("latents")

    unguided = DiffusionModule(family="flux", pretrained=flux, sample_images=0, export=False)
    with pytest.raises(ValueError, match="set the module's guidance_embedding"):
        unguided.diffusion_loss(batch)
    module = DiffusionModule(family="flux", pretrained=flux, sample_images=0, export=False, guidance_embedding=3.5)
    assert module.noise_scheduler.config.shift == 1.0  # diffusers' Flux script trains unshifted
    loss, noise, s, noisy = _flow_loss_and_its_draws(module, batch)
    x = batch["images"]
    ids = torch.stack(torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        velocity = module.model(
            pack_latents(noisy),
            encoder_hidden_states=batch["encoder_hidden_states"],
            pooled_projections=batch["pooled_projections"],
            timestep=s,
            img_ids=torch.cat([torch.zeros(64, 1), ids], dim=1),
            txt_ids=torch.zeros(12, 3),
            guidance=torch.full((2,), 3.5),
        ).sample
    expected = (unpack_latents(velocity, 16, 16) - (noise - x)).square().mean(dim=(1, 2, 3))
    torch.testing.assert_close(loss.detach(), expected)
    with pytest.raises(ValueError, match="Flux transformer's input"):
        DiffusionModule(model_config=tiny_unet_config(1), guidance_embedding=3.5)
    ZOO["flux"].build().save_pretrained(tmp_path / "schnell")  # no guidance embedding
    schnell = DiffusionModule(
        family="flux", pretrained=str(tmp_path / "schnell"), sample_images=0, guidance_embedding=3.5
    )
    with pytest.raises(ValueError, match="unset guidance_embedding"):
        schnell.diffusion_loss(batch)

    lora = DiffusionModule(family="flux", pretrained=flux, lora_rank=4, sample_images=0, guidance_embedding=3.5)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        strategy=TinyBackpropStrategy(memory_budget=0.6),
        default_root_dir=tmp_path / "run",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=1,
    )
    trainer.fit(lora, LatentsDataModule(latents_file, batch_size=4, val_fraction=0.25))
    steps = trainer.strategy.loop_steps()
    assert steps and all(step["peak_bytes"] <= step["budget_bytes"] for step in steps), steps
    loaded = load_lora(FluxTransformer2DModel.from_pretrained(flux), lora.exported_to)
    assert any("lora" in name for name, _ in loaded.named_parameters())
