"""DP-SGD's per-sample clipping and noise for a plain PyTorch module, in four modes.

``attach`` gives every module that owns trainable parameters an instance-level ``forward``
that runs the layer with detached parameters and wraps the output in a ``_Tap``: an identity
autograd node whose backward sees the layer's output gradient next to the tensors it saved.
Autograd thus computes only input gradients; the engine forms the parameter gradients:

- ``ghost`` / ``flash``: two backward passes. The first accumulates each sample's squared
  gradient norm per layer (ghost norm or materialised per-sample gradient, whichever the cost
  rule picks; ``flash`` tiles the per-sample gradient instead) and keeps nothing. The second
  backpropagates ``Σ_i c_i loss_i`` and sums the (already clipped) gradients.
- ``bookkeeping`` / ``flash_bookkeeping``: one backward pass that records each layer's saved
  tensors and output gradient; once all norms are known, the clipped sum ``Σ_i c_i ∇_i`` of
  every layer comes from one contraction over the recorded operands.

Saved tensors go through ``ctx.save_for_backward``, so non-reentrant checkpointing (and the
rematerialization plan) recompute them like any other activation, and gradients stay exact.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tbp.privacy.layers import handler_for, trainable
from lightning_tbp.privacy.layers.registry import LayerHandler

MODES = ("ghost", "flash", "bookkeeping", "flash_bookkeeping")
#: Backward passes over one forward's graph per mode: a rematerialization plan for a graph
#: backpropagated twice must not use selective blocks (``Plan(backward_passes=...)``).
BACKWARD_PASSES = {"ghost": 2, "flash": 2, "bookkeeping": 1, "flash_bookkeeping": 1}
_CLIP_EPSILON = 1e-6  # as Opacus: c_i = min(1, C / (‖∇_i‖ + 1e-6))


class PerSampleLossError(ValueError):
    """The loss handed to ``backward`` is not one value per sample."""


@dataclass(eq=False)
class _Slot:
    """One tapped module: its handler and the parameters the engine writes gradients to."""

    name: str
    module: nn.Module
    handler: LayerHandler
    engine: DPEngine
    params: dict[str, nn.Parameter] = field(default_factory=dict)


class _Tap(torch.autograd.Function):
    """Identity on a layer's output; its backward hands (saved tensors, output gradient) to the engine."""

    @staticmethod
    def forward(ctx: Any, slot: _Slot, anchor: Tensor, output: Tensor, *saved: Tensor) -> Tensor:
        # ``anchor`` (one of the layer's trainable parameters) makes the output require grad even
        # when nothing upstream does: the parameters themselves enter the op detached.
        ctx.slot = slot
        ctx.save_for_backward(*saved)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # once: a checkpoint's recomputed tensors can be unpacked only once
        ctx.slot.engine._receive(ctx.slot, saved, grad_output)
        return (None, None, grad_output, *([None] * len(saved)))


class DPEngine:
    """Per-sample clipping (threshold ``max_grad_norm``) and Gaussian noise (std sigma·C) for a module.

    Use ``attach`` to make one. ``backward(loss)`` with a per-sample ``loss`` of shape [B] leaves
    in every trainable parameter's ``.grad`` the sum over samples of the clipped per-sample
    gradients plus noise (not divided by B); ``per_sample_norms`` then holds the [B] norms.
    """

    def __init__(
        self,
        module: nn.Module,
        mode: str,
        max_grad_norm: float,
        noise_multiplier: float,
        generator: torch.Generator | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown DP mode {mode!r}; choose one of {', '.join(MODES)}")
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}")
        self.module = module
        self.mode = mode
        self.max_grad_norm = float(max_grad_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.generator = generator
        self.per_sample_norms: Tensor | None = None
        self.clip_coefficients: Tensor | None = None
        self._slots = self._install(module)
        self._phase: str | None = None  # "norms", "sum" or "book" while a backward runs
        self._shared: set[_Slot] = set()
        self._norm_sq: Tensor | None = None
        self._pending: dict[_Slot, dict[str, Tensor]] = {}
        self._book: list[tuple[_Slot, tuple[Tensor, ...], Tensor]] = []

    # -- installation ---------------------------------------------------------------------------

    def _install(self, module: nn.Module) -> list[_Slot]:
        owners: dict[int, str] = {}
        plan: list[tuple[str, nn.Module, LayerHandler, dict[str, nn.Parameter]]] = []
        for name, sub in module.named_modules():
            params = trainable(sub)
            if not params:
                continue
            for param_name, param in params.items():
                if id(param) in owners:
                    raise ValueError(
                        f"parameter {name}.{param_name} is shared with {owners[id(param)]}; per-sample "
                        "clipping of tied parameters is not supported"
                    )
                owners[id(param)] = f"{name}.{param_name}"
            if "forward" in sub.__dict__:
                raise ValueError(
                    f"module {name!r} already has an instance-level forward (another wrapper?); "
                    "attach DP to the plain module"
                )
            plan.append((name, sub, handler_for(sub, name or type(sub).__name__), params))
        if not plan:
            raise ValueError(f"{type(module).__name__} has no trainable parameters to train privately")
        slots = []
        for name, sub, handler, params in plan:
            slot = _Slot(name, sub, handler, self, params)
            sub.forward = functools.partial(self._tapped_forward, slot)
            slots.append(slot)
        return slots

    @staticmethod
    def _tapped_forward(slot: _Slot, x: Tensor) -> Tensor:
        output, saved = slot.handler.forward(slot.module, x)
        return _Tap.apply(slot, next(iter(slot.params.values())), output, *saved)

    def detach(self) -> None:
        """Restore every module's own forward; the engine is unusable afterwards."""
        for slot in self._slots:
            slot.module.__dict__.pop("forward", None)
        self._slots = []

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for slot in self._slots for p in slot.params.values()]

    # -- the backward -----------------------------------------------------------------------------

    def backward(self, loss: Tensor, add_noise: bool = True) -> None:
        """Clip per sample and sum into ``.grad``; then add noise unless ``add_noise=False``.

        ``add_noise=False`` lets gradient accumulation sum several micro-batches first and call
        ``add_noise()`` once for the logical batch.
        """
        if not self._slots:
            raise RuntimeError("this DP engine was detached")
        if loss.dim() != 1:
            raise PerSampleLossError(
                f"DP needs the per-sample loss, shape [batch], to clip each sample; got shape {tuple(loss.shape)}. "
                "Reduce over every dimension but the batch (e.g. loss.mean(dim=(1, 2, 3))) and do not average "
                "over the batch"
            )
        self._shared = self._check_graph(loss)
        self._norm_sq = torch.zeros(loss.shape[0], dtype=torch.float32, device=loss.device)
        two_pass = BACKWARD_PASSES[self.mode] == 2
        try:
            self._phase = "norms" if two_pass else "book"
            torch.autograd.backward(loss.sum(), retain_graph=two_pass)
            self._finish_norms()
            coef = self.clip_coefficients
            if two_pass:
                self._phase = "sum"
                self._second_backward((loss * coef.to(loss.dtype)).sum())
            else:
                for slot, saved, grad_output in self._book:
                    self._accumulate(slot, slot.handler.clipped_sum(slot.module, saved, grad_output, coef))
        finally:
            self._phase, self._book, self._pending = None, [], {}
        if add_noise:
            self.add_noise()

    @property
    def backward_passes(self) -> int:
        """Backward passes over each forward's graph; give it to ``Plan(backward_passes=...)``."""
        return BACKWARD_PASSES[self.mode]

    def _second_backward(self, weighted_loss: Tensor) -> None:
        try:
            torch.autograd.backward(weighted_loss)
        except RuntimeError as error:
            if "selective activation checkpoint" not in str(error):
                raise
            raise RuntimeError(
                f"DP mode {self.mode!r} backpropagates each graph twice, and a selective checkpoint in the "
                "model gives its cached outputs to the first backward only. Make the rematerialization plan "
                f"with Plan(..., backward_passes={self.backward_passes}) (engine.backward_passes), which "
                "plans without selective blocks, or use a one-pass mode (bookkeeping, flash_bookkeeping)"
            ) from error

    def add_noise(self) -> None:
        """Add N(0, (sigma·C)²) to every trainable parameter's gradient (once per logical batch)."""
        std = self.noise_multiplier * self.max_grad_norm
        if std == 0:
            return
        for param in self.parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            noise = torch.randn(param.shape, generator=self.generator, device=param.device, dtype=torch.float32)
            param.grad.add_(noise.to(param.grad.dtype), alpha=std)

    def _check_graph(self, loss: Tensor) -> set[_Slot]:
        """Tapped modules reached more than once; error for any trainable module not reached at all."""
        if loss.grad_fn is None:
            raise PerSampleLossError("the loss does not require grad: was it computed from the module's output?")
        calls: dict[_Slot, int] = {}
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            slot = getattr(node, "slot", None)
            if isinstance(slot, _Slot) and slot.engine is self:
                calls[slot] = calls.get(slot, 0) + 1
            stack.extend(next_node for next_node, _ in node.next_functions)
        unused = [slot.name for slot in self._slots if slot not in calls]
        if unused:
            raise ValueError(
                f"trainable modules not used in this forward (or not reaching the loss): {', '.join(unused)}; "
                "per-sample clipping needs every trainable parameter in the graph: freeze them or use them"
            )
        return {slot for slot, count in calls.items() if count > 1}

    def _receive(self, slot: _Slot, saved: tuple[Tensor, ...], grad_output: Tensor) -> None:
        """One layer call's output gradient, in whichever pass is running."""
        if self._phase is None or slot.engine is not self:
            return  # a backward outside ``DPEngine.backward`` (e.g. a planner's profiling run)
        if grad_output.shape[0] != self._norm_sq.shape[0]:
            raise PerSampleLossError(
                f"module {slot.name!r} got a batch of {grad_output.shape[0]} but the loss has "
                f"{self._norm_sq.shape[0]} entries: the loss must hold one value per sample"
            )
        if self._phase == "sum":
            ones = torch.ones_like(self._norm_sq)
            self._accumulate(slot, slot.handler.clipped_sum(slot.module, saved, grad_output, ones))
            return
        if slot in self._shared:
            grads = slot.handler.per_sample_grads(slot.module, saved, grad_output)
            pending = self._pending.setdefault(slot, {})
            for name, grad in grads.items():
                pending[name] = grad if name not in pending else pending[name] + grad
        else:
            self._norm_sq += slot.handler.norm_sq(
                slot.module, saved, grad_output, self._method(slot, saved, grad_output)
            )
        if self._phase == "book":
            self._book.append((slot, saved, grad_output))

    def _method(self, slot: _Slot, saved: tuple[Tensor, ...], grad_output: Tensor) -> str:
        methods = slot.handler.norm_methods(slot.module, saved, grad_output)
        if self.mode.startswith("flash") and "flash" in methods:
            return "flash"
        return next(method for method in methods if method != "flash")

    def _finish_norms(self) -> None:
        for grads in self._pending.values():
            for grad in grads.values():
                self._norm_sq += grad.flatten(1).square().sum(dim=1)
        self._pending = {}
        self.per_sample_norms = self._norm_sq.sqrt()
        self.clip_coefficients = (self.max_grad_norm / (self.per_sample_norms + _CLIP_EPSILON)).clamp(max=1.0)

    @staticmethod
    def _accumulate(slot: _Slot, grads: dict[str, Tensor]) -> None:
        for name, grad in grads.items():
            param = slot.params[name]
            grad = grad.to(param.dtype)
            param.grad = grad if param.grad is None else param.grad.add_(grad)


def attach(
    module: nn.Module,
    mode: str = "bookkeeping",
    max_grad_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    generator: torch.Generator | None = None,
) -> DPEngine:
    """Make ``module`` clip per sample: see ``DPEngine``. Raises before any step for unsupported layers."""
    return DPEngine(module, mode, max_grad_norm, noise_multiplier, generator)


def expected_noise_std(noise_multiplier: float, max_grad_norm: float, expected_batch_size: float = 1.0) -> float:
    """Std of the noise on the gradient after dividing the noisy sum by the expected batch size."""
    if expected_batch_size <= 0 or math.isnan(expected_batch_size):
        raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
    return noise_multiplier * max_grad_norm / expected_batch_size
