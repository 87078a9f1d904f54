"""What a training step does besides the module's own forward and backward: the step model.

A plain step backpropagates once and frees each saved tensor as its op's backward runs. A DP
engine attached to the module changes that (``lightning_tbp.privacy``): ghost and flash clipping
backpropagate the graph twice, the first pass retaining everything it saved and writing no
parameter gradients; bookkeeping keeps each clipped layer's saved input and output gradient
until the backward ends (except inside full checkpoints, which it replays: ``replay.py``), then
forms the parameter gradients one layer at a time; every mode
probes per-sample independence with extra retained passes on a new graph structure (their
peak is that of one: the simulator runs one).

The planner must simulate *that* step, or a plan made with an engine attached overshoots its
budget. So whoever changes the step registers a :class:`StepModel` for the module
(:func:`register_step_model`), and during the planner's profiling forward reports each layer it
taps (:func:`note_tap`): the event, the tensors the tap saves, its output, and the transient
bytes of its per-sample norms and of its clipped sum. The remat package knows nothing of DP.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from lightning_tbp.remat.budget import format_bytes


@dataclass(frozen=True)
class BackwardPass:
    """One backpropagation of the step's graph."""

    retains_graph: bool = False
    """Saved tensors stay (``retain_graph=True``); recomputed ones are still dropped after use."""
    parameter_gradients: bool = True
    """The pass writes parameter gradients (as the backward reaches each layer)."""
    books_taps: bool = False
    """Tapped layers keep their saved tensors and output gradient until the pass ends; their
    parameter gradients are then formed one layer at a time (bookkeeping)."""
    tap_transient: str = ""
    """Which transient of the taps the pass pays at each tap's backward: "norm", "sum" or both
    ("norm+sum"); empty for none."""
    replays_checkpoints: bool = False
    """With ``books_taps``: a fully checkpointed block that no other planned block encloses books
    nothing; it keeps its inputs and its outputs' gradient until the pass ends, and after the
    book it runs again, forward and backward, one block at a time (``replay.py``)."""


@dataclass(frozen=True)
class StepModel:
    """The backward passes of one training step, in order."""

    passes: tuple[BackwardPass, ...] = (BackwardPass(),)
    name: str = "plain"

    @property
    def backward_passes(self) -> int:
        """Passes over one forward's graph: more than one rules out selective checkpoints."""
        return len(self.passes)


PLAIN_STEP = StepModel()


class PriorGradients(Enum):
    """Which parameter gradients a training loop holds when a step's forward starts."""

    RELEASED = "released"
    """None (the first step; a step whose loop frees them before the forward)."""
    UNTIL_BACKWARD = "until_backward"
    """The last step's, through the forward and the loss; freed before the backward (Lightning's
    automatic optimisation zeroes them after ``training_step``)."""
    ACCUMULATED = "accumulated"
    """Through the whole step, the backward adding into them (gradient accumulation's later
    micro-batches; a loop whose ``zero_grad`` keeps them)."""


@dataclass(frozen=True)
class LoopModel:
    """What the training loop around the step adds to it; a plan must hold in every case listed.

    The trace sees one forward of the module; the loop decides what else is alive: the previous
    step's gradients (``gradients``) and, after the backward, the optimizer's step, whose
    temporaries come on top of the gradients (``optimizer_step_bytes``; 0: not modelled)."""

    gradients: frozenset[PriorGradients] = frozenset({PriorGradients.RELEASED})
    optimizer_step_bytes: int = 0

    def describe(self) -> str:
        cases = {
            PriorGradients.RELEASED: "none",
            PriorGradients.UNTIL_BACKWARD: "the last step's until the backward",
            PriorGradients.ACCUMULATED: "accumulated ones through the step",
        }
        held = " or ".join(cases[case] for case in PriorGradients if case in self.gradients)
        text = f"gradients alive at the forward: {held}"
        if self.optimizer_step_bytes:
            text += f"; the optimizer step's temporaries {format_bytes(self.optimizer_step_bytes)} after the backward"
        return text


PLAIN_LOOP = LoopModel()


@dataclass
class TapNote:
    """A tapped layer as the profiling forward saw it (storage ids are filled in by the trace)."""

    saved: tuple[torch.Tensor, ...]
    output: torch.Tensor | None
    norm_bytes: int  # transient of its per-sample norms
    sum_bytes: int  # transient of its clipped sum (the parameter gradients are counted apart)
    parameter_bytes: int  # the gradients its clipped sum writes
    layer: int = 0  # which layer: a layer tapped twice keeps per-sample gradients through the norms pass
    per_sample_bytes: int = 0  # those per-sample gradients (batch x its parameters)
    book_copy_bytes: int = 0
    """What a booked entry allocates before its clipped sum: a tracked use's output gradients
    scaled by the clipping coefficients (a handler scales inside its sum, which its meter counts;
    a replayed block's layers receive them scaled)."""
    event: int = -1
    saved_sids: tuple[int, ...] = ()
    output_sid: int = -1
    norm_ns: float = 0.0  # time of its per-sample norms (measured; 0 when not)
    sum_ns: float = 0.0  # time of its clipped sum
    meter: Callable[[], tuple[int, int, float, float] | None] | None = None
    """Measures (norm bytes, sum bytes, norm ns, sum ns) on stand-in tensors of the same layout,
    when called after the profiling forward (the byte estimates above are only formulas; kernels
    allocate more)."""
    meter_key: tuple = ()
    """Taps with equal keys (same layer kind, same layouts) measure alike: one measurement serves them."""


_StepModelSource = Callable[[], StepModel]
_REGISTRY: weakref.WeakKeyDictionary[nn.Module, _StepModelSource] = weakref.WeakKeyDictionary()
_TAP_LISTENER: contextvars.ContextVar[Callable[[TapNote], None] | None] = contextvars.ContextVar(
    "lightning_tbp_tap_listener", default=None
)


def set_per_module(table: weakref.WeakKeyDictionary, modules: list[nn.Module], value: object | None) -> None:
    """Set ``value`` for every module in ``modules`` in a per-module ``table`` (``None``: withdraw it);
    weak keys, so a module that goes away takes its entry with it."""
    for module in modules:
        if value is None:
            table.pop(module, None)
        else:
            table[module] = value


def register_step_model(modules: list[nn.Module], source: _StepModelSource | None) -> None:
    """Declare (or with ``None`` withdraw) the step model of every module in ``modules``."""
    set_per_module(_REGISTRY, modules, source)


def step_model_for(module: nn.Module) -> StepModel:
    """The step model registered for ``module``, else a plain step."""
    source = _REGISTRY.get(module)
    return PLAIN_STEP if source is None else source()


def profiling_taps() -> bool:
    """Whether a running profile listens for taps (outside one, a tap need not describe itself)."""
    return _TAP_LISTENER.get() is not None


def note_tap(note: TapNote) -> None:
    """Report a tapped layer to a running profile (a no-op outside one)."""
    listener = _TAP_LISTENER.get()
    if listener is not None:
        listener(note)


def listening_for_taps(listener: Callable[[TapNote], None]) -> contextvars.Token:
    """Route :func:`note_tap` reports to ``listener`` until ``_TAP_LISTENER.reset(token)``."""
    return _TAP_LISTENER.set(listener)


def stop_listening(token: contextvars.Token) -> None:
    _TAP_LISTENER.reset(token)
