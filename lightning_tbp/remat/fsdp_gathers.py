"""FSDP2's all-gathered parameters in a profiled step.

FSDP2 keeps, per unit (a module ``fully_shard`` was applied to), buffers its parameters are
all-gathered into, for the life of the model, and frees and re-allocates their bytes by resizing
their storage, which no dispatched op shows: the recorder, which follows tensors, would count
them from whenever it first saw them (made inside the profile: alive to the forward's end; made
before it: held, never counted). So the buffers are taken as held, made before recording if a
unit was never gathered, and each call of a unit is a span of the trace's events whose gathered
bytes the simulation adds itself (``SimulatedStep``): from the span's first event, freed after
its last one where the unit reshards after its forward, gathered again when the backward reaches
the span (or a recompute runs into it) and freed after the backward of its first event. The
root's parameters, gathered before its forward, stay until the backward ends.

In one process (one device) that is the whole of what FSDP2 allocates: its reduce-scatter of a
unit's gradients makes no transient above the level it starts at (measured on CPU with gloo).
Across processes it keeps each reduce-scatter's full-size input until the next unit's and the
backend adds copies of its own; those are not modelled yet, so there the buffers are left to the
recorder as before (over-counted when first made inside the profile, else not counted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_tbp.compat import fsdp2_gather_buffers, fsdp2_reshards_after_forward


@dataclass(frozen=True)
class GatherSpan:
    """One call of an FSDP2 unit in the profiled forward: its events and what it gathers."""

    first_event: int
    last_event: int
    nbytes: int
    regathered: bool  # freed when its forward ends and gathered again for its backward


def sharded_units(module: nn.Module) -> list[nn.Module]:
    """The modules under ``module`` (itself included) that FSDP2 has sharded as units (the
    strategy's choice of units is ``strategies.distributed.fsdp2_units``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]


@contextlib.contextmanager
def gather_spans(
    module: nn.Module,
    inside_call: bool,
    events_so_far: Callable[[], int],
    hold: Callable[[torch.Tensor, int, bool], None],
) -> Iterator[list[GatherSpan]]:
    """While recording ``module``'s forward: the spans of its FSDP2 units' calls, filled in as
    they run (empty where nothing is sharded). ``hold(tensor, nbytes, trains)`` registers a
    buffer as held at its gathered size (its parameter's gradient is that size, before FSDP2
    reduce-scatters it); ``events_so_far()`` is the trace's event count."""
    spans: list[GatherSpan] = []
    units = sharded_units(module)
    if not units or (dist.is_initialized() and dist.get_world_size() > 1):
        # across processes the collectives' own buffers (the reduce-scatter's input, kept until
        # the next unit's; a backend's copies) are not modelled yet: the recorder counts the
        # gather buffers as it sees them, as before this module (docs/multi_device.md)
        yield spans
        return
    root_gathered = inside_call and module in units  # its pre-forward hook gathered it for this call
    sizes: dict[int, int] = {}
    for unit in units:
        if not (root_gathered and unit is module) and not fsdp2_gather_buffers(unit):
            unit.unshard()  # type: ignore[operator]  # FSDP2 makes a unit's buffers at its first gather
            unit.reshard()  # type: ignore[operator]
        sizes[id(unit)] = 0
        for tensor, trains in fsdp2_gather_buffers(unit):
            nbytes = tensor.numel() * tensor.element_size()
            hold(tensor, nbytes, trains)
            sizes[id(unit)] += nbytes
    opened: dict[int, list[int]] = {}

    def enter(unit: nn.Module, _: tuple) -> None:
        opened.setdefault(id(unit), []).append(events_so_far())

    def leave_for(regathered: bool) -> Callable[[nn.Module, tuple, object], None]:
        def leave(unit: nn.Module, _: tuple, __: object) -> None:
            first = opened[id(unit)].pop()
            spans.append(GatherSpan(first, events_so_far() - 1, sizes[id(unit)], regathered))

        return leave

    handles = []
    for unit in units:
        if root_gathered and unit is module:
            continue  # its call is the whole recording
        regathered = unit is not module and fsdp2_reshards_after_forward(unit)
        handles.append(unit.register_forward_pre_hook(enter, prepend=True))
        handles.append(unit.register_forward_hook(leave_for(regathered)))
    try:
        yield spans
        if root_gathered:
            spans.append(GatherSpan(0, events_so_far() - 1, sizes[id(module)], False))
    finally:
        for handle in handles:
            handle.remove()
