"""Parameters used outside a layer handler, clipped exactly through the ops that use them.

Diffusion transformers add learned tables to batched activations (adaLN ``scale_shift_table``,
learned positional embeddings), models tie an embedding to an output projection, a parent reads
its child's weight, and unfamiliar layers use their weights in ops no handler knows. None of
these runs through a layer handler, and plain autograd would write such a parameter's summed,
unclipped gradient straight into ``.grad``.

While an engine is attached, reading a trainable parameter as a module attribute
(``self.scale_shift_table``) with gradients enabled returns a :class:`TrackedTensor` instead: a
detached alias of its data that sees, through ``__torch_function__``, every op applied to it.

- An op whose tensor arguments are all tracked (``p[None]``, ``p.float()``, ``p.chunk(6)``)
  returns tracked results: pure functions of the parameters, recorded as recipes.
- An op that combines tracked tensors with anything else is a *use*. It runs on plain tensors
  (so autograd still differentiates its other inputs), and its outputs pass through ``_RawUse``,
  an identity node whose backward hands the output gradient to the engine. The engine then forms
  each sample's parameter gradient as a vector-Jacobian product of that one op: row by row for
  ops known to act on each sample separately, otherwise by masking the output gradient to one
  sample at a time. Either way it is exact for any op, given the property DP needs anyway: each
  sample's loss depends on its own row of the op's output only (the engine's first-backward
  probe checks exactly that).
- ``detach()`` and ``.data`` give plain tensors without a gradient path, as they do on a
  parameter.

A tracked tensor is itself a leaf that requires grad, so an op that bypasses
``__torch_function__`` (a custom ``autograd.Function`` given the parameter) leaves an edge to it
in the graph, which the engine's coverage check finds and refuses: never a silently lost use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_tbp.compat import make_leaf_subclass, tree_flatten, tree_map
from lightning_tbp.privacy.errors import CoverageError
from lightning_tbp.privacy.step_model import TapNote
from lightning_tbp.remat.replay import recorded_call, replayed
from lightning_tbp.remat.step import note_layer, profiling_notes

#: Ops whose output row i depends only on row i of each batched input (dim 0 kept): their
#: per-sample VJPs are computed one row at a time (cost ~ one VJP of the op). Others are masked.
_ROWWISE = frozenset(
    {
        torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.where, torch.addcmul,
        torch.addcdiv, torch.lerp, torch.maximum, torch.minimum, torch.pow,
        Tensor.add, Tensor.sub, Tensor.mul, Tensor.div, Tensor.pow, Tensor.__add__, Tensor.__radd__,
        Tensor.__sub__, Tensor.__rsub__, Tensor.__mul__, Tensor.__rmul__, Tensor.__truediv__,
        Tensor.__rtruediv__, Tensor.__pow__, Tensor.__rpow__,
        F.linear, F.layer_norm, F.group_norm, F.rms_norm, F.conv1d, F.conv2d, F.conv3d, F.embedding,
        F.scaled_dot_product_attention,
    }
)  # fmt: skip
#: Ops whose VJP with respect to one argument needs only the other arguments' shapes: their
#: data arguments are saved as zero-stride placeholders, not kept alive.
_VALUE_FREE = frozenset(
    {torch.add, torch.sub, Tensor.add, Tensor.sub, Tensor.__add__, Tensor.__radd__, Tensor.__sub__, Tensor.__rsub__}
)
#: Python's in-place operators and the out-of-place ops they stand for.
_IN_PLACE_OPERATORS = {
    "__iadd__": Tensor.__add__,
    "__isub__": Tensor.__sub__,
    "__imul__": Tensor.__mul__,
    "__itruediv__": Tensor.__truediv__,
}
#: Bytes of masked output gradients materialised at once by the masked per-sample VJP.
MASKED_CHUNK_BYTES = 64 * 2**20


# -- recipes: how a tracked tensor is computed from the parameters ------------------------------


@dataclass(frozen=True, eq=False)
class _Leaf:
    param: nn.Parameter

    def build(self, values: dict[int, Tensor]) -> Tensor:
        return values[id(self.param)]


@dataclass(frozen=True, eq=False)
class _Op:
    func: Callable[..., Any]
    args: tuple
    kwargs: dict
    index: int | None  # which output of a tuple-returning op, None for a single tensor

    def build(self, values: dict[int, Tensor]) -> Tensor:
        args, kwargs = tree_map(_built(values), (self.args, self.kwargs), is_leaf=_is_recipe)
        out = self.func(*args, **kwargs)
        return out if self.index is None else out[self.index]


def _is_recipe(x: object) -> bool:
    return isinstance(x, (_Leaf, _Op))


def _is_placeholder(x: object) -> bool:
    return _is_recipe(x) or isinstance(x, _Saved)


def _built(values: dict[int, Tensor]) -> Callable[[Any], Any]:
    return lambda x: x.build(values) if _is_recipe(x) else x


@dataclass(frozen=True, eq=False)
class _Saved:
    """Placeholder for the ``index``-th tensor a use saved for its backward."""

    index: int


# -- the tracked tensor -------------------------------------------------------------------------


class TrackedTensor(Tensor):
    """A trainable parameter (or a pure function of some) as seen by the model's forward."""

    _value: Tensor
    _recipe: _Leaf | _Op
    _params: tuple[nn.Parameter, ...]
    _owner: Any  # the engine, which receives the uses' output gradients

    @staticmethod
    def wrap(value: Tensor, recipe: _Leaf | _Op, params: tuple[nn.Parameter, ...], owner: Any) -> TrackedTensor:
        plain = value.detach()
        tracked = make_leaf_subclass(TrackedTensor, plain, True)
        tracked._value, tracked._recipe, tracked._params, tracked._owner = plain, recipe, params, owner
        return tracked

    @property
    def parameter(self) -> nn.Parameter | None:
        """The parameter itself when this is its attribute read, None for a function of parameters."""
        return self._recipe.param if isinstance(self._recipe, _Leaf) else None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        tracked = [x for x in leaves if isinstance(x, TrackedTensor)]
        kind, name = _describe(func)
        if kind != "call":
            return _attribute(kind, name, func, args)
        if name in ("detach", *_METADATA) or not torch.is_grad_enabled():
            return _plain_call(func, args, kwargs)
        owner = tracked[0]._owner
        in_place = name in _IN_PLACE_OPERATORS or name == "__setitem__" or (name.endswith("_") and name[-2] != "_")
        if in_place or "out" in kwargs:
            return _in_place(func, name, args, kwargs, tracked, owner)
        if not any(_is_data(x) for x in leaves):
            return _pure(func, args, kwargs, tracked, owner)
        return _use(func, args, kwargs, tracked, owner)


#: Queries answered from the data: the tracked tensor has its parameter's metadata.
_METADATA = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size", "__len__",
        "shape", "dtype", "device", "layout", "is_cuda", "is_meta", "is_floating_point", "is_complex", "ndim",
        "untyped_storage", "data_ptr", "storage_offset", "__repr__", "__format__", "__str__", "__hash__",
        "itemsize", "nbytes", "names", "is_sparse", "is_quantized", "is_nested",
    }
)  # fmt: skip
#: Attributes of autograd's own: a parameter's are the parameter's; a function of parameters
#: reports what a non-leaf would.
_AUTOGRAD_ATTRIBUTES = {"grad": None, "requires_grad": True, "is_leaf": False, "grad_fn": None, "_version": 0}


def _describe(func: Any) -> tuple[str, str]:
    """("get" | "set", attribute) for a property access, ("call", name) for an op or method."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return name[2:5], getattr(getattr(func, "__self__", None), "__name__", "")
    return "call", name


def _attribute(kind: str, name: str, func: Any, args: tuple) -> Any:
    """Reading or setting a property of a tracked tensor, as a parameter would answer."""
    target: TrackedTensor = args[0]
    param = target.parameter
    if kind == "set":
        if param is None:
            raise CoverageError(f"cannot set {name!r} on a tensor computed from trainable parameters")
        return setattr(param, name, _plain(args[1]))
    if name == "data":
        return target._value
    if name in _AUTOGRAD_ATTRIBUTES:
        return getattr(param, name) if param is not None else _AUTOGRAD_ATTRIBUTES[name]
    if name in _METADATA or not torch.is_grad_enabled():
        return _plain_call(func, args, {})
    return _pure(func, args, {}, [target], target._owner)  # a view property: .T, .mT, .real


def _is_data(x: Any) -> bool:
    """A tensor that carries values into an op, as opposed to one that only selects.

    Integer and boolean tensors (indices, masks) have no gradient, so an op combining a tracked
    tensor with them alone is still a function of the parameters: ``pos_embed[:, index]``
    (AuraFlow's learned positions, cropped to the image), ``table[labels]`` or ``torch.where(mask,
    p, 0)``. Kept as a recipe, the index travels with it, and the op that later meets the data
    differentiates through both, per sample. Taken as a use instead, the selection's output
    (``[1, positions, dim]`` for the positions) has no batch dimension to clip by.
    """
    return isinstance(x, Tensor) and not isinstance(x, TrackedTensor) and (x.is_floating_point() or x.is_complex())


def _plain(x: Any) -> Any:
    return x._value if isinstance(x, TrackedTensor) else x


def _plain_call(func: Any, args: tuple, kwargs: dict) -> Any:
    args, kwargs = tree_map(_plain, (args, kwargs))
    return func(*args, **kwargs)


def _params_of(tracked: list[TrackedTensor]) -> tuple[nn.Parameter, ...]:
    return tuple({id(p): p for t in tracked for p in t._params}.values())


def _pure(func: Any, args: tuple, kwargs: dict, tracked: list[TrackedTensor], owner: Any) -> Any:
    """An op on tracked tensors alone: its tensor results are tracked, with a recipe."""
    out = _plain_call(func, args, kwargs)
    recipe_args, recipe_kwargs = tree_map(lambda x: x._recipe if isinstance(x, TrackedTensor) else x, (args, kwargs))
    params = _params_of(tracked)

    def wrap(value: Any, index: int | None) -> Any:
        if not isinstance(value, Tensor) or not value.is_floating_point():
            return value
        return TrackedTensor.wrap(value, _Op(func, recipe_args, recipe_kwargs, index), params, owner)

    if isinstance(out, (tuple, list)):
        return type(out)(wrap(value, i) for i, value in enumerate(out))
    return wrap(out, None)


def _in_place(func: Any, name: str, args: tuple, kwargs: dict, tracked: list[TrackedTensor], owner: Any) -> Any:
    """``x += p`` is ``x.copy_(x + p)`` with the use tracked; on a parameter's attribute read the op
    applies to the parameter itself (exactly what plain torch does, errors included); writing into
    a function of parameters is refused."""
    target = args[0] if args else None
    if isinstance(target, TrackedTensor) and target.parameter is not None:
        rest = tree_map(_plain, (args[1:], kwargs))
        return func(target.parameter, *rest[0], **rest[1])
    out_of_place = None if name == "__setitem__" else _IN_PLACE_OPERATORS.get(name) or getattr(Tensor, name[:-1], None)
    if isinstance(target, TrackedTensor) or "out" in kwargs or out_of_place is None:
        qualified = ", ".join(owner.describe_param(p) for p in _params_of(tracked))
        raise CoverageError(
            f"the forward writes in place ({name}) into or from a tensor computed from trainable parameter(s) "
            f"{qualified}; per-sample clipping needs the out-of-place op (e.g. `x = x + p`, not `x += p`)"
        )
    return target.copy_(out_of_place(*args, **kwargs))


def _use(func: Any, args: tuple, kwargs: dict, tracked: list[TrackedTensor], owner: Any) -> Any:
    """An op mixing tracked tensors with data: run it plainly, route its outputs through ``_RawUse``."""
    args, kwargs = owner.mark_reads(_params_of(tracked), args, kwargs)
    out = _plain_call(func, args, kwargs)
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    positions = [i for i, o in enumerate(outputs) if isinstance(o, Tensor) and o.is_floating_point()]
    if not positions:
        return out
    saved: list[Tensor] = []
    value_free = func in _VALUE_FREE

    def record(x: Any) -> Any:
        if isinstance(x, TrackedTensor):
            return x._recipe
        if isinstance(x, Tensor):
            saved.append(x.detach().new_zeros(()).expand(x.shape) if value_free else x.detach())
            return _Saved(len(saved) - 1)
        return x

    recipe_args, recipe_kwargs = tree_map(record, (args, kwargs))
    use = RawUse(
        func=func,
        args=recipe_args,
        kwargs=recipe_kwargs,
        params=_params_of(tracked),
        output_positions=tuple(positions),
        tuple_output=isinstance(out, (tuple, list)),
        rowwise=func in _ROWWISE,
        owner=owner,
    )
    tapped = _RawUse.apply(use, owner.anchor, len(positions), *(outputs[i] for i in positions), *saved)
    first = tapped[0]
    parameter_bytes = sum(p.numel() * 4 for p in use.params)
    batch = first.shape[0] if first.dim() else 1
    masked = 0 if use.rowwise else min(MASKED_CHUNK_BYTES, batch * first.numel() * 4)
    per_sample = 2 * batch * parameter_bytes + masked
    output_bytes = sum(t.numel() * t.element_size() for t in tapped)
    note = TapNote(
        tuple(saved),
        first,
        norm_bytes=per_sample,
        sum_bytes=output_bytes,
        parameter_bytes=parameter_bytes,
        book_copy_bytes=output_bytes,
    )
    if profiling_notes():  # the formulas above stand only where the meter cannot run
        note.meter, note.meter_key = owner.use_meter(use, tapped, tuple(saved))
    note_layer(note)
    if not use.tuple_output:
        return tapped[0]
    result = list(outputs)
    for position, tensor in zip(positions, tapped, strict=True):
        result[position] = tensor
    return type(out)(result) if isinstance(out, tuple) else result


# -- a use and its per-sample gradients ---------------------------------------------------------


@dataclass(eq=False)
class RawUse:
    """One op that used tracked parameters in one forward: enough to redo its VJP."""

    func: Callable[..., Any]
    args: tuple
    kwargs: dict
    params: tuple[nn.Parameter, ...]
    output_positions: tuple[int, ...]
    tuple_output: bool
    rowwise: bool
    owner: Any

    @property
    def op_name(self) -> str:
        return getattr(self.func, "__name__", None) or repr(self.func)

    def recipe_key(self) -> str:
        """The op's non-tensor arguments, with placeholders for what enters as tensors: uses with
        equal keys, layouts and parameter shapes compute alike."""
        described = tree_map(
            lambda x: type(x).__name__ if _is_placeholder(x) else x, (self.args, self.kwargs), is_leaf=_is_placeholder
        )
        return repr(described)

    def call(self, values: tuple[Tensor, ...], saved: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The op's differentiable outputs as a function of the parameters' values."""
        env = {id(p): v for p, v in zip(self.params, values, strict=True)}

        def resolve(x: Any) -> Any:
            if isinstance(x, _Saved):
                return saved[x.index]
            return x.build(env) if _is_recipe(x) else x

        args, kwargs = tree_map(resolve, (self.args, self.kwargs), is_leaf=_is_placeholder)
        out = self.func(*args, **kwargs)
        outputs = out if self.tuple_output else (out,)
        return tuple(outputs[i] for i in self.output_positions)

    def summed_grads(self, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> dict[nn.Parameter, Tensor]:
        """``Σ_i`` of the per-sample gradients weighted into ``grads``: one batched VJP."""
        values = tuple(p.detach() for p in self.params)
        _, vjp_fn = torch.func.vjp(lambda *v: self.call(v, saved), *values)
        return dict(zip(self.params, vjp_fn(grads), strict=True))

    def per_sample_grads(
        self, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], batch: int
    ) -> dict[nn.Parameter, Tensor]:
        """``[B, *shape]`` per parameter: each sample's gradient through this op."""
        if self.rowwise:
            try:
                return self._rowwise(saved, grads, batch)
            except RuntimeError:  # shapes that are not row-separable after all: the masked VJP is exact
                pass
        return self._masked(saved, grads, batch)

    def _rowwise(self, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], batch: int) -> dict[nn.Parameter, Tensor]:
        values = tuple(p.detach() for p in self.params)
        saved_dims = tuple(0 if s.dim() > 0 and s.shape[0] == batch else None for s in saved)
        rows_saved = tuple(s.unsqueeze(1) if d == 0 else s for s, d in zip(saved, saved_dims, strict=True))

        def one(row_saved: tuple[Tensor, ...], row_grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            outputs, vjp_fn = torch.func.vjp(lambda *v: self.call(v, row_saved), *values)
            if any(o.shape != g.shape for o, g in zip(outputs, row_grads, strict=True)):
                raise RuntimeError("not row-separable")
            return vjp_fn(row_grads)

        rows = torch.func.vmap(one, in_dims=(saved_dims, 0))(rows_saved, tuple(g.unsqueeze(1) for g in grads))
        return dict(zip(self.params, rows, strict=True))

    def _masked(self, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], batch: int) -> dict[nn.Parameter, Tensor]:
        values = tuple(p.detach() for p in self.params)
        _, vjp_fn = torch.func.vjp(lambda *v: self.call(v, saved), *values)
        row_bytes = sum(g.numel() * g.element_size() for g in grads)
        chunk = max(1, min(batch, MASKED_CHUNK_BYTES // max(row_bytes, 1)))
        parts: list[tuple[Tensor, ...]] = []
        for start in range(0, batch, chunk):
            rows = torch.arange(start, min(start + chunk, batch), device=grads[0].device)
            masks = [
                (torch.arange(batch, device=g.device)[None, :] == rows[:, None])
                .to(g.dtype)
                .view(len(rows), batch, *([1] * (g.dim() - 1)))
                for g in grads
            ]
            parts.append(torch.func.vmap(vjp_fn)(tuple(m * g.unsqueeze(0) for m, g in zip(masks, grads, strict=True))))
        return {p: torch.cat([part[i] for part in parts]) for i, p in enumerate(self.params)}


class _RawUse(torch.autograd.Function):
    """Identity on a use's outputs; its backward hands their gradients to the engine."""

    @staticmethod
    @override
    def forward(ctx: Any, use: RawUse, anchor: Tensor, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.use = use
        ctx.count = count
        ctx.recorded = recorded_call()  # its block may run again after the backward
        ctx.save_for_backward(*tensors[count:])
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    @override
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # once: a checkpoint's recomputed tensors can be unpacked only once
        use: RawUse = ctx.use
        shaped = _shapes(grads, saved, use)
        filled = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, shaped, strict=True))
        use.owner.receive_use(use, saved, filled, replayed(ctx.recorded))
        return (None, None, None, *grads, *([None] * len(saved)))


def _shapes(grads: tuple[Tensor | None, ...], saved: tuple[Tensor, ...], use: RawUse) -> tuple[Tensor, ...]:
    """Tensors shaped like each output, for outputs that received no gradient."""
    if all(g is not None for g in grads):
        return grads  # type: ignore[return-value]
    outputs = use.call(tuple(p.detach() for p in use.params), saved)
    return outputs


# -- reading parameters through module attributes -----------------------------------------------


class TrackedParameters(dict):
    """A module's ``_parameters`` table that hands out tracked tensors while an engine runs.

    ``nn.Module.__getattr__`` reads parameters through ``_parameters[name]``; everything that
    enumerates parameters (``named_parameters``, ``state_dict``, optimizers, ``.to()``) goes
    through ``items()``/``values()`` and still sees the real ``nn.Parameter`` objects.
    """

    def __init__(self, table: dict, owner: Any) -> None:
        super().__init__(table)
        self.owner = owner

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if isinstance(value, nn.Parameter) and torch.is_grad_enabled() and self.owner.tracks(value):
            return TrackedTensor.wrap(value, _Leaf(value), (value,), self.owner)
        return value

    def __reduce_ex__(self, protocol: Any) -> Any:  # copies and pickles are plain tables
        return (dict, (dict(self.items()),))

    def plain(self) -> dict:
        return dict(self.items())
