"""Per-rank bytes under data parallelism, from a one-device estimate.

* ``ddp``: every rank holds the whole model; DDP's gradient buckets are one more copy of the
  trainable gradients (torch's default ``gradient_as_bucket_view=False``), held for the run.
* ``fsdp2`` (``tiny_backprop_fsdp2``: the target sharded per outermost ``ModuleList`` entry, see
  ``strategies.distributed.fsdp2_units``): the target's parameters, their gradients and
  optimizer state are 1/N per rank; during the forward and backward the largest unit is
  all-gathered while the next one is prefetched (two units' parameters) and its unsharded
  gradients exist until they are reduce-scattered (one unit's gradients).

These are modelled, not traced: the fake step runs on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from lightning_tbp.strategies.distributed import fsdp2_units

if TYPE_CHECKING:
    from lightning_tbp.estimate.step import StepEstimate

LAYOUTS = ("single", "ddp", "fsdp2")


@dataclass(frozen=True)
class Layout:
    kind: str = "single"
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown layout {self.kind!r}; choose one of {', '.join(LAYOUTS)}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be positive, got {self.world_size}")


def _bytes(module: nn.Module, trainable_only: bool) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen and (p.requires_grad or not trainable_only):
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def per_rank(estimate: StepEstimate, layout: Layout, target: nn.Module) -> None:
    """Turn ``estimate`` (one device) into one rank's figures under ``layout``, in place."""
    estimate.layout, estimate.world_size = layout.kind, layout.world_size
    if layout.kind == "ddp":
        estimate.communication_bytes = estimate.gradient_bytes
    if layout.kind != "fsdp2":
        return
    n = layout.world_size
    shed = 1 - 1 / n
    parameters, gradients = _bytes(target, False), _bytes(target, True)
    owner = next(iter(estimate.parameter_bytes))  # the first module holds the target's storages
    estimate.parameter_bytes[owner] -= int(parameters * shed)
    estimate.optimizer_state_bytes -= int(estimate.optimizer_state_bytes * shed)
    units = [target.get_submodule(path) for path in fsdp2_units(target)]
    largest = max((_bytes(unit, False) for unit in units), default=parameters)
    largest_grads = max((_bytes(unit, True) for unit in units), default=gradients)
    estimate.communication_bytes = 2 * largest + largest_grads
    estimate.forward_backward_peak_bytes += estimate.communication_bytes - int(gradients * shed)
    estimate.optimizer_step_peak_bytes -= int(gradients * shed)
    estimate.gradient_bytes -= int(gradients * shed)
