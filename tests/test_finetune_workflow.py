"""A fine-tuner's path: their own image files and captions, to a LoRA that diffusers and ComfyUI load.

Each step as a user meets it: image files in the modes real datasets hold, the folder layouts of
Hugging Face and kohya, aspect-ratio buckets, the encoding cache (and what it must never do: pair
an image with another's caption, or read another model's entries), then whole runs of the
configs' command on tiny pipelines, the adapters loaded by the pipeline's own
``load_lora_weights`` and by ComfyUI's key rules, and generation changed by them.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import diffusers
import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from lightning_tbp.diffusion import CaptionedImagesDataModule, DiffusionModule
from lightning_tbp.diffusion.buckets import bucket_sizes, fill, place
from lightning_tbp.diffusion.captioned_folder import DatasetError, scan_folder
from lightning_tbp.diffusion.encoding_cache import EncodingCache
from lightning_tbp.diffusion.image_files import UnreadableImageError, load_rgb
from lightning_tbp.diffusion.lora import KOHYA_WEIGHT_NAME, WEIGHT_NAME
from lightning_tbp.lightning_cli import run_lightning_cli
from lightning_tbp.testing.tiny_pipelines import CAPTIONS, write_captioned_images, write_tiny_pipeline

CONFIGS = Path(__file__).parent.parent / "configs"


def _png(image: Image.Image, **options) -> io.BytesIO:
    data = io.BytesIO()
    image.save(data, format="PNG", **options)
    data.seek(0)
    return data


# -- image files ----------------------------------------------------------------------------------
def test_a_16_bit_grayscale_png_reads_at_its_brightness_not_clipped_white() -> None:
    half = Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16))
    assert half.mode.startswith("I;16")
    pixels = np.asarray(load_rgb(_png(half)))
    assert pixels.shape == (8, 8, 3)
    assert abs(float(pixels.mean()) - 128) <= 1  # PIL's convert("RGB") reads it as 255
    assert np.asarray(half.convert("RGB")).mean() > 250  # why the scaling is needed


def test_transparency_is_composited_over_white() -> None:
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 255  # red, fully transparent: hidden
    rgba[0, 0] = (0, 0, 255, 255)  # one opaque blue pixel
    pixels = np.asarray(load_rgb(_png(Image.fromarray(rgba, "RGBA"))))
    assert (pixels[1:, :] == 255).all() and tuple(pixels[0, 0]) == (0, 0, 255)
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pixels = np.asarray(load_rgb(_png(palette, transparency=1)))  # index 1 (red) transparent
    assert (pixels == 255).all()


def test_exif_orientation_is_applied_and_cmyk_converted() -> None:
    image = Image.new("RGB", (40, 20), (10, 200, 30))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    data = io.BytesIO()
    image.save(data, format="JPEG", exif=exif.tobytes())
    data.seek(0)
    assert load_rgb(data).size == (20, 40)
    cmyk = io.BytesIO()
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(cmyk, format="JPEG")
    cmyk.seek(0)
    red = np.asarray(load_rgb(cmyk)).reshape(-1, 3).mean(0)
    assert red[0] > 200 and red[1] < 60 and red[2] < 60


def test_a_truncated_file_is_unreadable_by_name() -> None:
    whole = _png(Image.new("RGB", (64, 64), (1, 2, 3))).getvalue()
    with pytest.raises(UnreadableImageError):
        load_rgb(io.BytesIO(whole[: len(whole) // 2]))


# -- the folder -----------------------------------------------------------------------------------
def _folder(root: Path, names: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 12), (50, 60, 70)).save(root / name)
    return root


def test_captions_come_from_metadata_jsonl_csv_or_txt(tmp_path) -> None:
    jsonl = _folder(tmp_path / "jsonl", ["a.png", "sub/b.png"])
    rows = [{"file_name": "a.png", "text": "first"}, {"file_name": "sub/b.png", "text": "second"}]
    (jsonl / "metadata.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    assert {e.path.name: e.caption for e in scan_folder(jsonl).entries} == {"a.png": "first", "b.png": "second"}
    table = _folder(tmp_path / "csv", ["a.png"])
    (table / "metadata.csv").write_text('file_name,text\na.png,"a, with a comma"\n')
    assert [e.caption for e in scan_folder(table).entries] == ["a, with a comma"]
    kohya = _folder(tmp_path / "txt", ["a.png", ".tbp_cache/hidden.png"])
    (kohya / "a.txt").write_text("  from the txt file \n")
    scan = scan_folder(kohya)
    assert [(e.path.name, e.caption, e.size) for e in scan.entries] == [("a.png", "from the txt file", (16, 12))]


def test_a_missing_caption_is_named_and_handled_as_configured(tmp_path) -> None:
    root = _folder(tmp_path, ["a.png", "b.png"])
    (root / "a.txt").write_text("captioned")
    with pytest.warns(UserWarning, match=r"1 image\(s\) have no caption, trained with an empty caption: .*b\.png"):
        assert sorted(e.caption for e in scan_folder(root).entries) == ["", "captioned"]
    with pytest.warns(UserWarning, match="skipped"):
        assert [e.path.name for e in scan_folder(root, missing_caption="skip").entries] == ["a.png"]
    with pytest.raises(DatasetError, match=r"b\.png has no caption.*missing_caption='empty'"):
        scan_folder(root, missing_caption="error")


def test_an_unreadable_file_is_named_and_skipped_or_refused(tmp_path) -> None:
    root = _folder(tmp_path, ["good.png"])
    (root / "good.txt").write_text("fine")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    with pytest.warns(UserWarning, match=r"skipping 1 unreadable image\(s\): .*broken\.png"):
        scan = scan_folder(root, missing_caption="skip")
    assert [e.path.name for e in scan.entries] == ["good.png"] and scan.unreadable[0][0].name == "broken.png"
    with pytest.raises(DatasetError, match=r"broken\.png cannot be decoded.*unreadable='skip'"):
        scan_folder(root, unreadable="error", missing_caption="skip")
    with pytest.raises(DatasetError, match="holds no image files"):
        scan_folder(_folder(tmp_path / "empty", []))


# -- buckets --------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    side=st.sampled_from([32, 64, 512, 1024]),
    step=st.sampled_from([8, 16, 64]),
    width=st.integers(8, 3000),
    height=st.integers(8, 3000),
)
def test_every_image_fills_its_bucket_exactly_at_the_nearest_aspect(side, step, width, height) -> None:
    if side % step:
        return
    buckets = bucket_sizes(side, step)
    assert all(b.width % step == 0 and b.height % step == 0 and b.width * b.height <= side * side for b in buckets)
    placement = place((width, height), buckets)
    bucket = placement.bucket
    aspect = np.log(width / height)
    assert abs(np.log(bucket.aspect) - aspect) <= min(abs(np.log(b.aspect) - aspect) for b in buckets) + 1e-12
    assert placement.original_size == (height, width)
    top, left = placement.crop_top_left
    assert top >= 0 and left >= 0
    if width * height <= 4_000_000 // 16:  # resize only small ones: the check is on geometry
        filled = fill(Image.new("RGB", (width, height)), placement)
        assert filled.size == (bucket.width, bucket.height)


def test_a_square_image_takes_the_square_bucket_and_buckets_refuse_a_bad_step() -> None:
    assert str(place((700, 700), bucket_sizes(512, 64)).bucket) == "512x512"
    with pytest.raises(ValueError, match="multiple of the bucket step"):
        bucket_sizes(500, 64)


# -- the encoding cache ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> Path:
    return write_tiny_pipeline("unet2d_condition", tmp_path_factory.mktemp("sd15"), CAPTIONS)


def _prepared(root: Path, pipeline: Path, **options) -> CaptionedImagesDataModule:
    data = CaptionedImagesDataModule(
        str(root), pretrained=str(pipeline), family="unet2d_condition", resolution=32, bucket_step=16, **options
    )
    data.prepare_data()
    data.setup("fit")
    return data


def test_the_cache_encodes_once_and_again_only_what_changed(sd15, tmp_path) -> None:
    root = write_captioned_images(tmp_path / "images")
    assert _prepared(root, sd15).last_encoded["latents"] == 4
    second = _prepared(root, sd15)
    assert (second.last_encoded["latents"], second.last_encoded["captions"]) == (0, 0)
    Image.new("RGB", (48, 32), (9, 9, 9)).save(root / "image_0.png")
    changed = _prepared(root, sd15)
    assert changed.last_encoded["latents"] == 1 and changed.last_encoded["captions"] == 0


def test_a_changed_caption_re_encodes_itself_alone(sd15, tmp_path) -> None:
    root = write_captioned_images(tmp_path / "images")
    _prepared(root, sd15)
    (root / "image_0.txt").write_text("a new caption")
    changed = _prepared(root, sd15)
    assert (changed.last_encoded["latents"], changed.last_encoded["captions"]) == (0, 1)


def test_each_sample_pairs_its_own_image_and_caption_whatever_the_order(sd15, tmp_path) -> None:
    """The cache keys on content: sample i's latents are its file's, its embeddings its caption's
    (computed here by the pipeline itself, not by our encoding code)."""
    root = write_captioned_images(tmp_path / "images")
    data = _prepared(root, sd15, batch_size=2)
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(sd15, local_files_only=True)
    buckets = bucket_sizes(32, 16)
    assert data.dataset is not None
    for index in torch.randperm(len(data.dataset)).tolist():
        record, sample = data.dataset.records[index], data.dataset[index]
        path = Path(record.path)
        filled = fill(load_rgb(path), place(Image.open(path).size, buckets))
        pixels = torch.from_numpy(np.array(filled)).permute(2, 0, 1).float()[None] / 127.5 - 1
        with torch.no_grad():
            latents = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
            (states, _) = pipe.encode_prompt(
                path.with_suffix(".txt").read_text(), "cpu", 1, do_classifier_free_guidance=False
            )
        torch.testing.assert_close(sample["images"], latents[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sample["encoder_hidden_states"], states[0], rtol=1e-4, atol=1e-5)
    batches = list(data.train_dataloader())
    assert all(len({tuple(b["images"].shape[1:])}) == 1 for b in batches)  # one bucket per batch
    assert sum(len(b["images"]) for b in batches) == 4


def test_another_models_cache_is_never_read(sd15, tmp_path) -> None:
    root = write_captioned_images(tmp_path / "images")
    _prepared(root, sd15)
    other = write_tiny_pipeline("unet2d_condition", tmp_path / "other", CAPTIONS)
    vae = diffusers.AutoencoderKL.from_pretrained(other / "vae")
    with torch.no_grad():
        vae.decoder.conv_out.bias.add_(1.0)
        vae.encoder.conv_in.weight.mul_(1.5)
    vae.save_pretrained(other / "vae")
    again = _prepared(root, other)
    assert again.last_encoded["latents"] == 4  # its own VAE: every image encoded anew
    assert again.last_encoded["captions"] == 0  # the same text encoder: its entries are valid


def test_an_entry_is_written_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    cache = EncodingCache(tmp_path)

    def dies_mid_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        cache.write("latents", "key", {"latents": torch.ones(2)})
    assert not cache.has("latents", "key")


# -- whole runs -----------------------------------------------------------------------------------
def _fit(config: str, pipeline: Path, images: Path, tmp_path: Path, *extra: str):
    args = ["fit", "-c", str(CONFIGS / config), "--trainer.accelerator=cpu", "--trainer.precision=32"]
    args += [f"--model.init_args.pretrained={pipeline}", f"--data.init_args.root={images}"]
    args += [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    args += ["--data.init_args.resolution=32", "--data.init_args.bucket_step=16", "--data.init_args.batch_size=2"]
    args += ["--model.init_args.weights_dtype=null", "--trainer.val_check_interval=null", "--trainer.max_steps=4"]
    args += ["--model.init_args.lr_warmup_steps=0", *extra]
    return run_lightning_cli(args)


def _generate(pipe, **extra) -> torch.Tensor:
    options = {"num_inference_steps": 2, "height": 32, "width": 32, "output_type": "pt", **extra}
    return pipe(["a red cube on a table"], generator=torch.Generator().manual_seed(0), **options).images


@pytest.mark.slow
def test_sd15_lora_from_images_to_diffusers_and_comfyui(sd15, tmp_path) -> None:
    """The README's command on a user's folder (one unreadable file in it): the adapters load
    into the pipeline by ``load_lora_weights`` and change what it generates; the kohya file
    follows ComfyUI's rules (every key ``lora_unet_`` + a U-Net weight's diffusers name with
    ``_`` for ``.``; down, up and alpha) and patches the weights as the trained model's are."""
    images = write_captioned_images(tmp_path / "images")
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = _fit(
            "finetune_sd15_lora.yaml",
            sd15,
            images,
            tmp_path,
            "--model.init_args.lr=0.01",
            "--model.init_args.validation_prompts=[a red cube on a table]",
            "--model.init_args.validation_steps=2",
            "--model.init_args.validation_resolution=32",
            "--trainer.limit_val_batches=1",
            "--trainer.check_val_every_n_epoch=1",
        )
    assert any("broken.png" in str(w.message) for w in caught)
    module: DiffusionModule = cli.model
    assert module.noise_scheduler.config.beta_schedule == "scaled_linear"  # the pipeline's, not the default
    assert module.last_prompt_grid is not None and module.last_prompt_grid.is_file()
    exported = Path(module.exported_to)
    base = diffusers.StableDiffusionPipeline.from_pretrained(sd15, local_files_only=True)
    before = _generate(base)
    tuned = diffusers.StableDiffusionPipeline.from_pretrained(sd15, local_files_only=True)
    tuned.load_lora_weights(exported)
    saved = safetensors.torch.load_file(str(exported / WEIGHT_NAME))
    loaded = [n for n, _ in tuned.unet.named_parameters() if "lora_" in n]
    assert len(loaded) == len(saved) > 0
    assert float((_generate(tuned) - before).abs().max()) > 1e-3

    kohya = safetensors.torch.load_file(str(exported / KOHYA_WEIGHT_NAME))
    weights = {n[: -len(".weight")]: w for n, w in base.unet.state_dict().items() if n.endswith(".weight")}
    by_kohya_name = {"lora_unet_" + name.replace(".", "_"): name for name in weights}
    stems = {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in kohya}
    assert stems <= set(by_kohya_name), sorted(stems - set(by_kohya_name))[:3]
    tuned.unet.fuse_lora()
    fused = dict(tuned.unet.named_parameters())
    for stem in stems:
        down, up = kohya[f"{stem}.lora_down.weight"], kohya[f"{stem}.lora_up.weight"]
        scale = float(kohya[f"{stem}.alpha"]) / down.shape[0]
        name = by_kohya_name[stem]
        patched = weights[name] + scale * (up.flatten(1) @ down.flatten(1)).reshape(weights[name].shape)
        torch.testing.assert_close(patched, fused[f"{name}.base_layer.weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "config", "pipeline_class"),
    [
        ("sdxl", "finetune_sdxl_lora.yaml", diffusers.StableDiffusionXLPipeline),
        ("sd3", "finetune_sd3_lora.yaml", diffusers.StableDiffusion3Pipeline),
        ("flux", "finetune_flux_lora.yaml", diffusers.FluxPipeline),
    ],
)
def test_a_lora_of_each_family_changes_what_its_pipeline_generates(family, config, pipeline_class, tmp_path) -> None:
    pipeline = write_tiny_pipeline(family, tmp_path / "pipe", CAPTIONS, guidance_embeds=family == "flux")
    images = write_captioned_images(tmp_path / "images")
    extra = ["--data.init_args.max_sequence_length=16"] if family in ("sd3", "flux") else []
    cli = _fit(
        config, pipeline, images, tmp_path, "--model.init_args.lr=0.01", "--model.init_args.sample_images=0", *extra
    )
    generation = {"max_sequence_length": 16} if family in ("sd3", "flux") else {}
    before = _generate(pipeline_class.from_pretrained(pipeline, local_files_only=True), **generation)
    tuned = pipeline_class.from_pretrained(pipeline, local_files_only=True)
    tuned.load_lora_weights(cli.model.exported_to)
    denoiser = tuned.unet if family == "sdxl" else tuned.transformer
    saved = safetensors.torch.load_file(str(Path(cli.model.exported_to) / WEIGHT_NAME))
    assert len([n for n, _ in denoiser.named_parameters() if "lora_" in n]) == len(saved) > 0
    assert float((_generate(tuned, **generation) - before).abs().max()) > 1e-3


def test_kohya_format_is_refused_for_a_transformer_before_training() -> None:
    with pytest.raises(ValueError, match="lora_format='diffusers'"):
        DiffusionModule(family="flux", lora_rank=4, lora_format="kohya")


def test_min_snr_weights_are_diffusers_compute_snr_clipped_on_the_pipelines_schedule(sd15) -> None:
    from diffusers.training_utils import compute_snr

    module = DiffusionModule(family="unet2d_condition", pretrained=str(sd15), snr_gamma=5.0, sample_images=0)
    assert module.noise_scheduler.config.beta_schedule == "scaled_linear"  # the pipeline's, not linear
    timesteps = torch.tensor([0, 10, 300, 999])
    snr = compute_snr(module.noise_scheduler, timesteps)
    torch.testing.assert_close(module._min_snr_weights(timesteps), torch.clamp(snr, max=5.0) / snr)
