"""LoRA adapters for the recipes' denoisers, through peft, saved in diffusers' LoRA format.

Only the adapters train: the base weights are frozen, so gradients, optimizer state and (under
DP) per-sample norms exist for the adapters alone. Adapters are injected with peft's
``inject_adapter_in_model`` for every family (diffusers' ``add_adapter`` does the same, but only
``UNet2DConditionModel`` has it) and written as diffusers writes them: peft's adapter state dict
in ``pytorch_lora_weights.safetensors`` with the adapter config in the file's
``lora_adapter_metadata``. ``UNet2DConditionModel.load_lora_adapter(folder, prefix=None,
weight_name=WEIGHT_NAME)`` reads that file (diffusers 0.42 cannot guess the name of a local
file); :func:`load_lora` reads it into any of the three families.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

#: What diffusers calls the file and the metadata key (``diffusers.loaders.lora_base``).
WEIGHT_NAME, METADATA_KEY = "pytorch_lora_weights.safetensors", "lora_adapter_metadata"
#: Attention projections: the layers LoRA fine-tuning of diffusion models usually adapts.
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True)
class LoraOptions:
    """``rank``: the adapters' rank; ``alpha``: their scale numerator (scale alpha/rank; default
    rank); ``target_modules``: module names (or name suffixes) to adapt; ``dropout``: on the
    adapters' input."""

    rank: int
    alpha: float | None = None
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora_rank must be a positive integer, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora_target_modules must name at least one module")


def lora_options(
    rank: int, alpha: float | None = None, target_modules: list[str] | None = None, dropout: float = 0.0
) -> LoraOptions:
    """The options a module's ``lora_*`` arguments name (no targets: the attention projections)."""
    if target_modules:
        return LoraOptions(rank, alpha, tuple(target_modules), dropout)
    return LoraOptions(rank, alpha, dropout=dropout)


def add_lora(model: nn.Module, options: LoraOptions) -> int:
    """Freeze ``model`` and inject trainable LoRA adapters; returns the number of adapter parameters."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha if options.alpha is not None else options.rank,
        lora_dropout=options.dropout,
        target_modules=list(options.target_modules),
        init_lora_weights="gaussian",
    )
    model.requires_grad_(False)
    try:
        with warnings.catch_warnings():
            # over a torchao-quantized base peft warns that merging the adapters into it cannot
            # work; they are saved apart (``save_lora``), never merged
            warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass.*")
            inject_adapter_in_model(config, model)
    except ValueError as error:
        adaptable = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _adaptable(m)})
        raise ValueError(
            f"lora_target_modules {list(options.target_modules)} match no layer of {type(model).__name__} "
            f"({error}). Names of its Linear/Conv layers end in: {', '.join(adaptable[:20])}"
        ) from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv2d))


def save_lora(model: nn.Module, directory: str | Path) -> Path:
    """Write ``model``'s adapters as diffusers does; returns the file."""
    import safetensors.torch
    from peft.utils import get_peft_model_state_dict

    config = adapter_config(model)
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in get_peft_model_state_dict(model).items()}
    path = Path(directory) / WEIGHT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}
    safetensors.torch.save_file(weights, str(path), metadata=metadata)
    return path


LoraFormat = Literal["diffusers", "kohya"]
#: The kohya-format file :func:`save_pipeline_lora` writes beside diffusers' (what A1111 and
#: ComfyUI read as ``lora_unet_*`` keys with ``lora_down``/``lora_up`` and ``.alpha``).
KOHYA_WEIGHT_NAME = "lora_kohya.safetensors"


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The model's peft adapter config as JSON-able values (what the metadata key holds)."""
    config = model.peft_config["default"].to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}


def save_pipeline_lora(
    model: nn.Module, directory: str | Path, pipeline_type: Any, component: str, lora_format: LoraFormat = "diffusers"
) -> Path:
    """Write ``model``'s adapters with its pipeline's own ``save_lora_weights``, so the keys carry
    the component prefix (``unet.``, ``transformer.``) that ``pipeline.load_lora_weights`` looks
    for (a file without it loads as nothing, with only a logged warning), and the adapter config
    in the file's metadata. ``lora_format="kohya"``: also the kohya layout, for the U-Nets (SD,
    SDXL), beside it (:data:`KOHYA_WEIGHT_NAME`). Returns diffusers' file."""
    from peft.utils import get_peft_model_state_dict

    if lora_format == "kohya" and component != "unet":
        raise ValueError(f"lora_format='kohya' writes U-Net keys (lora_unet_*), not {component!r}'s")
    directory = Path(directory)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in get_peft_model_state_dict(model).items()}
    config = adapter_config(model)
    pipeline_type.save_lora_weights(
        directory,
        **{f"{component}_lora_layers": state, f"{component}_lora_adapter_metadata": config},
        safe_serialization=True,
    )
    if lora_format == "kohya":
        import safetensors.torch
        import torch
        from diffusers.utils import convert_state_dict_to_kohya

        kohya = convert_state_dict_to_kohya({f"unet.{name}": tensor for name, tensor in state.items()})
        alpha = float(config["lora_alpha"])
        kohya = {key: torch.tensor(alpha) if key.endswith(".alpha") else value for key, value in kohya.items()}
        safetensors.torch.save_file(kohya, str(directory / KOHYA_WEIGHT_NAME), metadata={"format": "pt"})
    return directory / WEIGHT_NAME


def load_lora(model: nn.Module, directory: str | Path) -> nn.Module:
    """Inject the adapters saved in ``directory`` (by :func:`save_lora`, :func:`save_pipeline_lora`
    or diffusers, with or without a component prefix) into ``model``."""
    import safetensors
    import safetensors.torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import set_peft_model_state_dict

    path = Path(directory) / WEIGHT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA adapters at {path}")
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = (handle.metadata() or {}).get(METADATA_KEY)
    if metadata is None:
        raise ValueError(f"{path} has no '{METADATA_KEY}' metadata: its rank and targets are unknown")
    config, weights = json.loads(metadata), safetensors.torch.load_file(str(path))
    prefixes = {name.split(".", 1)[0] for name in weights}
    if len(prefixes) == 1 and (prefix := prefixes.pop()) in ("unet", "transformer"):  # a pipeline's file
        weights = {name.removeprefix(f"{prefix}."): tensor for name, tensor in weights.items()}
        config = config.get(prefix, {key.removeprefix(f"{prefix}."): value for key, value in config.items()})
    inject_adapter_in_model(LoraConfig(**config), model)
    result = set_peft_model_state_dict(model, weights)
    missing = [key for key in result.missing_keys if "lora_" in key]
    if result.unexpected_keys or missing:
        raise ValueError(f"{path} does not fit {type(model).__name__}: {result.unexpected_keys or missing}")
    return model
