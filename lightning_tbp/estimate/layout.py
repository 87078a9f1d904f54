"""Per-rank bytes under data parallelism, from a one-device estimate.

* ``ddp``: every rank holds the whole model; DDP's gradient buckets are one more copy of the
  trainable gradients (torch's default ``gradient_as_bucket_view=False``), held for the run.
* ``fsdp2`` (``tiny_backprop_fsdp2``: the target sharded per outermost ``ModuleList`` entry, see
  ``strategies.distributed.fsdp2_units``): the target's parameters, their gradients and
  optimizer state are 1/N per rank. What FSDP2 does inside the forward and backward (each
  unit's all-gather, the prefetch, the unsharded gradients until their reduce-scatter, an
  optimizer stepping inside the backward on the sharded ones) is the planner's simulation of
  the one-device trace with the spans the units would have (``remat.fsdp_gathers.PlannedSharding``),
  as for a sharded model it profiles; ``communication_bytes`` names two units' gathered
  parameters (the largest, and the one prefetched beside it).

The rest is modelled, not traced: the fake step runs on one device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from lightning_tbp.remat.fsdp_gathers import PlannedSharding
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


def planned_sharding(layout: Layout, target: nn.Module, through_copy: bool) -> PlannedSharding | None:
    """The sharding ``layout`` gives ``target``, for its profile (None where it shards nothing);
    ``through_copy``: the device's all-gather writes a copy of its output first."""
    if layout.kind != "fsdp2":
        return None
    return PlannedSharding(tuple(fsdp2_units(target)), layout.world_size, through_copy)


def per_rank(
    estimate: StepEstimate, layout: Layout, target: nn.Module, copies: Mapping[str, nn.Module] | None = None
) -> None:
    """Turn ``estimate`` (one device; under FSDP2 its forward and backward simulated per rank
    already) into one rank's figures under ``layout``, in place; ``copies``: modules, by their
    names in ``estimate.parameter_bytes``, holding copies of the target's weights kept sharded
    alike (their parameters only: FSDP2 shards no buffer)."""
    estimate.layout, estimate.world_size = layout.kind, layout.world_size
    if layout.kind == "ddp":
        estimate.communication_bytes = estimate.gradient_bytes
    if layout.kind != "fsdp2":
        return
    shed = 1 - 1 / layout.world_size
    parameters, gradients = _bytes(target, False), _bytes(target, True)
    owner = next(iter(estimate.parameter_bytes))  # the first module holds the target's storages
    estimate.parameter_bytes[owner] -= int(parameters * shed)
    for name, copy in (copies or {}).items():
        estimate.parameter_bytes[name] -= int(_bytes(copy, False) * shed)
    estimate.optimizer_state_bytes -= int(estimate.optimizer_state_bytes * shed)
    units = [target.get_submodule(path) for path in fsdp2_units(target)]
    estimate.communication_bytes = 2 * max((_bytes(unit, False) for unit in units), default=parameters)
    if not estimate.step_in_backward:  # the optimizer steps the sharded gradients after the backward
        estimate.optimizer_step_peak_bytes -= int(gradients * shed)
    estimate.gradient_bytes -= int(gradients * shed)
