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

After a unit's backward, FSDP2 copies its parameters' gradients into one reduce-scatter input
(their full size) and keeps that buffer alive until the next unit's post-backward (or as many
later ones as the unit is told, ``set_reduce_scatter_max_input_buffers``), the last ones until
the backward ends: the simulation keeps them too. In one process that is the whole of what FSDP2
allocates (measured on CPU with gloo). Across processes it all-gathers into one flat output and
copies out of it (the forward keeps each output until the next unit's copy-out; the backward
prefetches the unit whose forward ended before the one it reaches), each gradient becomes a
1/world share once reduce-scattered: the simulation follows those too
(``SimulatedStep.gather``, ``pre_backward``, ``post_backward``).

An optimizer stepping inside the backward sees a gradient only there: FSDP2 runs a parameter's
post-accumulate-grad hooks on its sharded gradient, a view of the reduce-scatter output, so the
unit's full gradients stay until its post-backward (not stepped and freed one by one as autograd
completes them) and the output until every parameter of the unit is stepped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_tbp.compat import fsdp2_gather_buffers, fsdp2_reduce_inputs_kept, fsdp2_reshards_after_forward
from lightning_tbp.memory.meters import gloo_runs_the_collectives
from lightning_tbp.remat.trace import Gathers, GatherSpan, Trace

#: The collective FSDP2 all-gathers a unit's parameters with (``dist.all_gather_into_tensor``).
_ALL_GATHER_OP = "_allgather_base_.default"


def sharded_units(module: nn.Module) -> list[nn.Module]:
    """The modules under ``module`` (itself included) that FSDP2 has sharded as units (the
    strategy's choice of units is ``strategies.distributed.fsdp2_units``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]


def is_dtensor_class(kind: type) -> bool:
    """Whether ``kind`` is DTensor's (the class of FSDP2's shards) or a subclass of it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return issubclass(kind, DTensor)


def _gathered_now(unit: nn.Module) -> bool:
    return any(tensor.untyped_storage().nbytes() for tensor, _ in fsdp2_gather_buffers(unit))


@contextlib.contextmanager
def root_left_as_found(module: nn.Module, inside_call: bool) -> Iterator[None]:
    """Planning runs ``module``'s forward with no backward after it (the profile, the timings),
    and FSDP2 keeps a root's parameters gathered from its forward until a backward ends: a plan
    made outside the module's call would leave them gathered, so the next step, whose plan counts
    their gather, would find them made already (and free them in its backward). So a root that
    was sharded before planning is resharded after it. Inside the call, the call's own forward
    gathered them, and they stay."""
    root_sharded = not inside_call and module in sharded_units(module) and not _gathered_now(module)
    try:
        yield
    finally:
        if root_sharded and _gathered_now(module):
            module.reshard()  # type: ignore[operator]


@dataclass(frozen=True)
class PlannedSharding:
    """FSDP2 as ``tiny_backprop_fsdp2`` would shard a module that is not sharded (``tbp
    estimate`` profiles the one-device step under fake tensors): its units besides the module
    itself (``strategies.distributed.fsdp2_units``), the processes, and whether the all-gather
    goes through a copy of its output (gloo's; NCCL's writes into it)."""

    unit_paths: tuple[str, ...]
    world: int
    gathers_through_copy: bool = False


def _planned_units(module: nn.Module, planned: PlannedSharding) -> dict[nn.Module, list[tuple[int, bool]]]:
    """Each unit of ``planned`` (the module last) with its own parameters' bytes and whether
    each trains: a unit's parameters are those no unit inside it owns, as ``fully_shard`` groups
    them."""
    units = [module.get_submodule(path) for path in planned.unit_paths] + [module]
    owned: set[int] = set()
    params: dict[nn.Module, list[tuple[int, bool]]] = {}
    for unit in units:  # the module, which holds every other unit, comes last
        params[unit] = []
        for param in unit.parameters():
            if id(param) not in owned:
                owned.add(id(param))
                params[unit].append((param.numel() * param.element_size(), param.requires_grad))
    return params


def _held_gather_buffers(
    unit: nn.Module, hold: Callable[[torch.Tensor, int, bool], None], gathered_now: bool
) -> list[tuple[int, bool]]:
    """``unit``'s gather buffers, each registered as held (``hold``), with its bytes and whether
    its parameter trains; made first where the unit was never gathered (unless it is now)."""
    if not gathered_now and not fsdp2_gather_buffers(unit):
        unit.unshard()  # type: ignore[operator]  # FSDP2 makes a unit's buffers at its first gather
        unit.reshard()  # type: ignore[operator]
    buffers = []
    for tensor, trains in fsdp2_gather_buffers(unit):
        nbytes = tensor.numel() * tensor.element_size()
        hold(tensor, nbytes, trains)
        buffers.append((nbytes, trains))
    return buffers


@contextlib.contextmanager
def gather_spans(
    module: nn.Module,
    inside_call: bool,
    events_so_far: Callable[[], int],
    hold: Callable[[torch.Tensor, int, bool], None],
    planned: PlannedSharding | None = None,
) -> Iterator[Gathers]:
    """While recording ``module``'s forward: the spans of its FSDP2 units' calls, filled in as
    they run (none where nothing is sharded). ``hold(tensor, nbytes, trains)`` registers a
    buffer as held at its gathered size (its parameter's gradient is that size, before FSDP2
    reduce-scatters it); ``events_so_far()`` is the trace's event count.

    ``planned``: ``module`` is not sharded, and the spans are those its sharding as planned would
    have; its parameters, already recorded at their full size, are what the units gather."""
    distributed = dist.is_available() and dist.is_initialized()
    gathers = Gathers(
        world=dist.get_world_size() if distributed else 1, gathers_through_copy=gloo_runs_the_collectives()
    )
    spans = gathers.spans
    units = sharded_units(module)
    as_planned = not units and planned is not None
    # each unit's gathered tensors: their bytes and whether their parameter trains
    if as_planned:
        assert planned is not None
        gathers.world, gathers.gathers_through_copy = planned.world, planned.gathers_through_copy
        gathered = _planned_units(module, planned)
        units = list(gathered)
    elif not units:
        yield gathers
        return
    root_gathered = inside_call and module in units  # its pre-forward hook gathered it for this call
    if not as_planned:
        gathered = {unit: _held_gather_buffers(unit, hold, root_gathered and unit is module) for unit in units}
        gathers.reduce_inputs_kept = max(fsdp2_reduce_inputs_kept(unit) for unit in units)
    sizes = {id(unit): sum(nbytes for nbytes, _ in tensors) for unit, tensors in gathered.items()}
    # bytes of the unit's gradients (its trainable parameters), and of its largest one's
    trained = {id(unit): sum(nbytes for nbytes, trains in tensors if trains) for unit, tensors in gathered.items()}
    largest = {
        id(unit): max((nbytes for nbytes, trains in tensors if trains), default=0) for unit, tensors in gathered.items()
    }
    opened: dict[int, list[int]] = {}
    called: set[int] = set()  # units whose first call's span is recorded

    def span_of(unit: nn.Module, first: int, last: int, regathered: bool) -> GatherSpan:
        first_call = id(unit) not in called
        called.add(id(unit))
        post_backward = first_call and sizes[id(unit)] > 0  # a unit with no parameters has no param group
        reduce_bytes, largest_bytes = (trained[id(unit)], largest[id(unit)]) if post_backward else (0, 0)
        return GatherSpan(first, last, sizes[id(unit)], regathered, post_backward, reduce_bytes, largest_bytes)

    def enter(unit: nn.Module, _: tuple) -> None:
        opened.setdefault(id(unit), []).append(events_so_far())

    def leave_for(regathered: bool) -> Callable[[nn.Module, tuple, object], None]:
        def leave(unit: nn.Module, _: tuple, __: object) -> None:
            first = opened[id(unit)].pop()
            spans.append(span_of(unit, first, events_so_far() - 1, regathered))

        return leave

    handles = []
    for unit in units:
        if root_gathered and unit is module:
            continue  # its call is the whole recording
        regathered = unit is not module and (as_planned or fsdp2_reshards_after_forward(unit))
        handles.append(unit.register_forward_pre_hook(enter, prepend=True))
        handles.append(unit.register_forward_hook(leave_for(regathered)))
    try:
        yield gathers
        if root_gathered:
            spans.append(span_of(module, 0, events_so_far() - 1, False))
    finally:
        for handle in handles:
            handle.remove()


def all_gather_outputs(trace: Trace) -> set[int]:
    """The storages made in the step that an all-gather writes: across processes, FSDP2's flat
    output of each unit's gather (an ``empty`` inside its pre-forward)."""
    return {
        sid
        for event, traits in enumerate(trace.event_traits)
        if traits.name == _ALL_GATHER_OP
        for sid in trace.event_inputs[event]
        if trace.storage_producer[sid] >= 0
    }


def uncount_all_gather_outputs(trace: Trace) -> None:
    """The recorder follows each flat all-gather output to its last reference, but the simulation
    adds those bytes itself, from the unit's span (``SimulatedStep.gather``): the trace's own
    copy of them counts nothing, or the forward would hold them twice."""
    if trace.fsdp.world > 1 and trace.fsdp.spans:
        for sid in all_gather_outputs(trace):
            trace.storage_bytes[sid] = 0
