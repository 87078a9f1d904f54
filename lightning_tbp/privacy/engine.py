"""DP-SGD's per-sample clipping and noise for a plain PyTorch module, in four modes.

``attach`` sorts every trainable parameter (``coverage.py``): a layer with a handler gets an
instance-level ``forward`` that runs it with detached parameters and wraps the output in a
``_Tap``, an identity autograd node whose backward sees the layer's output gradient next to the
tensors it saved; every other trainable parameter is *tracked*: reading it as a module attribute
yields a tensor whose uses are clipped op by op (``tracked.py``). Autograd thus computes only
input gradients; the engine forms the parameter gradients:

- ``ghost`` / ``flash``: two backward passes. The first accumulates each sample's squared
  gradient norm per layer (ghost norm or materialised per-sample gradient, whichever the cost
  rule picks; ``flash`` tiles the per-sample gradient instead) and keeps nothing. The second
  backpropagates ``Σ_i c_i loss_i`` and sums the (already clipped) gradients.
- ``bookkeeping`` / ``flash_bookkeeping``: one backward pass that records each layer's saved
  tensors and output gradient; once all norms are known, the clipped sum ``Σ_i c_i ∇_i`` of
  every layer comes from one contraction over the recorded operands.

A parameter reached by several paths (a layer called twice, tied weights, a tracked use next to
its layer's own) has its per-sample gradients materialised and summed before the norm. Every
backward first checks the graph (no parameter reachable by plain autograd, none unreached), and
the first backward of each graph structure probes sets of samples' losses to check that every
clipped path sees only the probed samples, so no sample's loss reaches another's rows
(``coverage.py``).

Saved tensors go through ``ctx.save_for_backward``, so non-reentrant checkpointing (and the
rematerialization plan) recompute them like any other activation, and gradients stay exact.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_tbp.compat import parameter_table, set_parameter_table, storage_key
from lightning_tbp.memory.meters import foreign_profiler_active, garbage_collection_held
from lightning_tbp.privacy.completion import Completion
from lightning_tbp.privacy.coverage import (
    check_batch_norms,
    listed_samples,
    probe_sets,
    row_violation,
    rows_per_sample,
    survey,
    survey_graph,
)
from lightning_tbp.privacy.errors import FIXES, CoverageError, PerSampleLossError
from lightning_tbp.privacy.layers.registry import LayerHandler
from lightning_tbp.privacy.noise import NoiseStreams
from lightning_tbp.privacy.step_model import DPStepModel, TapNote, dp_step_model
from lightning_tbp.privacy.tracked import RawUse, TrackedParameters
from lightning_tbp.remat.calibrate import TensorSpec, best_ns, first_run
from lightning_tbp.remat.replay import CheckpointedCall, recorded_call, register_checkpoint_recorder, replayed
from lightning_tbp.remat.signature import batch_size_of
from lightning_tbp.remat.step import note_layer, profiling_notes, register_step_model

log = logging.getLogger("lightning_tbp")

MODES = ("ghost", "flash", "bookkeeping", "flash_bookkeeping")
#: The most backward passes one forward's graph sees per mode: two for ghost and flash, plus the
#: independence probe of a first step. A rematerialization plan for a graph backpropagated more
#: than once must not use selective blocks (``Plan(backward_passes=...)``).
BACKWARD_PASSES = {"ghost": 3, "flash": 3, "bookkeeping": 2, "flash_bookkeeping": 2}
#: Passes of an ordinary step (no probe): what a step's memory and time depend on.
STEP_PASSES = {"ghost": 2, "flash": 2, "bookkeeping": 1, "flash_bookkeeping": 1}
_CLIP_EPSILON = 1e-6  # as Opacus: c_i = min(1, C / (‖∇_i‖ + 1e-6))


@dataclass(eq=False)
class _Slot:
    """One tapped module: its handler and the parameters the engine writes gradients to."""

    name: str
    module: nn.Module
    handler: LayerHandler
    engine: DPEngine
    params: dict[str, nn.Parameter]


@dataclass
class BufferStats:
    """Bytes the engine holds beyond what plain autograd would (per-sample norms and coefficients,
    materialised per-sample gradients, bookkeeping's recorded operands): now, and the peak of
    the last backward."""

    current_bytes: int = 0
    peak_bytes: int = 0


class _Tap(torch.autograd.Function):
    """Identity on a layer's output; its backward hands (saved tensors, output gradient) to the engine."""

    @staticmethod
    @override
    def forward(ctx: Any, slot: _Slot, anchor: Tensor, output: Tensor, *saved: Tensor) -> Tensor:
        # ``anchor`` (a leaf of the engine's own) makes the output require grad even when nothing
        # upstream does: the parameters themselves enter the op detached.
        ctx.slot = slot
        ctx.recorded = recorded_call()  # its block may run again after the backward
        ctx.save_for_backward(*saved)
        return output.view_as(output)

    @staticmethod
    @override
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # once: a checkpoint's recomputed tensors can be unpacked only once
        ctx.slot.engine._receive(ctx.slot, saved, grad_output, replayed(ctx.recorded))
        return (None, None, grad_output, *([None] * len(saved)))


class _SourceTap(torch.autograd.Function):
    """The layer's op itself, for an input that needs no gradient (token indices, the data): its
    output is made here rather than passed through, so it is no view of an input and the model may
    write into it in place (OmniGen writes its conditioning images' tokens into the text
    embedding's output), which autograd forbids on a view a custom Function returns. The op's
    operands come back through ``made`` for the profile's notes."""

    @staticmethod
    @override
    def forward(ctx: Any, slot: _Slot, anchor: Tensor, x: Tensor, made: list) -> Tensor:
        output, saved = slot.handler.forward(slot.module, x)
        ctx.slot = slot
        ctx.recorded = recorded_call()
        ctx.save_for_backward(*saved)
        made.append(saved)
        return output

    @staticmethod
    @override
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, ...]:
        saved = ctx.saved_tensors
        ctx.slot.engine._receive(ctx.slot, saved, grad_output, replayed(ctx.recorded))
        return None, None, None, None


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


class DPEngine:
    """Per-sample clipping (threshold ``max_grad_norm``) and Gaussian noise (std sigma·C) for a module.

    Use ``attach`` to make one. ``backward(loss)`` with a per-sample ``loss`` of shape [B] leaves
    in every trainable parameter's ``.grad`` the sum over samples of the clipped per-sample
    gradients plus noise (not divided by B); ``per_sample_norms`` then holds the [B] norms.

    ``gradient_complete``, if set, is called with each parameter as soon as the backward has
    written the last of its clipped contributions and no op's backward still reads its value
    (``completion.py``), so that an optimizer can step it inside the backward
    (``lightning_tbp.optim.OptimizerInBackward``). Each parameter's noise comes from a stream of
    its own, seeded once per logical batch (:meth:`draw_noise_seed`, ``noise.py``), so noising
    each as its sum completes adds the very noise :meth:`add_noise` adds after the backward.
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
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be positive and finite, got {max_grad_norm}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be non-negative and finite, got {noise_multiplier}")
        self.module = module
        self.mode = mode
        self.max_grad_norm = float(max_grad_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.generator = generator
        self.per_sample_norms: Tensor | None = None
        self.clip_coefficients: Tensor | None = None
        self.buffers = BufferStats()
        self.anchor = torch.zeros((), requires_grad=True)
        self._survey = survey(module)
        self._noise = NoiseStreams(self._survey.params.values())
        self.completion = Completion(self, self.describe_param)
        self._handler_reads = 0  # >0 while a handler runs its layer: it reads the real parameters
        self._phase: str | None = None  # "probe", "norms", "sum" or "book" while a backward runs
        self._batch = 0
        self._forward_batch: int | None = None  # the batch of the module's running forward (``batch_size_of``)
        self._probed: set[tuple] = set()
        self._materialise: set[int] = set()  # ids of parameters reached by more than one path
        self._norm_sq: Tensor | None = None
        self._pending: dict[int, Tensor] = {}
        self._book: list[tuple[Any, tuple[Tensor, ...], tuple[Tensor, ...]]] = []
        self._replays: list[CheckpointedCall] = []  # checkpointed blocks the backward reached, in its order
        self._violations: list[str] = []
        self._probed_samples: list[int] = []  # whose losses the running probe backpropagates
        self._held: dict[int, int] = {}  # storage -> references the engine holds (for ``buffers``)
        self._warned_masked = False
        self._slots = self._install()
        # first among the module's hooks, so a plan profiling inside its own pre-hook sees it set
        self._batch_hooks = (
            module.register_forward_pre_hook(self._note_batch, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._forget_batch, always_call=True),
        )
        self._attached = True
        register_step_model(list(module.modules()), self.step_model)
        if STEP_PASSES[mode] == 1:
            # a block without a clipped parameter has nothing to replay: it stays a plain checkpoint
            clipped = [m for m in module.modules() if any(id(p) in self._survey.params for p in m.parameters())]
            register_checkpoint_recorder(clipped, self)

    # -- installation ---------------------------------------------------------------------------

    def _install(self) -> list[_Slot]:
        slots = [_Slot(spec.name, spec.module, spec.handler, self, spec.params) for spec in self._survey.slots]
        for slot in slots:
            slot.module.forward = functools.partial(self._tapped_forward, slot)
        for owner in self._survey.owners:
            set_parameter_table(owner, TrackedParameters(parameter_table(owner), self))
        return slots

    def _note_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The profile's taps learn from it whether their rows are folded (see ``_meter_tap``)."""
        self._forward_batch = batch_size_of(args, kwargs)

    def _forget_batch(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._forward_batch = None  # a submodule called on its own folds nothing it can know of

    def _samples_in(self, rows: int) -> int:
        """The samples a call on ``rows`` rows holds while profiling: the module forward's batch,
        unless ``rows`` is no multiple of it (then its rows are the batch)."""
        batch = self._forward_batch
        return batch if batch and rows % batch == 0 else rows

    def _tapped_forward(self, slot: _Slot, *args: Any, **kwargs: Any) -> Tensor:
        x = _layer_input(slot, args, kwargs)
        x = self.completion.mark_input(tuple(slot.params.values()), x)
        self._handler_reads += 1  # the handler reads the real parameters (no tracked tensors, no ops)
        try:
            if x.requires_grad:
                output, saved = slot.handler.forward(slot.module, x)
                tapped = _Tap.apply(slot, self.anchor, output, *saved)
            else:
                made: list[tuple[Tensor, ...]] = []
                output = tapped = _SourceTap.apply(slot, self.anchor, x, made)
                (saved,) = made
            if not profiling_notes():
                return tapped
            batch = self._samples_in(x.shape[0])
            # the estimate (kept under a running CPU profiler) prices the rows the step runs, from
            # shapes: an op here would be recorded in the profile as the model's
            features = slot.handler.row_features(slot.module) if x.shape[0] != batch else None
            x_shape, output_shape = tuple(x.shape), tuple(output.shape)
            if features is not None:
                x_shape = _merged_shape(x_shape, batch, features[0])
                output_shape = _merged_shape(output_shape, batch, features[1])
            flash = self.mode.startswith("flash")
            norm_bytes, sum_bytes = slot.handler.workspace_bytes(slot.module, x_shape, output_shape, flash, x.device)
            # layers of one class and configuration on the same layouts measure alike (``extra_repr``
            # reads the parameters as attributes: here, where they are plain, not tracked uses)
            config = (type(slot.handler), type(slot.module), slot.module.extra_repr())
        finally:
            self._handler_reads -= 1
        parameter_bytes = sum(p.numel() * p.element_size() for p in slot.params.values())
        per_sample = batch * sum(p.numel() * 4 for p in slot.params.values())
        layouts = tuple(TensorSpec.of(t) for t in (output, *saved))
        note = TapNote(
            saved,
            tapped,
            norm_bytes=norm_bytes,
            sum_bytes=sum_bytes,
            parameter_bytes=parameter_bytes,
            layer=id(slot),
            per_sample_bytes=per_sample,
        )
        params = tuple((name, tuple(p.shape), p.dtype) for name, p in slot.params.items())
        note.meter = functools.partial(self._meter_tap, slot, layouts, batch)
        note.meter_key = (*config, params, layouts, batch)
        note_layer(note)
        return tapped

    def _meter_tap(
        self, slot: _Slot, layouts: tuple[TensorSpec, ...], batch: int
    ) -> tuple[int, int, float, float] | None:
        """The exact peaks of this layer's norm and clipped sum above their inputs, and their times,
        on stand-ins laid out as the profiled tensors (the planner calls it after its profile; None
        under a running CPU profiler), run by the code the step runs for a batch of ``batch``
        (rows folded into it merged, or per row where the handler cannot merge them). The clipped
        sum's own result (the parameter gradients) is left out of its peak."""
        grad_output, *stand_ins = (layout.materialise() for layout in layouts)
        if grad_output.device.type == "cpu" and foreign_profiler_active():
            return None
        module, saved = slot.module, tuple(stand_ins)
        coef = torch.ones(grad_output.shape[0], device=grad_output.device)
        grads: dict[str, Tensor] = {}

        def norms() -> None:
            self._norm_sq_of(slot, saved, grad_output, batch)

        def clipped_sum() -> None:
            merged_saved, merged_grad = self._merged(slot, saved, grad_output, batch)
            ones = coef[: merged_grad.shape[0]]
            grads.update(slot.handler.clipped_sum(module, merged_saved, merged_grad, ones))

        return _metered(norms, clipped_sum, grads, grad_output.device)

    def use_meter(self, use: RawUse, outputs: tuple[Tensor, ...], saved: tuple[Tensor, ...]) -> tuple[Callable, tuple]:
        """A meter for a tracked use's transients (see ``_meter_use``) and the key of uses that
        measure alike. Its per-sample VJP runs the op forward again: for a convolution no handler
        knows, an output-sized transient that a formula from the parameters' sizes missed (a
        lazy block over such layers measured 1.13x its plan)."""
        batch = self._samples_in(outputs[0].shape[0])
        layouts = tuple(TensorSpec.of(t) for t in (*outputs, *saved))
        params = tuple((tuple(p.shape), p.dtype) for p in use.params)
        key = (use.func, use.rowwise, use.recipe_key(), params, layouts, batch)
        return functools.partial(self._meter_use, use, layouts, len(outputs), batch), key

    def _meter_use(
        self, use: RawUse, layouts: tuple[TensorSpec, ...], outputs: int, batch: int
    ) -> tuple[int, int, float, float] | None:
        """The exact peaks of a tracked use's per-sample norms and its summed gradients above their
        inputs, and their times, on stand-ins laid out as the profiled tensors, by the code the
        step runs (as ``_meter_tap`` for a handler's layer)."""
        stand_ins = tuple(layout.materialise() for layout in layouts)
        grads_out, saved = stand_ins[:outputs], stand_ins[outputs:]
        if grads_out[0].device.type == "cpu" and foreign_profiler_active():
            return None
        grads: dict[nn.Parameter, Tensor] = {}

        def norms() -> None:
            sum(
                g.flatten(1).float().square().sum(dim=1) for g in _use_per_sample(use, saved, grads_out, batch).values()
            )

        def summed() -> None:  # (the book's scaled copy of ``grads_out`` is ``TapNote.book_copy_bytes``)
            grads.update(use.summed_grads(saved, grads_out))

        return _metered(norms, summed, grads, grads_out[0].device)

    def step_model(self) -> DPStepModel:
        """The backward passes of a step under this engine, for the rematerialization planner."""
        return dp_step_model(STEP_PASSES[self.mode] == 2, self.mode)

    def tracks(self, param: nn.Parameter) -> bool:
        """Whether reading ``param`` as a module attribute now yields a tracked tensor."""
        return self._attached and self._handler_reads == 0 and id(param) in self._survey.params

    def describe_param(self, param: nn.Parameter) -> str:
        return self._survey.describe(param)

    def detach(self) -> None:
        """Restore every module's own forward and parameter table; the engine is unusable afterwards."""
        for hook in self._batch_hooks:
            hook.remove()
        for slot in self._slots:
            slot.module.__dict__.pop("forward", None)
        for owner in self._survey.owners:
            if isinstance(table := parameter_table(owner), TrackedParameters):
                set_parameter_table(owner, table.plain())
        self._slots = []
        self._attached = False
        register_step_model(list(self.module.modules()), None)
        register_checkpoint_recorder(list(self.module.modules()), None)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter the engine clips, each once (tied ones too)."""
        return list(self._survey.params.values())

    def coverage(self) -> dict[str, str]:
        """How each trainable parameter (by qualified name) is clipped: for reports and docs."""
        handled = {id(p): f"{type(slot.module).__name__} handler" for slot in self._slots for p in slot.params.values()}
        table = {}
        for pid in self._survey.params:
            how = handled.get(pid)
            if pid in self._survey.tracked_only:
                tracked = f"tracked uses ({self._survey.tracked_only[pid]})"
                how = f"{how} + {tracked}" if how else tracked
            for name in self._survey.names[pid]:
                table[name] = how or "tracked uses"
        return table

    # -- the backward -----------------------------------------------------------------------------

    @property
    def backward_passes(self) -> int:
        """The most backward passes one forward's graph sees; give it to ``Plan(backward_passes=...)``."""
        return BACKWARD_PASSES[self.mode]

    def probe_next_step(self) -> None:
        """Make the next ``backward`` check coverage again, as the first one of each graph did.

        The first step of each graph structure backpropagates sets of samples alone first (the
        coverage probe), and its graph stays retained meanwhile: that step's peak is the one a
        plan made with this engine attached is for. A meter that must see that peak again,
        step after step (benchmarks, memory tests), calls this before each step."""
        self._probed.clear()

    def backward(self, loss: Tensor, add_noise: bool = True) -> None:
        """Clip per sample and sum into ``.grad``; then add noise unless ``add_noise=False``.

        ``add_noise=False`` lets gradient accumulation sum several micro-batches first and call
        ``add_noise()`` once for the logical batch.
        """
        if not self._attached:
            raise RuntimeError("this DP engine was detached")
        if loss.dim() != 1:
            raise PerSampleLossError(
                f"DP needs the per-sample loss, shape [batch], to clip each sample; got shape {tuple(loss.shape)}. "
                "Reduce over every dimension but the batch (e.g. loss.mean(dim=(1, 2, 3))) and do not average "
                "over the batch"
            )
        if loss.grad_fn is None:
            raise PerSampleLossError("the loss does not require grad: was it computed from the module's output?")
        check_batch_norms(self._survey)
        graph = survey_graph(loss, self._survey, self)
        self._batch = loss.shape[0]
        self._materialise = {pid for pid, count in graph.contributions.items() if count > 1}
        self.completion.start(graph.contributions, graph.readers)
        two_pass = STEP_PASSES[self.mode] == 2
        self.buffers, self._held = BufferStats(), {}
        try:
            if graph.structure() not in self._probed and self._batch > 1:
                self._probe(loss)
                self._probed.add(graph.structure())
            self._norm_sq = torch.zeros(self._batch, dtype=torch.float32, device=loss.device)
            self._hold(self._norm_sq)
            if two_pass:
                self._phase = "norms"
                self._backpropagate(loss.sum(), retain_graph=True)
            else:
                self._phase = "book"
                self.completion.final_pass = True
                self._backpropagate(loss.sum())
            self._finish_norms()
            self._warn_masked(graph.uses)
            coef = self.clip_coefficients
            if two_pass:
                self._phase = "sum"
                self.completion.final_pass = True
                self._backpropagate((loss * coef.to(loss.dtype)).sum())
            else:
                self._book.reverse()
                with torch.no_grad():  # sums formed from the book; module reads stay plain parameters
                    while self._book:  # each entry's operands die as soon as its sum is formed
                        entry, saved, grads = self._book.pop()
                        self._clipped_sum(entry, saved, grads, coef)
                        self._release(*saved, *grads)
                        del saved, grads
                self._replay_checkpoints(coef)
        finally:
            self._phase, self._book, self._pending, self._norm_sq, self._held = None, [], {}, None, {}
            self._replays = []
            self.completion.end()
            self.buffers.current_bytes = _bytes((self.per_sample_norms, self.clip_coefficients))
            self.buffers.peak_bytes = max(self.buffers.peak_bytes, self.buffers.current_bytes)
        if add_noise:
            self.add_noise()

    def _probe(self, loss: Tensor) -> None:
        """Backpropagate each probe set's losses alone (``coverage.probe_sets``): every clipped path
        must see gradient on the rows of the set's samples only."""
        self._phase, self._violations = "probe", []
        for samples in probe_sets(self._batch):
            self._probed_samples = samples
            self._backpropagate(loss[samples].sum(), retain_graph=True)
            if self._violations:
                break
        if self._violations:
            raise CoverageError(
                "per-sample clipping needs each sample's loss to depend on its own rows only (dim 0 of every "
                "trainable layer's input and of every op using a parameter is the batch, or the batch with each "
                "sample's rows folded in, sample by sample), but backpropagating "
                f"the loss of sample(s) {listed_samples(self._probed_samples)} alone:\n"
                + "\n".join(f"  {v}" for v in dict.fromkeys(self._violations))
                + "\nCauses: statistics over the batch, a sequence-first layout (batch_first=False), a sample "
                "reading another (a sum or shift over the batch), or a parameter combined with a tensor that has "
                "no batch dimension before it meets the batch"
            )

    def _backpropagate(self, scalar: Tensor, retain_graph: bool = False) -> None:
        """One pass. A retained pass (probe, ghost's norms) reaches only the clipped paths and writes
        no ``.grad``; the last pass is an ordinary backward (inputs that require grad get theirs)."""
        try:
            if retain_graph:
                torch.autograd.grad(scalar, [self.anchor], retain_graph=True, allow_unused=True)
            else:
                torch.autograd.backward(scalar)
        except RuntimeError as error:
            if "selective activation checkpoint" not in str(error):
                raise
            raise RuntimeError(
                f"DP mode {self.mode!r} backpropagates each graph more than once, and a selective checkpoint in the "
                "model gives its cached outputs to the first backward only. Make the rematerialization plan "
                f"with Plan(..., backward_passes={self.backward_passes}) (engine.backward_passes), which "
                "plans without selective blocks"
            ) from error

    @property
    def gradient_complete(self) -> Callable[[nn.Parameter], None] | None:
        """Called with each parameter whose step may run inside the backward (see the class)."""
        return self.completion.announce

    @gradient_complete.setter
    def gradient_complete(self, announce: Callable[[nn.Parameter], None] | None) -> None:
        self.completion.announce = announce

    def mark_reads(self, params: tuple[nn.Parameter, ...], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A tracked op's arguments, marked for the step inside the backward (``Completion.mark_reads``)."""
        return self.completion.mark_reads(params, args, kwargs)

    def draw_noise_seed(self) -> None:
        """Seed this logical batch's noise: one draw from ``generator``. :meth:`add_noise` draws it;
        a step that noises each parameter on its own (:meth:`add_noise_to`) draws it once first."""
        self._noise.draw_seed(self.generator)

    def add_noise(self) -> None:
        """Add N(0, (sigma·C)²) to every trainable parameter's gradient (once per logical batch)."""
        self.draw_noise_seed()
        for param in self.parameters:
            self.add_noise_to(param)

    def add_noise_to(self, param: nn.Parameter) -> None:
        """Add this logical batch's N(0, (sigma·C)²) noise to ``param``'s gradient (made if absent)."""
        self._noise.add(param, self.noise_multiplier * self.max_grad_norm)

    def _warn_masked(self, uses: list[RawUse]) -> None:
        slow = {use.op_name for use in uses if not use.rowwise}
        if slow and not self._warned_masked:
            self._warned_masked = True
            log.warning(
                "lightning_tbp DP: parameters used in %s get their per-sample gradients by masked VJPs (exact, but "
                "batch-size products of each op); a per-sample handler for those layers would be faster",
                ", ".join(sorted(slow)),
            )

    # -- what the backward hands over -----------------------------------------------------------

    def _check_rows(self, where: str, grads: tuple[Tensor, ...]) -> None:
        for grad in grads:
            if rows_per_sample(grad, self._batch) is None:
                raise PerSampleLossError(
                    f"{where} got a batch of {grad.shape[0] if grad.dim() else 'none'} (gradient shape "
                    f"{tuple(grad.shape)}) but the loss has {self._batch} entries: the loss must hold one value "
                    "per sample, and dim 0 of what a trainable parameter meets must be the batch (or the batch "
                    "with each sample's rows folded into it, as a video model folds frames)"
                )

    def _receive(self, slot: _Slot, saved: tuple[Tensor, ...], grad_output: Tensor, replayed: bool) -> None:
        """One layer call's output gradient, in whichever pass is running (``replayed``: the layer
        sits in a recorded checkpoint, whose replay forms its clipped sum: nothing is booked)."""
        if self._phase is None or slot.engine is not self:
            return  # a backward outside ``DPEngine.backward`` (e.g. a planner's profiling run)
        self._check_rows(f"module {slot.name!r}", (grad_output,))
        if self._phase == "probe":
            self._probe_rows(f"module {slot.name!r} ({type(slot.module).__name__})", (grad_output,))
            return
        saved, grad_output = self._merged(slot, saved, grad_output, self._batch)
        if self._phase == "sum":
            ones = grad_output.new_ones(grad_output.shape[0], dtype=torch.float32)
            self._accumulate(slot.params, slot.handler.clipped_sum(slot.module, saved, grad_output, ones))
            return
        if any(id(p) in self._materialise for p in slot.params.values()):
            grads = slot.handler.per_sample_grads(slot.module, saved, grad_output)
            self._add_pending({slot.params[name]: _summed_rows(grad, self._batch) for name, grad in grads.items()})
        else:
            self._norm_sq += self._norm_sq_of(slot, saved, grad_output, self._batch)
        if self._phase == "book" and not replayed:
            self._book.append((slot, saved, (grad_output,)))
            self._hold(*saved, grad_output)

    def receive_use(self, use: RawUse, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], replayed: bool) -> None:
        """One tracked use's output gradients, in whichever pass is running (``replayed``: as ``_receive``)."""
        if self._phase is None or use.owner is not self:
            return
        names = ", ".join(self.describe_param(p) for p in use.params)
        where = f"parameter(s) {names} in op {use.op_name}"
        rows = {rows_per_sample(g, self._batch) for g in grads}
        if None in rows or len(rows) > 1:
            shapes = ", ".join(str(tuple(g.shape)) for g in grads)
            raise CoverageError(
                f"{where} give outputs of shape {shapes}, whose dim 0 is not the batch ({self._batch}): per-sample "
                "clipping needs dim 0 of every op that uses a trainable parameter to be the batch, or the batch with "
                "each sample's rows folded into it (a sequence-first layout, or a parameter combined with a tensor "
                f"without batch dimension, breaks that). For each: {FIXES}"
            )
        if self._phase == "probe":
            self._probe_rows(where, grads)
            return
        if self._phase == "sum":
            for param, grad in use.summed_grads(saved, grads).items():
                self._add_grad(param, grad)
            return
        per_sample = _use_per_sample(use, saved, grads, self._batch)
        if any(id(p) in self._materialise for p in use.params):
            self._add_pending(per_sample)
        else:
            for grad in per_sample.values():
                self._norm_sq += grad.flatten(1).float().square().sum(dim=1)
        if self._phase == "book" and not replayed:
            self._book.append((use, saved, grads))
            self._hold(*saved, *grads)

    # -- checkpoints replayed after the backward (bookkeeping with a plan, ``remat/replay.py``) -----

    def record_checkpoint(self, call: CheckpointedCall) -> bool:
        """Bookkeeping takes every fully checkpointed block a forward offers: the book then keeps
        only the block's inputs and output gradient, not the operands of each layer inside."""
        return self._attached and self._phase is None

    def checkpoint_output_grad(self, call: CheckpointedCall, index: int, grad: Tensor) -> None:
        """The gradient at a recorded block's output: probed for its rows, kept by the book pass."""
        where = "the output of a checkpointed block"
        if self._phase == "probe":
            self._probe_rows(where, (grad,))
            return
        if self._phase != "book":
            return  # a retained pass or a backward outside ``DPEngine.backward``
        self._check_rows(where, (grad,))
        if not call.output_grads:
            self._replays.append(call)
            self._hold(*call.inputs)
        call.output_grads[index] = grad
        self._hold(grad)

    def _replay_checkpoints(self, coef: Tensor) -> None:
        """Each recorded block again, forward and backward from its output gradient scaled by each
        sample's clipping coefficient: the layers inside receive ``c_i g_i`` and add their clipped sums."""
        self._phase = "sum"
        self.completion.final_pass = True
        while self._replays:
            call = self._replays.pop(0)  # the last block first, as the backward met them
            self.completion.rerunning = True
            try:
                outputs = call.rerun()
            finally:
                self.completion.rerunning = False
            weighted = {i: self._weighted(g, coef) for i, g in call.output_grads.items()}
            self._release(*call.output_grads.values())
            call.output_grads.clear()  # the unweighted gradients die here, unless something else holds them
            self._hold(*weighted.values())
            reached = [i for i in weighted if outputs[i].requires_grad]
            if reached:
                torch.autograd.grad(
                    [outputs[i] for i in reached], [self.anchor], [weighted[i] for i in reached], allow_unused=True
                )
            self._release(*call.inputs, *weighted.values())
            call.drop()  # the graph's hooks keep ``call`` until the loss is dropped; its tensors go now
            del outputs, weighted, call

    def _probe_rows(self, where: str, grads: tuple[Tensor, ...]) -> None:
        for grad in grads:
            violation = row_violation(grad, self._batch, self._probed_samples)
            if violation is not None:
                self._violations.append(f"{where}: {violation}")

    def _method(self, slot: _Slot, saved: tuple[Tensor, ...], grad_output: Tensor) -> str:
        methods = slot.handler.norm_methods(slot.module, saved, grad_output)
        if self.mode.startswith("flash") and "flash" in methods:
            return "flash"
        return next(method for method in methods if method != "flash")

    @staticmethod
    def _merged(
        slot: _Slot, saved: tuple[Tensor, ...], grad_output: Tensor, batch: int
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        """The call with ``batch`` rows where its rows are folded samples the layer sees as
        positions (``LayerHandler.row_features``); else as it came."""
        features = slot.handler.row_features(slot.module)
        if features is None or grad_output.shape[0] == batch:
            return saved, grad_output
        merged = tuple(t.reshape(_merged_shape(t.shape, batch, features[0])) for t in saved)
        return merged, grad_output.reshape(_merged_shape(grad_output.shape, batch, features[1]))

    def _norm_sq_of(self, slot: _Slot, saved: tuple[Tensor, ...], grad_output: Tensor, batch: int) -> Tensor:
        """The layer's squared per-sample gradient norms, ``[batch]``: by its handler's method, or,
        where each sample's rows are folded into dim 0 and the handler cannot merge them, from its
        per-row gradients summed per sample (the norm of a sum is not a sum of norms). The step and
        the tap meter both run it."""
        saved, grad_output = self._merged(slot, saved, grad_output, batch)
        if grad_output.shape[0] == batch:
            return slot.handler.norm_sq(slot.module, saved, grad_output, self._method(slot, saved, grad_output))
        grads = slot.handler.per_sample_grads(slot.module, saved, grad_output)
        return sum(_summed_rows(grad, batch).flatten(1).float().square().sum(dim=1) for grad in grads.values())

    def _per_row(self, coef: Tensor, rows: int) -> Tensor:
        """Each sample's clipping coefficient on each of its rows."""
        return coef if rows == self._batch else coef.repeat_interleave(rows // self._batch)

    def _weighted(self, grad: Tensor, coef: Tensor) -> Tensor:
        """An output gradient with each row scaled by its sample's clipping coefficient."""
        return grad * self._per_row(coef, grad.shape[0]).to(grad.dtype).view(-1, *([1] * (grad.dim() - 1)))

    def _add_pending(self, grads: dict[nn.Parameter, Tensor]) -> None:
        for param, grad in grads.items():
            pending = self._pending.get(id(param))
            self._pending[id(param)] = grad.float() if pending is None else pending + grad.float()
            if pending is not None:
                self._release(pending)
            self._hold(self._pending[id(param)])

    def _finish_norms(self) -> None:
        for grad in self._pending.values():
            self._norm_sq += grad.flatten(1).square().sum(dim=1)
            self._release(grad)
        self._pending = {}
        self.per_sample_norms = self._norm_sq.sqrt()
        self.clip_coefficients = (self.max_grad_norm / (self.per_sample_norms + _CLIP_EPSILON)).clamp(max=1.0)

    def _clipped_sum(self, entry: Any, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], coef: Tensor) -> None:
        if isinstance(entry, _Slot):
            coef = self._per_row(coef, grads[0].shape[0])
            self._accumulate(entry.params, entry.handler.clipped_sum(entry.module, saved, grads[0], coef))
            return
        weighted = tuple(self._weighted(g, coef) for g in grads)
        for param, grad in entry.summed_grads(saved, weighted).items():
            self._add_grad(param, grad)

    def _accumulate(self, params: dict[str, nn.Parameter], grads: dict[str, Tensor]) -> None:
        for name, grad in grads.items():
            self._add_grad(params[name], grad)

    def _add_grad(self, param: nn.Parameter, grad: Tensor) -> None:
        grad = grad.to(param.dtype)
        param.grad = grad if param.grad is None else param.grad.add_(grad)
        self.completion.contributed(param)

    def _hold(self, *tensors: Tensor) -> None:
        """Count bytes the engine keeps alive beyond plain autograd (for the memory report); a
        storage held several times (one input booked for q, k and v) counts once."""
        for tensor in tensors:
            key = storage_key(tensor)
            self._held[key] = self._held.get(key, 0) + 1
            if self._held[key] == 1:
                self.buffers.current_bytes += tensor.untyped_storage().nbytes()
        self.buffers.peak_bytes = max(self.buffers.peak_bytes, self.buffers.current_bytes)

    def _release(self, *tensors: Tensor) -> None:
        for tensor in tensors:
            key = storage_key(tensor)
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
                self.buffers.current_bytes -= tensor.untyped_storage().nbytes()


def _layer_input(slot: _Slot, args: tuple, kwargs: dict) -> Tensor:
    """The one input a handled layer is called with, by position or by its forward's name for it
    (diffusers calls some as ``layer(input=x)``); any other argument would change what the
    layer computes in a way its handler does not know, so it is refused by name."""
    forward = type(slot.module).forward
    try:
        bound = inspect.signature(forward).bind(slot.module, *args, **kwargs)
    except TypeError as error:
        called = _described(args, kwargs)
        raise TypeError(f"{slot.name} ({type(slot.module).__name__}) called with {called}: {error}") from None
    names = list(bound.arguments)[1:]  # after self
    if len(names) != 1 or not isinstance(bound.arguments[names[0]], Tensor):
        raise CoverageError(
            f"{slot.name} ({type(slot.module).__name__}) is called with {_described(args, kwargs)}; the DP engine "
            f"clips it per sample only when it is called on one tensor (its forward's {names[0] if names else 'input'}"
            "), as torch's own layer is. Call it so, or freeze its parameters"
        )
    return bound.arguments[names[0]]


def _described(args: tuple, kwargs: dict) -> str:
    parts = [type(a).__name__ for a in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def _merged_shape(shape: Sequence[int], batch: int, features: int) -> tuple[int, ...]:
    """``shape`` with its sample-major rows and positions merged into ``[batch, positions, *features]``."""
    positions = len(shape) - features
    return (batch, math.prod(shape[:positions]) // batch, *shape[positions:])


def _metered(
    norms: Callable[[], None], clipped_sum: Callable[[], None], grads: dict, device: torch.device
) -> tuple[int, int, float, float]:
    """(norm peak, sum peak, norm ns, sum ns) of a tapped layer's two computations, measured
    exactly; ``clipped_sum`` leaves its result in ``grads``, which is left out of its peak."""
    with torch.no_grad(), garbage_collection_held():
        norm_first_ns, norm = first_run(norms, device)  # (also the timings' warm-up)
        sum_first_ns, summed = first_run(clipped_sum, device)
        sum_bytes = max(0, summed.peak_bytes - _bytes(grads.values()))
        grads.clear()
        norm_ns = best_ns(norms, device, warm_up_ns=norm_first_ns)
        sum_ns = best_ns(clipped_sum, device, warm_up_ns=sum_first_ns)
    return norm.peak_bytes, sum_bytes, float(norm_ns), float(sum_ns)


def _use_per_sample(
    use: RawUse, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], batch: int
) -> dict[nn.Parameter, Tensor]:
    """A tracked use's per-sample gradients, ``[batch, *shape]``: per row, then summed over each
    sample's rows. The step and the use meter both run it."""
    per_row = use.per_sample_grads(saved, grads, grads[0].shape[0])
    return {param: _summed_rows(grad, batch) for param, grad in per_row.items()}


def _summed_rows(grad: Tensor, batch: int) -> Tensor:
    """Per-row gradients summed over each sample's rows (``rows_per_sample``: sample-major)."""
    if grad.shape[0] == batch:
        return grad
    return grad.unflatten(0, (batch, -1)).sum(dim=1)  # (a view where it can be, else a copy)


def attach(
    module: nn.Module,
    mode: str = "bookkeeping",
    max_grad_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    generator: torch.Generator | None = None,
) -> DPEngine:
    """Make ``module`` clip per sample: see ``DPEngine``. Raises before any step for what cannot be clipped."""
    return DPEngine(module, mode, max_grad_norm, noise_multiplier, generator)
