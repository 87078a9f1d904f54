"""What a training step does besides the module's own forward and backward: the step model.

A plain step backpropagates once and frees each saved tensor as its op's backward runs. Whoever
changes that (a DP engine attached to the module: ``lightning_tbp.privacy``) registers a
:class:`StepModel` for the module (:func:`register_step_model`): its backward passes, and what
the step does around the plain backward at each event (:class:`StepModel.effects_for`, the
simulator's extension point: ``simulated_step.StepEffects``). During the planner's profiling
forward it may report layers it treats apart (:func:`note_layer`, a :class:`LayerNote`), which the
trace files by event and storage ids for its effects to read. The remat package knows nothing
of what the notes mean.

The training loop around the step (which gradients are alive when it starts, its optimizer
step) is the :class:`LoopModel`.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_tbp.remat.budget import format_bytes

if TYPE_CHECKING:  # typing only: the simulated step imports this module
    from lightning_tbp.memory.held import HeldMemory
    from lightning_tbp.remat.simulated_step import SimulatedStep, StepEffects
    from lightning_tbp.remat.trace import Trace


@dataclass(frozen=True)
class BackwardPass:
    """One backpropagation of the step's graph."""

    retains_graph: bool = False
    """Saved tensors stay (``retain_graph=True``); recomputed ones are still dropped after use."""
    parameter_gradients: bool = True
    """The pass writes parameter gradients (as the backward reaches each layer)."""
    every_step: bool = True
    """The pass runs on every step; False for a probe of a graph's first step only: its memory
    counts (the plan must hold then too), its recomputation is not a cost of every step."""


@dataclass(frozen=True)
class StepModel:
    """The backward passes of one training step, in order, and what the step does around them."""

    passes: tuple[BackwardPass, ...] = (BackwardPass(),)
    name: str = "plain"

    @property
    def backward_passes(self) -> int:
        """Passes over one forward's graph: more than one rules out selective checkpoints."""
        return len(self.passes)

    @property
    def every_step_passes(self) -> int:
        """Passes every step runs (each unpacks its saves, so a lazy block rebuilds them again)."""
        return sum(p.every_step for p in self.passes)

    def effects_for(self, trace: Trace) -> Callable[[SimulatedStep], StepEffects] | None:
        """What the simulator runs around the plain backward for ``trace`` (per-trace work done
        here, once); None: nothing (a plain step)."""
        return None

    def extra_ns(self, trace: Trace) -> float:
        """Time the step adds to the trace's forward and backward passes, in nanoseconds."""
        return 0.0


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
    temporaries come on top of the gradients (``optimizer_step_bytes``; 0: not modelled).

    ``step_in_backward``: the optimizer steps each parameter inside the backward, as soon as its
    gradient is complete (``lightning_tbp.optim``), adding ``parameter_step_ratio`` times the
    parameter's bytes while it runs, and frees the gradient; there is no step after the backward.
    Where the loop holds no earlier gradients (``RELEASED`` alone) that is simulated as it
    happens; in the loop's other cases the gradients are counted as kept (an upper bound: the
    step that frees them is the last micro-batch's only). ``optimizer_ns``: the time of those
    steps on the device, one parameter at a time (``optim/step_cost.py``; 0: not measured).

    ``host_state_bytes``: the optimizer's state and its step are on the host (it steps inside
    the backward, ``optim/host_state.py``): what it keeps there through the step (a copy of each
    trainable parameter and the state), for the host budget; ``host_step_ns`` the time of those
    steps there, with the copies, in place of the device's. ``hosted_parameters``: the names (in
    the planned module) of the parameters stepped there, the others stepped on the device with
    ``parameter_step_ratio``'s temporaries (None: every parameter)."""

    gradients: frozenset[PriorGradients] = frozenset({PriorGradients.RELEASED})
    optimizer_step_bytes: int = 0
    step_in_backward: bool = False
    parameter_step_ratio: float = 0.0
    host_state_bytes: int = 0
    host_step_ns: float = 0.0
    optimizer_ns: float = 0.0
    hosted_parameters: frozenset[str] | None = None

    def with_step_in_backward(self, parameter_step_ratio: float, optimizer_ns: float = 0.0) -> LoopModel:
        """This loop with the optimizer stepping inside the backward: no step's gradients outlive
        its backward (only accumulation keeps them), and no step comes after it."""
        return LoopModel(
            self.gradients - {PriorGradients.UNTIL_BACKWARD},
            step_in_backward=True,
            parameter_step_ratio=parameter_step_ratio,
            optimizer_ns=optimizer_ns,
        )

    def with_state_on_host(
        self,
        host_state_bytes: int,
        host_step_ns: float,
        optimizer_ns: float = 0.0,
        hosted: tuple[frozenset[str], float] | None = None,
    ) -> LoopModel:
        """This loop with the optimizer stepping inside the backward on the host, its state there:
        each gradient goes as it is complete, and the step's temporaries are the host's.
        ``hosted``: only the parameters of these names, the rest stepped on the device with this
        ratio's temporaries (``host_step_ns`` the time of both)."""
        names, ratio = hosted if hosted is not None else (None, 0.0)
        return replace(
            self.with_step_in_backward(ratio, optimizer_ns),
            host_state_bytes=host_state_bytes,
            host_step_ns=host_step_ns,
            hosted_parameters=names,
        )

    @property
    def step_inside_ns(self) -> float:
        """Time the optimizer's steps add inside the training step (0 when it steps after it)."""
        return self.host_step_ns if self.host_state_bytes else self.optimizer_ns

    def describe(self) -> str:
        cases = {
            PriorGradients.RELEASED: "none",
            PriorGradients.UNTIL_BACKWARD: "the last step's until the backward",
            PriorGradients.ACCUMULATED: "accumulated ones through the step",
        }
        held = " or ".join(cases[case] for case in PriorGradients if case in self.gradients)
        text = f"gradients alive at the forward: {held}"
        if self.host_state_bytes:
            which = "each parameter" if self.hosted_parameters is None else f"{len(self.hosted_parameters)} parameters"
            rest = "" if self.hosted_parameters is None else " (the others on the device)"
            text += (
                f"; the optimizer steps {which} inside the backward on the host, where its state is "
                f"({format_bytes(self.host_state_bytes)} with the weights' copies){rest}, and frees its gradient"
            )
        elif self.step_in_backward:
            text += "; the optimizer steps each parameter inside the backward and frees its gradient"
        elif self.optimizer_step_bytes:
            text += f"; the optimizer step's temporaries {format_bytes(self.optimizer_step_bytes)} after the backward"
        return text


PLAIN_LOOP = LoopModel()


@dataclass(frozen=True)
class Alongside:
    """What the training loop keeps alive beside the module's step, for one input signature:
    no trace of the module sees it, yet it is on the device through the step.

    ``through_step``: the batch in hand (the loop holds it until the next one) and the module's
    own inputs (its first layers save them for the backward). ``until_backward``: the rest of
    what ``training_step`` made before calling the module (noise, targets, timesteps), freed
    when it returns, before the backward, except what the loss saves (counted by the loss's own
    window). Measured where the module is called (``strategies/common.py``); zero when nobody
    measures it, as for a module planned on its own (its meter starts at the forward)."""

    through_step: int = 0
    until_backward: int = 0

    @property
    def total(self) -> int:
        return self.through_step + self.until_backward

    def scaled(self, factor: float) -> Alongside:
        """These bytes for a batch ``factor`` times as large (a plan made for a batch ceiling)."""
        return Alongside(round(self.through_step * factor), round(self.until_backward * factor))


NOTHING_ALONGSIDE = Alongside()


#: The parts of a loop alternative a plan solves (``LoopAlternative.narrowed``), as multiples of
#: the least the budget needs (``tbp estimate`` weighs the same).
PART_FACTORS = (1, 2, 4)


@dataclass(frozen=True)
class LoopAlternative:
    """A change to the training loop that lowers the step's memory (the optimizer stepping inside
    the backward), which a plan takes only when its own loop cannot meet the budget.

    ``action`` names it in reports and errors; ``loop`` gives the loop with it from the loop in
    force; ``blocked`` says why this run cannot take it (None: it can), so that an infeasible
    budget names what would meet it and what stands in the way; ``adopt`` switches the run to it
    (called once, before the step whose plan needs it runs its backward). ``held``: what it
    leaves on the device of what training holds outside the step (None: all of it);
    ``host_tier``: it uses host memory, so a plan tries it only with the host tier.
    ``narrowed``: the same change for part of what it moves, the least that takes the given
    bytes off the device outside the step (None: no part does), which a plan weighs against the
    whole by predicted time."""

    action: str
    loop: Callable[[LoopModel], LoopModel]
    adopt: Callable[[], None]
    blocked: str | None = None
    held: Callable[[HeldMemory], HeldMemory] | None = None
    host_tier: bool = False
    narrowed: Callable[[int], LoopAlternative | None] | None = None


@dataclass
class LayerNote:
    """A layer the step model treats apart, as the profiling forward saw it. The reporter fills
    ``saved`` and ``output``; the trace replaces them by storage ids and the event of the layer's
    last op (whose node holds its saves), so a trace keeps numbers only."""

    saved: tuple[torch.Tensor, ...]
    output: torch.Tensor | None
    event: int = -1
    saved_sids: tuple[int, ...] = ()
    output_sid: int = -1

    @classmethod
    def settle(cls, notes: Sequence[LayerNote], measure: bool) -> None:
        """After the profiling forward: replace estimates by measurements where ``measure`` and
        drop whatever references the module (a subclass's meters)."""


_StepModelSource = Callable[[], StepModel]
_REGISTRY: weakref.WeakKeyDictionary[nn.Module, _StepModelSource] = weakref.WeakKeyDictionary()
_NOTE_LISTENER: contextvars.ContextVar[Callable[[LayerNote], None] | None] = contextvars.ContextVar(
    "lightning_tbp_note_listener", default=None
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


def profiling_notes() -> bool:
    """Whether a running profile listens for layer notes (outside one, a layer need not describe itself)."""
    return _NOTE_LISTENER.get() is not None


def note_layer(note: LayerNote) -> None:
    """Report a layer to a running profile (a no-op outside one)."""
    listener = _NOTE_LISTENER.get()
    if listener is not None:
        listener(note)


def listening_for_notes(listener: Callable[[LayerNote], None]) -> contextvars.Token:
    """Route :func:`note_layer` reports to ``listener`` until :func:`stop_listening`."""
    return _NOTE_LISTENER.set(listener)


def stop_listening(token: contextvars.Token) -> None:
    _NOTE_LISTENER.reset(token)
