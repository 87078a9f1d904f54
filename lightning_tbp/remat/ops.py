"""What each recorded op is, decided once: the vocabulary every stage of the planner reads.

The recorder asks :func:`traits_of` for each op it sees and stores the answer on the trace's
event (``Trace.event_traits``); the simulator, the solver, the lazy executor, the selective
checkpoint policy and the calibrator read those flags and decide nothing about ops themselves.
Two of the planner's worst mispredictions came from two modules disagreeing on what one op was
(``_unsafe_view`` a view in one and not in the other), which is why there is one place.

What torch's op schema says is taken from the schema: whether outputs alias an input without a
write (a view), whether the op writes an input. What the schema does not say is named here by op,
with the reason beside each table: which ops cost FLOPs (torch's FLOP formulas), how each op's
backward treats the output gradient (from torch's derivative formulas), which views may pick a
part of their input, which ops save their own result, and which a lazy block may rebuild.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch.utils.flop_counter import flop_registry

from lightning_tbp.compat import is_view_op, op_packet, op_schema, writes_input
from lightning_tbp.remat.flops import FLOP_FORMULAS


class GradientHandOff(Enum):
    """What an op's backward hands its inputs, from the output gradient."""

    COMPUTES = "computes"
    """New tensors computed from the output gradient (most ops)."""
    PASSES = "passes"
    """The output gradient with no new allocation for the input's share (``add``, ``sub``)."""
    ALIASES = "aliases"
    """The output gradient itself (``add.Tensor``, ``clone``, ``alias``, ``detach``): a later
    contribution to such an input's gradient is summed into a new buffer."""
    SLICES = "slices"
    """Slice views of the output gradient (``cat``): an input's gradient keeps the whole output
    gradient buffer alive (a U-Net skip after ``cat``)."""


@dataclass(frozen=True)
class OpTraits:
    """The properties of one op the planner acts on."""

    name: str
    """The overload's name (``add.Tensor``): reports and tests."""
    view: bool
    """Outputs alias an input and nothing is written (the schema's alias annotations)."""
    picks_part: bool
    """A view that can select a part of its input (``split``, ``slice``...): an op reading such a
    view gets a gradient of the view's size, merged into the input's by the view's backward."""
    reshapes: bool
    """A view of the whole storage under another shape (``view``, ``transpose``, ``_unsafe_view``):
    whoever reads it reads the storage, so its own backward adds no contribution."""
    writes_input: bool
    """Writes into an input (in place or ``out=``; the schema's ``is_mutable``)."""
    heavy: bool
    """Costs FLOPs by a formula (matmul, convolution, attention): selective checkpoints cache
    these outputs, and the calibrator measures their workspace."""
    hand_off: GradientHandOff
    contiguous_grad: bool
    """The backward copies a non-contiguous output gradient to a contiguous one first: heavy ops
    and the norms (measured: a ``cat`` slice reaching a group norm's backward is copied)."""
    saves_own_result: bool
    """The backward needs the op's own result, saved right after it runs."""
    recomputable: bool
    """A lazy block may rebuild the outputs: deterministic, memory-bound, or a view."""

    @property
    def passes_grad(self) -> bool:
        """The backward makes no new tensor for its inputs' gradients."""
        return self.hand_off is not GradientHandOff.COMPUTES


#: Views that may pick a part of their input (their backward builds a whole-input gradient).
_PICKS_PART = frozenset({"split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "as_strided"})
#: Views of a whole storage under another shape (a DP tap's ``view_as`` is one).
_RESHAPES = frozenset({"view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze"})
#: Backward hand-offs from torch's derivative formulas (``derivatives.yaml``); keyed by overload
#: name first (``add.Tensor`` aliases; ``add.Scalar`` only passes), then by op.
_HAND_OFF_BY_OVERLOAD = {"add.Tensor": GradientHandOff.ALIASES}
_HAND_OFF = {
    "cat": GradientHandOff.SLICES,
    "clone": GradientHandOff.ALIASES,
    "alias": GradientHandOff.ALIASES,
    "detach": GradientHandOff.ALIASES,
    "add": GradientHandOff.PASSES,
    "sub": GradientHandOff.PASSES,
}
#: Besides heavy ops, ops whose backward copies a non-contiguous output gradient first.
_CONTIGUOUS_GRAD = frozenset({"native_group_norm", "native_layer_norm"})
#: Ops whose backward needs their own main result, saved right after they run: where the next
#: op also takes that result as input, the save is theirs (``trace._settle_saves``).
_SAVES_OWN_RESULT = frozenset(
    {
        "relu", "sigmoid", "tanh", "exp", "expm1", "sqrt", "rsqrt", "reciprocal", "_softmax", "_log_softmax",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward", "_efficient_attention_forward",
    }
)  # fmt: skip
#: Deterministic ops cheap enough to redo in the backward (no RNG, memory-bound); every view is
#: recomputable as well: a saved view of a rebuilt tensor must be a recipe too, or, stored as it
#: is, it holds the whole storage that the planner counts as rebuilt (a block saving chunks of a
#: SiLU measured 1.32x its plan).
_RECOMPUTABLE = frozenset(
    {
        "native_group_norm", "native_layer_norm", "silu", "gelu", "relu", "sigmoid", "tanh",
        "add", "sub", "mul", "div", "clone", "_unsafe_view", "reshape",
    }
)  # fmt: skip
_HEAVY = frozenset(flop_registry) | frozenset(FLOP_FORMULAS)


def _op_name(op: Any) -> str:
    """``add`` for ``aten.add.Tensor`` (the schema's name without its namespace)."""
    return op_schema(op).name.split("::")[-1]


@functools.cache
def traits_of(op: Any) -> OpTraits:
    """The traits of an aten op (an ``OpOverload``), computed once per op."""
    name = _op_name(op)
    view = is_view_op(op)
    heavy = op_packet(op) in _HEAVY
    overload = str(op.__name__)
    return OpTraits(
        name=overload,
        view=view,
        picks_part=view and name in _PICKS_PART,
        reshapes=name in _RESHAPES,
        writes_input=writes_input(op),
        heavy=heavy,
        hand_off=_HAND_OFF_BY_OVERLOAD.get(overload) or _HAND_OFF.get(name, GradientHandOff.COMPUTES),
        contiguous_grad=heavy or name in _CONTIGUOUS_GRAD,
        saves_own_result=name in _SAVES_OWN_RESULT,
        recomputable=view or name in _RECOMPUTABLE,
    )
