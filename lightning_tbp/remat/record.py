"""The recorder: a memory-safe profile of one forward pass, every op, storage and saved tensor.

The model may only fit in memory *with* a plan, so profiling never runs a training step. It
runs one forward pass in which autograd's saved tensors are replaced by ``None`` through
``saved_tensors_hooks``: the graph is built but holds nothing, so the pass costs what inference
costs. Meanwhile a ``TorchDispatchMode`` sees every aten op below autograd and records into a
:class:`~lightning_tbp.remat.trace.Trace`

* the storages each op creates (views and in-place results are resolved to the storage they
  alias, so a saved view counts the bytes it really keeps alive),
* which storages autograd *would* have saved, attributed to the op that saved them,
* the op's FLOPs (torch's FLOP formulas) and its traits (``ops.py``);
  after the pass each distinct op is timed alone (``calibrate.py``) and scaled to its block's
  real forward (``forward_timing.py``): that time is its cost,
* the candidate module (block) that was running, and the tensors entering and leaving it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Collection
from functools import partial
from types import FunctionType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lightning_tbp.compat import FakeTensor, TorchDispatchMode, op_packet, storage_key, tree_flatten
from lightning_tbp.memory.breakdown import is_quantized_wrapper, plain_tensors
from lightning_tbp.memory.held import local_bytes
from lightning_tbp.memory.homes import loaded_device
from lightning_tbp.memory.meters import allocator_peak
from lightning_tbp.remat.calibrate import OpCalibrator, TensorSpec
from lightning_tbp.remat.flops import flop_count
from lightning_tbp.remat.forward_timing import frozen_buffers, scale_to_framework, time_forward
from lightning_tbp.remat.fsdp_gathers import PlannedSharding, gather_spans, uncount_all_gather_outputs
from lightning_tbp.remat.host_weights import frozen_weights
from lightning_tbp.remat.op_args import op_tensors
from lightning_tbp.remat.ops import traits_of
from lightning_tbp.remat.overheads import StepOverheads, step_overheads
from lightning_tbp.remat.replay import output_tensors, outputs_replayable, recorder_for
from lightning_tbp.remat.step import LayerNote, listening_for_notes, stop_listening
from lightning_tbp.remat.trace import Node, Trace
from lightning_tbp.remat.verify import can_meter


def _tensors(tree: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _output_tensors(output: object) -> list[torch.Tensor]:
    """Tensors in a module output, including diffusers' ``BaseOutput`` dataclasses."""
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    return _tensors(output)


class _Recorder(TorchDispatchMode):
    """Dispatch mode that turns every aten op into a trace event."""

    def __init__(self, trace: Trace, node_stack: list[int]) -> None:
        super().__init__()
        self.trace = trace
        self.calibrator = OpCalibrator()
        self.recording = True
        self.node_stack = node_stack
        self.key_to_sid: dict[int, int] = {}
        self.pending_saves: list[int] = []
        self.pending_resident_saves: list[int] = []
        # quantized weights an event's forward reads, and those saved at an event for its
        # backward: each dequantizes them, inside the subclass where no recorder sees it
        self.read_quantized: dict[int, list[torch.Tensor]] = {}
        # with the dtype of the saving op's output: the gradient the backward multiplies it by
        self.saved_quantized: dict[int, list[tuple[torch.Tensor, torch.dtype]]] = {}
        self.last_output_dtype: torch.dtype | None = None
        # ops run without grad that read a tensor needing a gradient (a custom Function's input):
        # the bytes of the gradient the Function's backward makes for what they read
        self.function_reads: dict[int, int] = {}
        self.tensor_counts: dict[int, int] = {}
        # the dtype autocast casts trainable weights to and caches (None: no cache), and those casts
        self.autocast_dtype: torch.dtype | None = None
        self.weight_casts: list[int] = []

    def hold(self, tensor: torch.Tensor, nbytes: int, trains: bool) -> None:
        """Register ``tensor``'s storage as held, at ``nbytes``, a trained parameter's if
        ``trains`` (a buffer whose storage is resized to nothing while unused, parameters viewing
        it: ``fsdp_gathers.py``)."""
        key = storage_key(tensor)
        if key is not None and key not in self.key_to_sid:
            sid = self._new_storage(key, tensor, producer=-1, activation=False)
            self.trace.storage_bytes[sid] = nbytes
            self.trace.storage_needs_grad[sid] = trains

    def sid_of(self, tensor: torch.Tensor, *, activation: bool = False) -> int | None:
        """Storage id of ``tensor``, registering storages made outside the recorder."""
        key = storage_key(tensor)
        if key is None:
            return None
        sid = self.key_to_sid.get(key)
        if sid is None:
            sid = self._new_storage(key, tensor, producer=-1, activation=activation)
            self.trace.storage_needs_grad[sid] = tensor.requires_grad
        return sid

    def _new_storage(self, key: int, tensor: torch.Tensor, producer: int, activation: bool) -> int:
        trace = self.trace
        sid = len(trace.storage_bytes)
        trace.storage_bytes.append(tensor.untyped_storage().nbytes())
        trace.storage_needs_grad.append(False)
        trace.storage_is_activation.append(activation)
        trace.storage_producer.append(producer)
        trace.storage_written.append(False)
        trace.storage_death.append(-1)
        self.key_to_sid[key] = sid
        return sid

    def watch(self, tensor: torch.Tensor, sid: int) -> None:
        """Note when the last tensor viewing storage ``sid`` is garbage collected."""
        self.tensor_counts[sid] = self.tensor_counts.get(sid, 0) + 1
        weakref.finalize(tensor, self._tensor_died, sid)

    def _tensor_died(self, sid: int) -> None:
        self.tensor_counts[sid] -= 1
        if self.tensor_counts[sid] == 0 and self.recording:
            self.trace.storage_death[sid] = self.trace.num_events - 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries (a fake tensor's ``.device``), no data
            return out
        trace = self.trace
        event = trace.num_events
        traits = traits_of(func)
        seen: dict[int, int] = {}
        arg_tensors, out_tensors = op_tensors((args, kwargs)), op_tensors(out)
        for tensor in arg_tensors:
            if is_quantized_wrapper(tensor):
                self.read_quantized.setdefault(event, []).append(tensor)
            if (sid := self.sid_of(tensor)) is not None:
                seen[sid] = max(seen.get(sid, 0), tensor.numel() * tensor.element_size())
                if tensor.requires_grad and trace.storage_is_activation[sid]:
                    # made inside a custom autograd Function (its ops run without grad), whose
                    # output needs a gradient after all: its backward gives its inputs theirs
                    trace.storage_needs_grad[sid] = True
                    if not torch.is_grad_enabled():  # inside one: its backward makes this gradient
                        self.function_reads[event] = self.function_reads.get(event, 0) + seen[sid]
        inputs = tuple(seen)
        input_set = set(inputs)
        partial = {sid: size for sid, size in seen.items() if size < trace.storage_bytes[sid]}
        saves = self._settle_saves(input_set)  # before this op becomes the last event
        resident_saves = self._settle_resident_saves(input_set)
        grad_flows = torch.is_grad_enabled() and any(trace.storage_needs_grad[s] for s in inputs)
        outputs: list[int] = []
        output_sids: list[int | None] = []  # of every output tensor, in order (for the calibrator)
        written: set[int] = set()  # storages it read and wrote (in place, or through ``out=``)
        new_elements = 0
        for tensor in out_tensors:
            key = storage_key(tensor)
            if key is None:
                output_sids.append(None)
                continue
            sid = self.key_to_sid.get(key)
            if sid is not None and sid in input_set:
                output_sids.append(sid)
                written.add(sid)
                # an in-place write: a lazy block no longer rebuilds that storage
                trace.storage_written[sid] = trace.storage_written[sid] or traits.writes_input
                if trace.storage_is_activation[sid]:
                    self.watch(tensor, sid)
                continue  # a view or an in-place result: same storage as an input
            sid = self._new_storage(key, tensor, producer=event, activation=True)
            output_sids.append(sid)
            self.watch(tensor, sid)
            trace.storage_needs_grad[sid] = grad_flows and tensor.is_floating_point()
            outputs.append(sid)
            new_elements += tensor.numel()
        if not torch.is_grad_enabled():  # no autograd node: what it wrote gets no gradient from it
            # an ``out=`` op writes its ``out`` tensors and may return nothing
            written.update(sid for t in op_tensors(kwargs.get("out")) if (sid := self.sid_of(t)) is not None)
            if written:
                trace.no_grad_writes[event] = tuple(sorted(written))
        if self.autocast_dtype is not None and outputs and _cached_by_autocast(func, args, out, self.autocast_dtype):
            self.weight_casts.extend(outputs)
        if _densifies(func, args, out) and (source := self.sid_of(args[0])) is not None:
            trace.densified_storages.add(source)
        flops = flop_count(func, args, kwargs, out)
        # what autograd will differentiate, tensor by tensor: a parameter read through a detached
        # view (a DP engine's tapped layer, whose weight gradient the engine forms itself) shares
        # the parameter's storage but gets no gradient from the op's backward
        needs_grad = [torch.is_grad_enabled() and t.requires_grad for t in arg_tensors]
        self.calibrator.note(event, func, args, kwargs, needs_grad, output_sids, workspace=traits.heavy and grad_flows)
        trace.event_node.append(self.node_stack[-1])
        trace.event_inputs.append(inputs)
        trace.event_partial_inputs.append(partial)
        trace.event_outputs.append(tuple(outputs))
        trace.event_saves.append(saves)
        trace.event_resident_saves.append(resident_saves)
        trace.event_traits.append(traits)
        trace.event_flops.append(flops)
        trace.event_cost.append(0.0)  # measured after the forward
        self.last_output_dtype = next((t.dtype for t in out_tensors), None)
        return out

    def record_save(self, tensor: torch.Tensor) -> None:
        """Note a tensor autograd saves; which op saved it is settled at the next op (``_settle_saves``)."""
        if is_quantized_wrapper(tensor):
            # saved by a custom Function over a quantized weight (torchao's NF4 linear) once its
            # last op ran: that op's backward dequantizes it to the apparent dtype, a transient;
            # and the save counts as a parameter's pack (a recomputation runs on to it, where
            # torch stops one early only once every saved tensor is back)
            dtype = self.last_output_dtype or tensor.dtype
            self.saved_quantized.setdefault(self.trace.num_events - 1, []).append((tensor, dtype))
            self.pending_resident_saves.extend(
                sid
                for inner in plain_tensors(tensor)
                if (sid := self.sid_of(inner)) is not None and not self.trace.storage_is_activation[sid]
            )
            return
        sid = self.sid_of(tensor)
        if sid is None:
            return
        if self.trace.storage_is_activation[sid]:
            self.pending_saves.append(sid)
        else:  # parameters, buffers and inputs are no activations, but their packs count
            self.pending_resident_saves.append(sid)

    def _settle_resident_saves(self, next_inputs: set[int]) -> list[int]:
        """Split the resident storages saved since the last op: autograd saves a parameter as an
        input, before its op runs, so one the new op reads is the new op's; the rest the last op's."""
        last = self.trace.num_events - 1
        mine = [sid for sid in self.pending_resident_saves if sid in next_inputs or last < 0]
        if last >= 0:
            self.trace.event_resident_saves[last].extend(s for s in self.pending_resident_saves if s not in next_inputs)
        self.pending_resident_saves = []
        return mine

    def _settle_saves(self, next_inputs: set[int]) -> list[int]:
        """Split the saves made since the last op between it and the op now dispatching.

        Autograd saves an op's *outputs* after the op has run and its *inputs* before it runs, so
        both land between two dispatches. A saved tensor that the new op takes as input is the
        new op's (a norm saving the conv output it normalises), unless the last op made it and
        is one that saves its own result (exp, softmax, attention) and it was saved only once; the
        rest is the last op's. Returns the new op's saves and files the others.
        """
        trace = self.trace
        last = trace.num_events - 1
        last_outputs = set(trace.event_outputs[last]) if last >= 0 else set()
        last_saves_result = last >= 0 and trace.event_traits[last].saves_own_result
        counts = Counter(self.pending_saves)
        mine: list[int] = []
        for sid in self.pending_saves:
            if last < 0:
                mine.append(sid)
            elif sid in next_inputs and not (sid in last_outputs and last_saves_result and counts[sid] == 1):
                mine.append(sid)
                counts[sid] -= 1  # a tensor saved twice: the last op's result and the new op's input
                last_saves_result = last_saves_result and counts[sid] > 0
            else:
                trace.event_saves[last].append(sid)
        self.pending_saves = []
        return mine

    def finish(self) -> None:
        if self.trace.num_events:
            self.trace.event_saves[-1].extend(self.pending_saves)
            self.trace.event_resident_saves[-1].extend(self.pending_resident_saves)
        self.pending_saves, self.pending_resident_saves = [], []


_DEQUANTIZATION_PEAKS: dict[tuple, int] = {}


def dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized weight as a plain ``dtype`` tensor: torchao's affine (int8) tensors through
    their own ``dequantize`` (to their apparent dtype; asked for bfloat16 directly, it computes in
    float32 and keeps that beside the result: more at its peak than a cast afterwards), NF4
    through ``.to``."""
    if isinstance(inspect.getattr_static(type(weight), "dequantize", None), FunctionType):
        return weight.dequantize().to(dtype)
    return weight.to(dtype)


def dequantization_peak(weight: torch.Tensor, backward_dtype: torch.dtype | None = None) -> int:
    """Peak bytes of using a quantized weight in a matmul, where it is turned back into a plain
    tensor (torchao's NF4 unpacks its 4-bit codes through int64 indices: about five times the
    weight's apparent size), measured once per kind, shape and dtype under the exact meter on a
    one-row product: the forward's ``F.linear``, or with ``backward_dtype`` the backward's
    gradient times :func:`dequantized` (what saved quantized weights cost: int8's forward on CPU
    multiplies without dequantizing, its dequantization in the backward takes two copies of the
    weight). The apparent size where no meter can run (a fake trace, whose estimate is then low
    by the rest of that transient; a running profiler) or the weight is not a matrix."""
    apparent = weight.numel() * (backward_dtype or weight.dtype).itemsize
    key = (type(weight), tuple(weight.shape), weight.dtype, weight.device.type, backward_dtype)
    if key not in _DEQUANTIZATION_PEAKS:
        fake = any(isinstance(inner, FakeTensor) for inner in plain_tensors(weight))
        if weight.dim() != 2 or fake or not can_meter(weight.device):
            return apparent
        use: Callable[[], torch.Tensor]
        if backward_dtype is None:
            row = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
            use = partial(F.linear, row, weight)
        else:
            gradient = torch.zeros(1, weight.shape[0], dtype=backward_dtype, device=weight.device)

            def use() -> torch.Tensor:  # the dequantization inside the metered region
                return gradient @ dequantized(weight, backward_dtype)

        with torch.no_grad(), allocator_peak(weight.device) as reading:
            use()
        _DEQUANTIZATION_PEAKS[key] = max(apparent, reading.peak_bytes)
    return _DEQUANTIZATION_PEAKS[key]


#: How far back from the op that saved a quantized weight its layer's matmul is looked for.
_LAYER_OPS = 64


def _place_backward_dequantization(
    trace: Trace, event: int, saved: list[tuple[torch.Tensor, torch.dtype]], function_reads: dict[int, int]
) -> None:
    """The backward of a layer over saved quantized weights (a custom Function: torchao's NF4
    linear, ``FrozenQuantizedLinear``) dequantizes them, then makes its input's gradient while
    the dequantized weights and its output's gradient are alive: its peak is the larger of the
    two, above that gradient. The simulation makes the input's gradient at the Function's op that
    read the input, so the transient goes there, less the gradient it adds itself; at the op that
    saved the weights where there is none (no gradient flows to the layer's input: only the
    dequantization runs, if anything)."""
    peak = sum(dequantization_peak(weight, dtype) for weight, dtype in saved)
    held = sum(weight.numel() * dtype.itemsize for weight, dtype in saved)
    for reader in range(event, max(event - _LAYER_OPS, -1), -1):
        if trace.event_node[reader] != trace.event_node[event]:
            break
        gradient = function_reads.get(reader, 0)
        if gradient:
            # the gradient of what the Function's later ops made (its output) lives through its
            # backward; the simulation lets it go at those ops, before the reader's
            output_gradient = sum(
                trace.storage_bytes[sid]
                for later in range(reader + 1, event + 1)
                for sid in trace.event_outputs[later]
                if trace.storage_is_activation[sid] and trace.storage_needs_grad[sid]
            )
            transient = output_gradient + max(peak - gradient, held)
            trace.event_workspace[reader] = max(trace.event_workspace[reader], transient)
            return
    trace.event_workspace[event] = max(trace.event_workspace[event], peak)


def candidate_modules(module: nn.Module) -> dict[nn.Module, str]:
    """Modules the planner may wrap: every submodule that has submodules of its own.

    Leaf layers (a single Linear, Conv or norm) are not blocks: checkpointing one saves almost
    nothing. Their parents (a ResNet block, an attention block, a transformer block) are the
    finest granularity; inside them the planner chooses selective recomputation instead. A layer
    with adapters (peft's LoRA ``Linear`` holds its base layer and adapters as submodules) is
    still one layer: on an SDXL U-Net with LoRA such layers would otherwise be 560 of 952
    candidates, each a simulation branch for the solver and none worth a checkpoint of its own.
    """
    layers = _adapter_layer_types()
    return {
        sub: name
        for name, sub in module.named_modules()
        if name and any(True for _ in sub.children()) and not isinstance(sub, (nn.ModuleList, nn.ModuleDict, *layers))
    }


def _adapter_layer_types() -> tuple[type, ...]:
    """peft's adapter-wrapped layer class, if peft is in use (if it was never imported, no module is one)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return (tuners.BaseTunerLayer,) if tuners is not None else ()


class BlockInputCapture(Protocol):
    """Who wants some blocks' inputs from the profile's timed forward (``calibrate_blocks``)."""

    def choose(self, trace: Trace) -> Collection[str]:
        """Paths of the blocks, from ``trace`` with its ops timed."""

    def capture(self, path: str, args: tuple, kwargs: dict) -> None:
        """The arguments the block at ``path`` was called with (each call)."""


def record_trace(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    inside_call: bool = False,
    measure: bool = True,
    block_inputs: BlockInputCapture | None = None,
    workspaces_below: int = 0,
    planned_sharding: PlannedSharding | None = None,
) -> Trace:
    """Profile one forward of ``module(*args, **kwargs)`` without keeping activations.

    Random number generators are forked so the profiling pass does not shift the training run's
    random stream (dropout stays reproducible), and buffers are restored afterwards.

    ``inside_call``: the caller is one of ``module``'s own forward pre-hooks, so the hooks
    before it already ran for this call; the profile then runs ``module.forward`` alone. Calling
    the module again would run its hooks twice: FSDP2's post-forward hook, for one, would reshard
    the parameters that its pre-forward hook gathered for the real forward.

    ``block_inputs``: told which blocks' inputs to keep once the ops are timed, it gets them
    from the timed real forward (``measure`` only), which saves the caller a forward of its own.

    ``measure=False``: sizes, saves and FLOPs only, for a module and inputs made of fake tensors
    (``lightning_tbp.estimate``): nothing can run for real, so op times, workspaces and plan
    overheads are left at zero for the caller to model, and no device's random state is touched.
    ``workspaces_below`` (bytes, with ``measure=False``): measure the heavy ops' workspaces anyway,
    on real stand-ins on this machine's CPU, for ops whose stand-ins take less (a fake trace of a
    CPU step); ``trace.unmeasured_workspaces`` counts the ops skipped.

    ``planned_sharding``: the spans FSDP2 would give ``module`` sharded so (``fsdp_gathers.py``),
    where it is not sharded (an estimate of one rank's step from the one-device step).
    """
    trace = Trace()
    root = Node(index=0, path="", parent=-1)
    trace.nodes.append(root)
    node_stack = [0]
    recorder = _Recorder(trace, node_stack)
    calls: dict[int, int] = {}
    candidates = candidate_modules(module)
    handles = []

    def enter(sub: nn.Module, sub_args: tuple, sub_kwargs: dict) -> None:
        call = calls.get(id(sub), 0)
        calls[id(sub)] = call + 1
        parent = trace.nodes[node_stack[-1]]
        node = Node(
            index=len(trace.nodes), path=candidates[sub], parent=parent.index, call=call, kind=type(sub).__name__
        )
        node.first_event = trace.num_events
        node.inputs = tuple(s for t in _tensors((sub_args, sub_kwargs)) if (s := recorder.sid_of(t)) is not None)
        trace.nodes.append(node)
        parent.children.append(node.index)
        node_stack.append(node.index)

    def leave(sub: nn.Module, sub_args: tuple, sub_kwargs: dict, output: object) -> None:
        node = trace.nodes[node_stack.pop()]
        node.last_event = trace.num_events - 1
        node.outputs = tuple(s for t in _output_tensors(output) if (s := recorder.sid_of(t)) is not None)
        node.replayable = recorder_for(sub) is not None and outputs_replayable(output_tensors(output))

    for sub in candidates:
        handles.append(sub.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(sub.register_forward_hook(leave, with_kwargs=True))

    for param in module.parameters():
        recorder.sid_of(param)
    trace.frozen_weights = frozen_weights(module, recorder.sid_of)
    trace.trainable_weights = {
        sid: name
        for name, p in module.named_parameters()
        if p.requires_grad and (sid := recorder.sid_of(p)) is not None
    }
    for buf in module.buffers():
        recorder.sid_of(buf)
    for tensor in _tensors((args, kwargs)):
        recorder.sid_of(tensor)

    def pack(tensor: torch.Tensor) -> None:
        recorder.record_save(tensor)
        return None

    def file_note(note: LayerNote) -> None:
        note.event = trace.num_events - 1  # the layer's last (view) op, whose node holds its saves
        note.saved_sids = tuple(s for t in note.saved if (s := recorder.sid_of(t)) is not None)
        for sid in note.saved_sids:  # a Function packs what it saved as its forward returns: file it now
            if sid in recorder.pending_saves:
                recorder.pending_saves.remove(sid)
                trace.event_saves[note.event].append(sid)
        output_sid = recorder.sid_of(note.output) if note.output is not None else None
        note.output_sid = output_sid if output_sid is not None else -1
        note.saved, note.output = (), None  # the trace keeps ids, not tensors
        trace.step_notes.append(note)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("lightning_tbp profiling graph cannot be backpropagated")

    devices = [t.device for t in _tensors((args, kwargs))] + [loaded_device(p) for p in module.parameters()]
    cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"}) if measure else []
    recorder.autocast_dtype = _autocast_cache_dtype(devices)
    listening = listening_for_notes(file_note)
    try:
        with (
            gather_spans(module, inside_call, lambda: trace.num_events, recorder.hold, planned_sharding) as gathers,
            frozen_buffers(module),
            torch.random.fork_rng(devices=cuda_devices),
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
            recorder,
        ):
            output = module.forward(*args, **kwargs) if inside_call else module(*args, **kwargs)
            recorder.finish()
            trace.module_outputs = tuple(s for t in _output_tensors(output) if (s := recorder.sid_of(t)) is not None)
            trace.output_specs = [TensorSpec.of(t, t.requires_grad) for t in _output_tensors(output)]
            recorder.recording = False  # what dies now dies with the forward's result
            del output
        trace.fsdp = gathers
        uncount_all_gather_outputs(trace)
        outputs = set(trace.module_outputs)
        trace.autocast_cached = {
            sid for sid in recorder.weight_casts if trace.storage_death[sid] == -1 and sid not in outputs
        }
        workspaces: dict[int, tuple[int, int]] = {}
        times: dict[int, tuple[float, float]] = {}
        with torch.random.fork_rng(devices=cuda_devices):  # calibration draws random inputs
            if measure:
                # an output no later op reads gets no gradient (a norm's saved mean and rstd, an
                # attention's logsumexp): its op's backward is timed without one
                times, workspaces = recorder.calibrator.measure(_consumers(trace))
            elif workspaces_below:
                workspaces, trace.unmeasured_workspaces = recorder.calibrator.measure_workspaces(
                    _consumers(trace), workspaces_below
                )
            _settle_notes(trace.step_notes, measure)
    finally:
        stop_listening(listening)
        for handle in handles:
            handle.remove()
    trace.event_forward_workspace = [0] * trace.num_events
    trace.event_workspace = [0] * trace.num_events
    for event, (forward, backward) in workspaces.items():
        trace.event_forward_workspace[event] = forward
        trace.event_workspace[event] = backward
    # measured here, outside the recorder
    for event, weights in recorder.read_quantized.items():
        peak = sum(dequantization_peak(weight) for weight in weights)
        trace.event_forward_workspace[event] = max(trace.event_forward_workspace[event], peak)
    for event, saved in recorder.saved_quantized.items():
        _place_backward_dequantization(trace, event, saved, recorder.function_reads)
    trace.event_backward_cost = [0.0] * trace.num_events
    for event, (forward_ns, backward_ns) in times.items():
        trace.event_cost[event] = forward_ns
        trace.event_backward_cost[event] = backward_ns
    if measure:
        keep_inputs: dict[nn.Module, Callable[[tuple, dict], None]] = {}
        if block_inputs is not None:
            wanted = set(block_inputs.choose(trace))
            keep_inputs = {
                sub: partial(block_inputs.capture, path) for sub, path in candidates.items() if path in wanted
            }
        timing = time_forward(module, candidates, args, kwargs, inside_call, cuda_devices, keep_inputs=keep_inputs)
        scale_to_framework(trace, *timing)
    device = devices[0] if devices else torch.device("cpu")
    trace.overheads = step_overheads(device) if measure else StepOverheads()
    trace.checkpoint_state_bytes = torch.get_rng_state().numel() if device.type == "cpu" else 0
    root.first_event, root.last_event = 0, trace.num_events - 1
    trace.parameter_grad_bytes = sum(local_bytes(p) for p in module.parameters() if p.requires_grad)
    return trace


def _consumers(trace: Trace) -> dict[int, int]:
    """Per storage that gets a gradient: 1, or 2 where that gradient is a sum of gradients of
    different layouts (a channels-last storage read by several ops, one of which copies it to
    row-major): the calibrator then measures its op's backward with both layouts."""
    reads: Counter[int] = Counter(sid for inputs in trace.event_inputs for sid in set(inputs))
    reads.update(trace.module_outputs)
    return {sid: 2 if count > 1 and sid in trace.densified_storages else 1 for sid, count in reads.items()}


def _autocast_cache_dtype(devices: list[torch.device]) -> torch.dtype | None:
    """The dtype autocast casts trainable weights to on the step's device and caches until its
    context exits, or None (no autocast, or its cache off). Read before the recorder starts:
    inside a dispatch mode autocast reads as off."""
    device_type = devices[0].type if devices else "cpu"
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_cache_enabled() else None


def _cached_by_autocast(func: Any, args: tuple, out: object, dtype: torch.dtype) -> bool:
    """Whether ``func`` is a cast autocast caches: a float32 leaf that needs a gradient (a
    trainable parameter; a view of one is no leaf) cast to autocast's ``dtype`` (torch's rule
    for its cache)."""
    if op_packet(func) is not torch.ops.aten._to_copy or not args or not isinstance(out, torch.Tensor):
        return False
    source = args[0]
    return (
        isinstance(source, torch.Tensor)
        and source.dtype == torch.float32
        and source.is_leaf
        and source.requires_grad
        and out.dtype == dtype
    )


def _densifies(func: Any, args: tuple, out: object) -> bool:
    """Whether ``func`` copies a channels-last tensor to a row-major one (``.contiguous()``)."""
    if op_packet(func) not in (torch.ops.aten.clone, torch.ops.aten._to_copy) or not args:
        return False
    source = args[0]
    return (
        isinstance(source, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and source.dim() == 4
        and not source.is_contiguous()
        and source.is_contiguous(memory_format=torch.channels_last)
        and out.is_contiguous()
    )


def _settle_notes(notes: list[LayerNote], measure: bool) -> None:
    """Each kind of note settles its own (``LayerNote.settle``), in the order reported.

    Their meters run what a step runs in its backward (a DP engine's per-sample norms and
    clipped sums), where the loop has closed autocast (torch's AMP recipe): they run with it
    off, whatever context the profile runs in. Under the caller's bf16 autocast they measured
    the casts autocast added to their matmuls, which the step never makes: a DP DiT's
    transients 3.7x their size in float32, its step predicted up to 1.13x its measured peak."""
    kinds: dict[type[LayerNote], list[LayerNote]] = {}
    for note in notes:
        kinds.setdefault(type(note), []).append(note)
    with contextlib.ExitStack() as autocast_off:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                autocast_off.enter_context(torch.autocast(device_type, enabled=False))
        for kind, group in kinds.items():
            kind.settle(group, measure)
