"""A quantized frozen base for LoRA fine-tuning (QLoRA-style), through torchao.

The frozen base of a LoRA fine-tune is most of what a device holds (a Flux-size transformer's
bf16 weights are ~22 GiB); stored as int8 or NF4 it takes about a half or a quarter of that.
This changes the numerics (the base the adapters learn on is the quantized one), so it is the
user's choice, never the planner's: ``DiffusionModule(base_quantization=...)``. The planner then
counts the weights as they are held (``memory.breakdown.plain_tensors``), and traces, recomputes
and differentiates the quantized layers like any other (gradients equal plain autograd's of the
quantized model; the dequantization inside a quantized matmul is measured as that op's
workspace, forward and backward, ``remat.record.dequantization_peak``).

- ``"int8"``: torchao's weight-only int8 (``Int8WeightOnlyConfig``), a scale per output row;
  every ``Linear``. torchao's own int8 linear keeps a dequantized copy of its weight for the
  backward (a frozen 1024x1024 layer held 2 MiB in bf16 after the forward, against 8 KiB
  unquantized), which would hold the base twice over an unplanned step; the layers run through
  :class:`FrozenQuantizedLinear` instead, which saves the int8 weight and dequantizes it again
  in the backward, as torchao's NF4 linear does. Both kinds follow autocast there.
- ``"nf4"``: torchao's NF4 (QLoRA's 4-bit NormalFloat, blocks of 64 with double-quantized
  scales in blocks of 256). A layer whose size does not divide into those blocks takes the
  largest scale block that divides it (at least 2); one that does not divide into blocks of 64
  stays as it is. Both are reported.

Only the base's ``Linear`` layers are quantized (convolutions, norms and embeddings stay), before
the adapters are injected, so the adapters train in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_tbp.memory.breakdown import tensor_bytes
from lightning_tbp.optional_imports import import_torchao
from lightning_tbp.remat.record import dequantized

BaseQuantization = Literal["int8", "nf4"]
QUANTIZATIONS: tuple[str, ...] = ("int8", "nf4")

_NF4_BLOCK = 64
_NF4_SCALER_BLOCK = 256


@dataclass(frozen=True)
class QuantizedBase:
    """What :func:`quantize_base` did."""

    kind: str
    layers: int  # Linear layers quantized
    skipped: tuple[str, ...]  # Linear layers left as they are (their size does not divide into blocks)
    bytes_before: int  # the model's parameter bytes
    bytes_after: int

    def describe(self) -> str:
        skipped = f"; {len(self.skipped)} left as they are ({', '.join(self.skipped[:3])}...)" if self.skipped else ""
        return (
            f"{self.kind} base: {self.layers} Linear layers quantized, parameters "
            f"{self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB{skipped}"
        )


def quantize_base(model: nn.Module, kind: str) -> QuantizedBase:
    """Quantize ``model``'s ``Linear`` weights in place (call before injecting adapters)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"base_quantization must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    try:
        quantization = import_torchao("torchao.quantization")
    except ImportError as error:
        raise ImportError(
            "base_quantization needs torchao: pip install 'lightning-tbp[lowbit]' (or torchao)"
        ) from error
    device = next(model.parameters()).device
    before = tensor_bytes(model, [], device).parameters
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    skipped = tuple(
        name for name, layer in linears.items() if kind == "nf4" and _nf4_scaler_block(layer.weight.numel()) is None
    )
    quantized = {m for name, m in linears.items() if name not in skipped}
    if not quantized:
        raise ValueError(f"base_quantization={kind!r}: {type(model).__name__} has no Linear layer it can quantize")
    with torch.no_grad():
        if kind == "int8":
            quantization.quantize_(
                model, quantization.Int8WeightOnlyConfig(), filter_fn=lambda module, _: module in quantized
            )
        else:
            for layer in quantized:
                _to_nf4(layer)
    for layer in quantized:
        layer.__class__ = FrozenQuantizedLinear
        cast(FrozenQuantizedLinear, layer).saves_dequantized = kind == "int8"
        layer.weight.requires_grad_(False)
    return QuantizedBase(kind, len(quantized), skipped, before, tensor_bytes(model, [], device).parameters)


class _LinearOverFrozenWeight(torch.autograd.Function):
    """``F.linear`` over a frozen quantized weight that saves the weight as it is held."""

    @staticmethod
    @override
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @override
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (weight,) = ctx.saved_tensors
        return grads[0] @ dequantized(weight, grads[0].dtype), None, None


class FrozenQuantizedLinear(nn.Linear):
    """A ``Linear`` whose weight is a frozen torchao tensor (see the module's docstring). Under
    autocast its input is cast as autocast would cast it: autocast does not reach a matmul
    dispatched to a tensor subclass, whose output would stay in float32 (twice the bytes of
    every activation after it). ``saves_dequantized``: torchao's own linear keeps a dequantized
    copy of the weight for the backward (int8), so the layer runs its own, which saves the
    quantized weight (the input's gradient equal to torchao's within float rounding); NF4's
    linear saves only its 4-bit weight already."""

    saves_dequantized = True

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad):
            return super().forward(input)  # something trains it after all: autograd's own way
        device = input.device.type
        if torch.is_autocast_enabled(device):
            input = input.to(torch.get_autocast_dtype(device))
        if not self.saves_dequantized:
            return super().forward(input)
        return _LinearOverFrozenWeight.apply(input, self.weight, self.bias)


def _nf4_scaler_block(numel: int) -> int | None:
    """The scale block NF4 uses for a weight of ``numel`` elements: 256 blocks, or the largest
    power of two (at least 2) that divides its number of blocks; None if it cannot be NF4."""
    if numel % _NF4_BLOCK:
        return None
    blocks, scaler_block = numel // _NF4_BLOCK, _NF4_SCALER_BLOCK
    while blocks % scaler_block:
        scaler_block //= 2
    return scaler_block if scaler_block >= 2 else None


def _to_nf4(layer: nn.Linear) -> None:
    NF4Tensor = import_torchao("torchao.quantization").NF4Tensor

    scaler_block = _nf4_scaler_block(layer.weight.numel())
    assert scaler_block is not None, "a layer that cannot be NF4 is skipped"
    weight = NF4Tensor.from_tensor(layer.weight.detach(), _NF4_BLOCK, scaler_block)
    layer.weight = nn.Parameter(weight, requires_grad=False)
