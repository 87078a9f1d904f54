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

    config = model.peft_config["default"].to_dict()
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in get_peft_model_state_dict(model).items()}
    path = Path(directory) / WEIGHT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}
    safetensors.torch.save_file(weights, str(path), metadata=metadata)
    return path


def load_lora(model: nn.Module, directory: str | Path) -> nn.Module:
    """Inject the adapters saved in ``directory`` (by :func:`save_lora` or diffusers) into ``model``."""
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
    inject_adapter_in_model(LoraConfig(**json.loads(metadata)), model)
    result = set_peft_model_state_dict(model, safetensors.torch.load_file(str(path)))
    missing = [key for key in result.missing_keys if "lora_" in key]
    if result.unexpected_keys or missing:
        raise ValueError(f"{path} does not fit {type(model).__name__}: {result.unexpected_keys or missing}")
    return model
