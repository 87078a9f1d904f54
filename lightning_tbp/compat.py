"""Every private torch and Lightning API lightning_tbp uses, in one place, each with why and a test.

torch keeps these names out of its public API, so a release may move or change them; when one
breaks, this module (and ``tests/test_compat.py``, which exercises each) is the only place to fix.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.utils

# The base class of dispatch modes (the planner's profiler, lazy recipes, the CPU meter's no-op
# mode); torch documents subclassing it, but it lives in a private module.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

# Pytrees: torch's own flattening of nested args/kwargs (tuples, lists, dicts, dataclass-like
# outputs registered by torch); there is no public module for it in torch 2.13.
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: F401

# Fake tensors: tensors with shapes, dtypes and storages but no data, so ``tbp estimate`` runs a
# whole training step of a model that would not fit in this machine's memory. torch documents
# them (``torch._subclasses.fake_tensor``) but keeps them in a private module.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily  # noqa: F401  # isort: skip

# What fake tensors raise where an op needs values they do not have (``.item()``, ``.tolist()``,
# ``nonzero``): ``tbp estimate`` turns them into an error that names the model's line.
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException  # isort: skip

# Device type constants of the profiler's memory events (the exact CPU meter filters on them).
from torch._C._autograd import DeviceType  # noqa: F401  # isort: skip

# The kineto profiler's own entry points, under torch.profiler (the exact CPU meter's sessions).
from torch._C._autograd import _toggle_collection_dynamic  # isort: skip
from torch._C._profiler import ProfilerActivity as _ProfilerActivity  # isort: skip
from torch._C._profiler import ProfilerConfig as _ProfilerConfig  # isort: skip
from torch._C._profiler import ProfilerState as _ProfilerState  # isort: skip
from torch._C._profiler import _ExperimentalConfig  # isort: skip
from torch.autograd.profiler import _disable_profiler, _enable_profiler, _prepare_profiler  # isort: skip

# Flattening gradients into one buffer for a single all-reduce (DP's gradient sum over ranks).
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors  # noqa: F401  # isort: skip
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors  # noqa: F401  # isort: skip

FAKE_VALUE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)
OpOverload = torch._ops.OpOverload
"""The type of an aten op seen by a dispatch mode (``torch.ops.aten.mm.default``)."""


def op_packet(op: OpOverload) -> Any:
    """The overload packet of an aten op (``aten.mm`` for ``aten.mm.default``): ops are keyed by it."""
    return op._overloadpacket


def op_schema(op: OpOverload) -> Any:
    """The op's schema (its arguments and which outputs alias inputs)."""
    return op._schema


def is_view_op(op: Any) -> bool:
    """Whether ``op`` returns a view of an input (no write, no new storage): ``OpOverload.is_view``,
    derived from its schema's alias annotations; an in-place op is not a view."""
    return bool(getattr(op, "is_view", False))


def writes_input(op: Any) -> bool:
    """Whether ``op`` writes into an input (an in-place or ``out=`` op), by its schema's alias
    annotations; ``_unsafe_view`` shares its input's storage without being a view or a write."""
    return isinstance(op, OpOverload) and op_schema(op).is_mutable


def parameter_table(module: torch.nn.Module) -> Any:
    """The mapping of ``module``'s own registered parameters (``nn.Module._parameters``), which
    attribute reads, ``parameters()`` and ``functional_call`` all go through."""
    return module._parameters


def set_parameter_table(module: torch.nn.Module, table: Any) -> None:
    """Replace ``module``'s parameter mapping by ``table`` (a mapping that behaves as a dict): how
    the DP engine sees every read of a parameter through its module."""
    module._parameters = table


def make_leaf_subclass(cls: type[torch.Tensor], data: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A leaf tensor of subclass ``cls`` sharing ``data``'s storage; ``nn.Parameter`` is built the same way.

    A fake tensor (``tbp estimate``) is already a subclass instance, which ``_make_subclass``
    refuses to re-type: the leaf is then made over a meta tensor of the same layout (made outside
    the fake mode), with no storage to share; callers keep ``data`` itself for the values."""
    if isinstance(data, FakeTensor):
        with unset_fake_temporarily():
            data = torch.empty_strided(data.shape, data.stride(), dtype=data.dtype, device="meta")
    return torch.Tensor._make_subclass(cls, data, requires_grad)


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor``'s data has seen (shared by its views and ``detach()``es):
    autograd's own check that a saved tensor was not modified uses it; torch has no public name."""
    return tensor._version


def storage_key(tensor: torch.Tensor) -> int | None:
    """An identity of the storage behind ``tensor`` (views share it), None for storage-less tensors.

    ``untyped_storage()._cdata`` is the address of the C++ storage object: unlike
    ``data_ptr()`` it is defined for fake tensors, which have no data."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested, ...)
        return None


def storage_weak_ref(tensor: torch.Tensor) -> Any:
    """A weak reference to ``tensor``'s storage: ``.expired()`` says whether the storage is gone
    (torch's multiprocessing keeps such references; its class is not exported elsewhere). While
    it exists the storage object's address (``storage_key``) is not reused."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


def foreach_div_(tensors: list[torch.Tensor], divisor: float) -> None:
    """Divide many tensors in place in one fused call (the averaged DP gradient)."""
    torch._foreach_div_(tensors, divisor)


def conv_forward(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """A Conv layer's own forward with the given weight: its padding modes stay exactly as the layer applies them."""
    return cast(Any, module)._conv_forward(x, weight, bias)


def conv_explicit_padding(module: torch.nn.Module) -> tuple[int, ...]:
    """The padding a Conv layer applies with ``F.pad`` itself (non-zero padding modes, 'same')."""
    return tuple(cast(Any, module)._reversed_padding_repeated_twice)


def fake_mode_active() -> bool:
    """Whether tensors made now are fake (``tbp estimate``'s ``FakeTensorMode`` is on): a model's
    weights cannot be read from a file then, only its shapes made."""
    return isinstance(torch.empty(()), FakeTensor)


@contextlib.contextmanager
def fake_module_support() -> Iterator[None]:
    """Let fake modules (``tbp estimate``) be converted with ``Module.to(dtype)`` and deep-copied.

    Two gaps of torch 2.13 fake tensors, closed for the duration of the context:

    - ``Module._apply`` swaps a fake parameter with its converted copy through
      ``torch.utils.swap_tensors``, which refuses fake tensors (their fake mode holds weak
      references to them), so Lightning's ``bf16-true`` conversion or peft adding LoRA adapters
      fail on a fake model. Here a fake parameter takes the converted data instead: its
      identity, which is what the swap preserves, stays.
    - ``copy.deepcopy`` of a fake tensor (an EMA copy of a fake model) takes ``Tensor.__deepcopy__``'s
      storage path, which copies the fake storage's bytes through a data pointer it does not
      have: the process's heap is corrupted and crashes later, in an unrelated garbage
      collection. Here the copy is a fresh fake tensor of the same size, dtype and strides in
      the active fake mode (a fake copy has no values to keep)."""
    swap = torch.utils.swap_tensors

    def swap_or_set_data(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not isinstance(t1, FakeTensor):
            swap(t1, t2)
            return
        with torch.no_grad():
            t1.data = t2.data

    def fresh_copy(tensor: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
        if id(tensor) not in memo:
            copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            if getattr(tensor, "_is_param", False):
                copy = torch.nn.Parameter(copy, tensor.requires_grad)
            else:
                copy.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = copy
        return memo[id(tensor)]

    torch.utils.swap_tensors = swap_or_set_data
    FakeTensor.__deepcopy__ = fresh_copy  # type: ignore[method-assign,assignment]  # patched for the block only
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap
        del FakeTensor.__deepcopy__


def record_cuda_memory_history(max_entries: int, python_stacks_only: bool = False) -> None:
    """Start recording CUDA allocations with their stacks (``torch.cuda.memory``'s history, which
    torch documents for its memory visualiser but keeps private). ``python_stacks_only``: Python
    frames without C++ ones (cheaper to record and to read back)."""
    stacks = "python" if python_stacks_only else "all"
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)


def stop_cuda_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_snapshot() -> dict[str, Any]:
    """The recorded history and the allocator's segments, as a dict (``device_traces``: per device
    the events in order, each with ``action``, ``addr``, ``size`` and ``frames``)."""
    return torch.cuda.memory._snapshot()


def clear_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS keeps per thread and stream (``torch._C``'s, private; the
    caching allocator then holds them as free blocks)."""
    torch._C._cuda_clearCublasWorkspaces()


def dump_cuda_memory_snapshot(path: str) -> None:
    """:func:`cuda_memory_snapshot` pickled to ``path``, for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def make_data_parallel_only(strategy: Any, world_size: int) -> None:
    """Make Lightning's ``ModelParallelStrategy`` build a data-parallel mesh of ``world_size``
    (no tensor parallelism): its sizes live in private attributes, and its "auto" would make the
    processes of a node a tensor-parallel group."""
    strategy._data_parallel_size = world_size
    strategy._tensor_parallel_size = 1


def broadcast_module_states(module: torch.nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers to every rank, as DDP's constructor does (a DP
    run that wraps no module in DDP still needs every rank to start from the same weights):
    Lightning's helper for it is private."""
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(module)


def fsdp2_gather_buffers(unit: torch.nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """The tensors FSDP2 all-gathers ``unit``'s own parameters into (its param groups' private
    ``all_gather_outputs``, and the unsharded inner tensors of parameters with all-gather
    extensions), each with whether its parameter trains: kept for the module's life, their
    storage resized to nothing while sharded. Empty until the unit has been unsharded once."""
    return [
        (tensor, bool(param.sharded_param.requires_grad))
        for group in _fsdp2_param_groups(unit)
        for param in group.fsdp_params
        for tensor in (*param.all_gather_outputs, *getattr(param, "_unsharded_inner_tensors", ()))
    ]


def fsdp2_reshards_after_forward(unit: torch.nn.Module) -> bool:
    """Whether FSDP2 frees ``unit``'s gathered parameters when its forward ends (and gathers them
    again for its backward): its param groups' private ``post_forward_mesh_info`` is set (FSDP2
    clears it for the root, whose parameters stay gathered until the backward ends)."""
    return any(group.post_forward_mesh_info is not None for group in _fsdp2_param_groups(unit))


def fsdp2_reduce_inputs_kept(unit: torch.nn.Module) -> int:
    """How many reduce-scatter inputs FSDP2 keeps alive after their unit's backward (until as
    many later units' post-backwards have run, or the backward ends): its param groups' private
    ``reduce_scatter_max_input_buffers`` (torch 2.13; one, the last unit's, before it)."""
    return max(
        (getattr(group, "reduce_scatter_max_input_buffers", 1) for group in _fsdp2_param_groups(unit)), default=1
    )


def _fsdp2_param_groups(unit: torch.nn.Module) -> list[Any]:
    state = unit._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; one group before
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def profiler_enabled() -> bool:
    """Whether any torch profiler session is running in this process (torch has no public query;
    the exact CPU meter cannot start a session beside another)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


class MemoryEventSession:
    """A profiler session that records the allocator's events and no op: what the exact CPU meter reads.

    A profiler that records ops keeps, for every scope open when it starts recording one (an
    ``Optimizer.step`` that runs Lightning's whole closure, a DDP forward), a pointer into its
    own event buffer, written when the scope ends. The meter stops and starts sessions inside
    such scopes (a metered step inside a metered fit), and the next session then wrote that
    pointer into the freed buffer of the last one: heap corruption ("free(): invalid next
    size"). So op recording is switched off right after the session starts
    (``_toggle_collection_dynamic``): the allocator still reports every allocation and free, no
    scope is observed, and steps under the meter run without the op recorder's overhead. A mark
    switches recording on for its own empty scope only. Built on the kineto profiler's private
    entry points, which ``torch.profiler.profile`` wraps with no way to keep ops out."""

    # torch warns about GPU tracks on every toggle, even of a CPU-only session (the meter's
    # stderr filter drops it)
    _TOGGLED = frozenset({_ProfilerActivity.CPU})

    def __init__(self) -> None:
        config = _ProfilerConfig(_ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        _prepare_profiler(config, set(self._TOGGLED))
        _enable_profiler(config, set(self._TOGGLED))
        _toggle_collection_dynamic(False, set(self._TOGGLED))

    def mark(self, name: str) -> None:
        """An event named ``name`` at this instant, on the allocator events' clock."""
        _toggle_collection_dynamic(True, set(self._TOGGLED))
        with torch.profiler.record_function(name):
            pass
        _toggle_collection_dynamic(False, set(self._TOGGLED))

    def stop(self) -> Any:
        """End the session; its result, whose ``events()`` stay valid while it is referenced."""
        return _disable_profiler()


def lightning_skips_backward(trainer: Any) -> bool:
    """Whether Lightning's automatic optimisation skips this batch's backward and ``zero_grad``
    (``StochasticWeightAveraging`` sets it for its batch-norm epoch); Lightning keeps the flag private."""
    return bool(trainer.fit_loop._skip_backward)


def unobserved_step(cls: type[torch.optim.Optimizer]) -> Any:
    """The function behind ``cls.step`` without the hooks torch wraps around it.

    The planner steps twins of the user's optimizer (same class, options) on probes to size and
    time the real step; a global hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``),
    which a user's logger or EMA may have registered, must not see those steps. torch wraps each
    optimizer class's ``step`` once in ``Optimizer.profile_hook_step`` (marked ``hooked``), which runs
    the hooks around the function it wraps (``functools.wraps``: ``__wrapped__``). Raises
    ``TypeError`` where the class's ``step`` is no Python function (a test's class-level mock):
    it cannot be run, nor a twin made (torch's constructor reads ``step.hooked``), unobserved."""
    step = inspect.getattr_static(cls, "step")
    if not inspect.isfunction(step):  # checked first: a mock records even the reading of an attribute
        raise TypeError(f"{cls.__name__}.step is {type(step).__name__}, not a function: it cannot be imitated unseen")
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def step_unobserved(optimizer: torch.optim.Optimizer) -> Any:
    """Run ``optimizer``'s own ``step`` without the hooks torch wraps around it (:func:`unobserved_step`)."""
    return unobserved_step(type(optimizer))(optimizer)
