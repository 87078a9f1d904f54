"""LoRA fine-tuning: only the adapters train (with the plan, under DP), and they reload in diffusers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DDPMPipeline, DDPMScheduler, DiTTransformer2DModel, UNet2DConditionModel, UNet2DModel
from dp_reference import clipped_at_median, per_sample_grads
from models import tiny_cond_unet
from test_recipes import CONFIGS, TINY_DIT, TINY_UNET, write_images

from lightning_tbp.diffusion import LoraOptions, add_lora, load_lora
from lightning_tbp.diffusion.lora import WEIGHT_NAME
from lightning_tbp.lightning_cli import run_lightning_cli
from lightning_tbp.privacy import attach


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("pretrained") / "tiny-ddpm"
    UNet2DModel(**TINY_UNET, in_channels=3, out_channels=3).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images"))


def _fit_recipe(pretrained: Path, images: Path, tmp_path: Path, *extra: str):
    args = ["fit", "-c", str(CONFIGS / "finetune_lora.yaml")]
    args += [f"--model.init_args.pretrained={pretrained}", f"--data.init_args.root={images}"]
    args += ["--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.precision=32"]
    args += [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    args += ["--data.init_args.batch_size=4", "--data.init_args.num_workers=0", "--data.init_args.val_fraction=0.2"]
    args += ["--model.init_args.sample_images=2", "--model.init_args.sample_steps=2", "--trainer.limit_val_batches=0"]
    return run_lightning_cli([*args, *extra])


def _only_adapters_moved(model: torch.nn.Module, pretrained: Path) -> None:
    base = UNet2DModel.from_pretrained(pretrained).state_dict()
    moved = []
    for name, value in model.state_dict().items():
        if "lora_" in name:
            moved.append(name)
            continue
        key = name.replace(".base_layer", "")
        assert torch.equal(value, base[key]), f"base weight {name} changed"
    assert moved
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in moved if n.endswith("weight")}


@pytest.mark.parametrize(
    "strategy",
    [[], ["--trainer.strategy.dp=ghost", "--trainer.strategy.noise_multiplier=1.0"]],
    ids=["plan", "plan_dp_ghost"],
)
def test_the_lora_recipe_trains_only_the_adapters(strategy, pretrained, images, tmp_path) -> None:
    cli = _fit_recipe(pretrained, images, tmp_path, "--trainer.strategy.memory_budget=0.6", *strategy)
    module, trainer = cli.model, cli.trainer
    assert trainer.global_step == 2 and trainer.strategy.plan.current is not None
    _only_adapters_moved(module.model, pretrained)
    adapters = [p for n, p in module.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in adapters)  # gaussian init of A, B moved from 0 by training
    assert (module.exported_to / WEIGHT_NAME).is_file()
    if strategy:
        assert trainer.strategy.privacy.accountant.steps == 2


def test_a_lora_ema_averages_the_adapters_alone_and_samples_and_exports_them(pretrained, images, tmp_path) -> None:
    """Under LoRA the EMA keeps a copy of the adapters, not of the frozen base; sampling and the
    export use the averaged adapters, and the trained ones are back in the model after each."""
    cli = _fit_recipe(
        pretrained, images, tmp_path, "--trainer.strategy.memory_budget=null", "--model.init_args.ema_decay=0.5"
    )
    module = cli.model
    trainable = {n.replace(".", "__"): p for n, p in module.model.named_parameters() if p.requires_grad}
    averaged = dict(module.ema.module.named_parameters())
    assert averaged.keys() == trainable.keys() and int(module.ema.n_averaged) == 2
    assert any(not torch.equal(averaged[n], trainable[n]) for n in trainable)  # an average, not the last weights
    trained = {n: p.detach().clone() for n, p in trainable.items()}
    with module.inference_model() as model:
        assert model is module.model
        assert all(torch.equal(p, averaged[n]) for n, p in trainable.items())
    assert all(torch.equal(p, trained[n]) for n, p in trainable.items())
    module.sample(1, steps=1)
    assert all(torch.equal(p, trained[n]) for n, p in trainable.items())
    exported = load_lora(UNet2DModel.from_pretrained(pretrained), module.exported_to)
    for name, param in exported.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(param, averaged[name.replace(".", "__")], msg=name)


def test_lora_adapters_reload_into_a_ddpm_pipeline_with_the_same_samples(pretrained, images, tmp_path) -> None:
    cli = _fit_recipe(pretrained, images, tmp_path, "--trainer.strategy.memory_budget=null")
    trained = cli.model.model.eval()
    reloaded = load_lora(UNet2DModel.from_pretrained(pretrained), cli.model.exported_to).eval()
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    outputs = []
    for unet in (trained, reloaded):
        pipeline = DDPMPipeline(unet=unet, scheduler=scheduler)
        generator = torch.Generator().manual_seed(3)
        outputs.append(pipeline(batch_size=1, generator=generator, num_inference_steps=3, output_type="np").images)
    assert (outputs[0] == outputs[1]).all()
    plain = DDPMPipeline(unet=UNet2DModel.from_pretrained(pretrained).eval(), scheduler=scheduler)
    base = plain(batch_size=1, generator=torch.Generator().manual_seed(3), num_inference_steps=3, output_type="np")
    assert not (base.images == outputs[0]).all()  # the adapters change the samples


def test_diffusers_loads_the_adapters_of_a_conditional_unet(tmp_path) -> None:
    from lightning_tbp.diffusion import save_lora

    torch.manual_seed(0)
    base = tiny_cond_unet()
    base.save_pretrained(tmp_path / "base")
    model = UNet2DConditionModel.from_pretrained(tmp_path / "base")
    add_lora(model, LoraOptions(rank=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    save_lora(model, tmp_path / "lora")
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "base")
    loaded.load_lora_adapter(str(tmp_path / "lora"), prefix=None, weight_name=WEIGHT_NAME)
    x = torch.randn(2, 4, 16, 16)
    states = torch.randn(2, 3, model.config.cross_attention_dim)
    with torch.no_grad():
        want = model(x, torch.tensor([10, 500]), encoder_hidden_states=states).sample
        got = loaded(x, torch.tensor([10, 500]), encoder_hidden_states=states).sample
        plain = base(x, torch.tensor([10, 500]), encoder_hidden_states=states).sample
    torch.testing.assert_close(got, want)
    assert not torch.allclose(plain, want)


def _unet2d():
    model = UNet2DModel(**TINY_UNET, in_channels=3, out_channels=3)
    return model, lambda call, b: call(b["x"], b["t"]).sample.square().flatten(1).mean(1)


def _dit():
    model = DiTTransformer2DModel(**TINY_DIT, in_channels=3, out_channels=3, num_embeds_ada_norm=10)

    def loss(call, b):
        return call(b["x"], timestep=b["t"], class_labels=b["labels"]).sample.square().flatten(1).mean(1)

    return model, loss


@pytest.mark.parametrize("build", [_unet2d, _dit], ids=["unet2d", "dit"])
def test_a_dp_step_on_lora_adapters_is_exact(build) -> None:
    torch.manual_seed(0)
    model, loss = build()
    add_lora(model, LoraOptions(rank=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    batch = {
        "x": torch.randn(4, 3, 32, 32),
        "t": torch.tensor([1, 200, 400, 900]),
        "labels": torch.tensor([1, 2, 3, 4]),
    }
    grads = per_sample_grads(model, loss, batch)
    expected, _, clip = clipped_at_median(grads)
    engine = attach(model, "ghost", clip, 0.0)
    try:
        engine.backward(loss(model, batch))
        for name, param in model.named_parameters():
            if param.requires_grad:
                torch.testing.assert_close(param.grad, expected[name], rtol=1e-4, atol=1e-6)
            else:
                assert param.grad is None, name
    finally:
        engine.detach()


def test_lora_options_are_checked() -> None:
    from lightning_tbp.diffusion import DiffusionModule

    with pytest.raises(ValueError, match="match no layer of UNet2DModel"):
        add_lora(UNet2DModel(**TINY_UNET), LoraOptions(rank=2, target_modules=("nonexistent",)))
    with pytest.raises(ValueError, match="need lora_rank"):
        DiffusionModule(model_config=TINY_UNET, lora_alpha=4)
    with pytest.raises(ValueError, match="positive integer"):
        LoraOptions(rank=0)


def test_a_layer_with_adapters_is_one_layer_to_the_planner() -> None:
    """peft wraps each adapted Linear in a module with submodules (base layer, adapter dicts);
    the planner's candidate blocks stay those of the plain model, and a plan on the adapted
    model trains its adapters exactly."""
    from lightning_tbp import rematerialize
    from lightning_tbp.remat.record import candidate_modules

    torch.manual_seed(0)
    model = tiny_cond_unet()
    plain = sorted(candidate_modules(model).values())
    add_lora(model, LoraOptions(4, target_modules=("to_q", "to_k", "to_v", "to_out.0")))
    adapted = sorted(candidate_modules(model).values())
    assert adapted == plain and any("lora_A" in name for name, _ in model.named_modules())

    x, t, text = torch.randn(2, 4, 16, 16), torch.tensor([3, 7]), torch.randn(2, 5, 32)
    for p in model.parameters():  # adapters start at zero (lora_B): make their gradients non-trivial
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)

    def adapter_grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x, t, encoder_hidden_states=text).sample.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    reference = adapter_grads()
    plan = rematerialize(model, x, t, memory_budget=0.6, encoder_hidden_states=text)
    assert plan.current is not None and plan.current.options
    planned = adapter_grads()
    plan.remove()
    assert reference.keys() == planned.keys() and reference
    for name in reference:
        torch.testing.assert_close(planned[name], reference[name], rtol=1e-6, atol=1e-7, msg=name)
