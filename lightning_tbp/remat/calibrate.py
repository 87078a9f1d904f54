"""Per-op calibration, measured rather than guessed: time, and workspace of heavy ops.

**Time.** The planner minimises recomputation *time*. FLOPs mislead: on a CPU a group norm over
a 64x64 map can cost as much as the small convolution next to it. Each distinct (op, shapes,
dtypes, arguments) of the trace is run on its own, without gradients, and timed (best of two
runs after a warm-up; CUDA synchronised); pure views cost nothing and are not run.
Each op's backward is timed the same way (random output gradients), so the naive step's time
is predicted from its parts too. Forward times are then scaled to the real forward of the block
around each op (``forward_timing.scale_to_framework``): recomputation runs in the framework, with its
Python and autograd work; what the plan options add beyond their ops is ``overheads.py``'s.

**Workspace.** Convolution and matmul kernels allocate temporaries beyond the tensors they return (weight and
layout reorders on CPU, cuDNN/cuBLAS workspaces on CUDA), in the forward (and so in every
recomputation) and in the backward. They sit on top of whatever is live at that moment, so the
simulator must know them. Each distinct (op, shapes, dtypes, arguments) is run once on its own
under the exact allocator meter: the forward workspace is the forward peak minus the outputs,
the backward workspace the backward peak minus the gradients it leaves behind. One op at a time
keeps this memory-safe.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_tbp.compat import tree_flatten, tree_map, unset_fake_temporarily
from lightning_tbp.memory.meters import AllocatorPeak, allocator_peak, foreign_profiler_active, garbage_collection_held
from lightning_tbp.remat.op_args import map_op_leaves, op_leaves
from lightning_tbp.remat.ops import traits_of
from lightning_tbp.remat.overheads import timed_ns


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's layout without its data: what is needed to build a stand-in that allocates and
    runs alike (op calibration, the DP engine's tap meters)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    needs_grad: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the storage a stand-in allocates."""
        extent = 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True))
        return (extent if all(self.shape) else 0) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor, needs_grad: bool = False) -> TensorSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, needs_grad)

    def materialise(self) -> torch.Tensor:
        # Fill a flat storage, then view it with the recorded strides: strides may overlap
        # (an ``expand``ed input has stride 0), and in-place fills refuse overlapping tensors.
        extent = 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True))
        storage = torch.empty(extent if all(self.shape) else 0, dtype=self.dtype, device=self.device)
        if self.dtype.is_floating_point:
            fill_random(storage)
        else:
            storage.zero_()
        tensor = storage.as_strided(self.shape, self.stride)
        return tensor.requires_grad_(self.needs_grad)


#: Length of the random tile ``fill_random`` repeats.
_TILE = 1 << 16
_tiles: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def fill_random(flat: torch.Tensor) -> torch.Tensor:
    """Fill a 1-D floating tensor with values in [-1, 1): one random tile repeated.

    Any finite values time alike, but drawing them costs: ``uniform_`` over every stand-in and
    output gradient took 0.19 s of a reference U-Net's 1.2 s trace, copying a tile a fraction of
    that. The tile (256 KiB in fp32) is kept per dtype and device until :func:`release_random_tiles`
    (the end of planning: kept for the run, it was device memory no plan counted)."""
    key = (flat.dtype, flat.device)
    tile = _tiles.get(key)
    if tile is None:
        tile = _tiles[key] = torch.empty(_TILE, dtype=flat.dtype, device=flat.device).uniform_(-1.0, 1.0)
    whole, rest = divmod(flat.numel(), _TILE)
    with torch.no_grad():
        flat[: whole * _TILE].view(whole, _TILE).copy_(tile.expand(whole, _TILE))
        flat[whole * _TILE :].copy_(tile[:rest])
    return flat


def release_random_tiles() -> None:
    """Drop the tiles ``fill_random`` keeps."""
    _tiles.clear()


class OpCalibrator:
    """Collects the ops of a trace and measures their time (all) and workspace (heavy ones)."""

    def __init__(self) -> None:
        self._specs: dict[tuple, tuple[Any, tuple, dict]] = {}
        self.event_keys: dict[int, tuple] = {}
        self._event_outputs: dict[int, tuple[int | None, ...]] = {}
        self._workspace_keys: set[tuple] = set()
        self._timed_keys: set[tuple] = set()

    def note(
        self,
        event: int,
        func: Any,
        args: tuple,
        kwargs: dict,
        needs_grad: list[bool],
        outputs: list[int | None],
        workspace: bool,
    ) -> None:
        """Remember the op of ``event``; ``needs_grad`` flags which tensor arguments need gradients,
        ``outputs`` are the storage ids of its output tensors (None: no storage); ``workspace``:
        also measure its forward/backward workspace. Pure views are not timed: they only make
        metadata."""
        flags = iter(needs_grad)

        def describe(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            grad = next(flags) and x.is_floating_point()
            return TensorSpec.of(x, grad)

        spec = map_op_leaves(describe, (args, kwargs))
        key = (func, *op_leaves(spec))
        self._specs.setdefault(key, (func, *spec))
        self.event_keys[event] = key
        self._event_outputs[event] = tuple(outputs)
        if workspace:
            self._workspace_keys.add(key)
        if not traits_of(func).view and not _is_communication(func):
            self._timed_keys.add(key)

    def measure(
        self, consumers: Mapping[int, int]
    ) -> tuple[dict[int, tuple[float, float]], dict[int, tuple[int, int]]]:
        """(forward, backward) nanoseconds per noted event (0 for views), and (forward, backward)
        workspace bytes per heavy event (none under a running profiler on CPU).

        An op's backward gets gradients only for outputs whose storage ``consumers`` counts (read
        by later ops, or returned): autograd hands none to the others, and some backwards take
        another path when one comes (group and layer norm's backward for a gradient at the saved
        mean or rstd is torch's double-differentiable composite, 10x slower on a VAE than the
        kernel the training step runs). An output read by several ops gets their gradients'
        sum, whose layout need not be its own (see ``_measure_op``).

        Each distinct op is materialised once and run for both: timing and metering from the
        same inputs and the same forward halves what a separate pass for each cost (a third of
        a reference U-Net's planning time went to re-materialising and re-running its ops)."""
        metered = self._workspace_keys
        if foreign_profiler_active() and any(_device_of(self._specs[key]).type == "cpu" for key in metered):
            warnings.warn(
                "lightning_tbp: a torch profiler is running, so op workspaces cannot be measured on CPU; "
                "plans made now predict peaks a few percent low (plan outside the profiler to avoid this)",
                stacklevel=4,
            )
            metered = set()
        jobs = {
            event: (key, self._gradients_of(event, consumers))
            for event, key in self.event_keys.items()
            if key in self._timed_keys or key in metered
        }
        with garbage_collection_held():  # holding it off keeps the meters exact
            per_job = {
                job: _measure_op(
                    *self._specs[job[0]], job[1], timed=job[0] in self._timed_keys, metered=job[0] in metered
                )
                for job in set(jobs.values())
            }
        times = {event: per_job[jobs[event]][:2] if event in jobs else (0.0, 0.0) for event in self.event_keys}
        workspaces = {event: per_job[job][2:] for event, job in jobs.items() if job[0] in metered}
        return times, workspaces

    def _gradients_of(self, event: int, consumers: Mapping[int, int]) -> tuple[int, ...]:
        """Per output of ``event``, how many gradients reach it (0: none; a storage-less output: 1)."""
        return tuple(1 if sid is None else consumers.get(sid, 0) for sid in self._event_outputs[event])

    def measure_workspaces(
        self, consumers: Mapping[int, int], limit_bytes: int
    ) -> tuple[dict[int, tuple[int, int]], int]:
        """(forward, backward) workspace bytes per heavy event, measured on real stand-ins on this
        machine for a trace made of fake tensors (``tbp estimate``): what the kernels here
        allocate beyond their outputs, which fake tensors cannot show (on a CPU without native
        bf16, a bf16 convolution takes im2col's slow path and its column buffers). Ops whose
        stand-ins would take more than ``limit_bytes`` are skipped; returns their count too."""
        fits = {key for key in self._workspace_keys if _stand_in_bytes(self._specs[key]) <= limit_bytes}
        skipped = len(self._workspace_keys) - len(fits)
        jobs = {
            event: (key, self._gradients_of(event, consumers)) for event, key in self.event_keys.items() if key in fits
        }
        with unset_fake_temporarily(), garbage_collection_held():
            per_job = {
                job: _measure_op(*self._specs[job[0]], job[1], timed=False, metered=True) for job in set(jobs.values())
            }
        return {event: per_job[job][2:] for event, job in jobs.items()}, skipped


def _stand_in_bytes(spec: tuple) -> int:
    """Bytes an op's stand-ins and their gradients take: twice its tensor arguments'."""
    return 2 * sum(x.nbytes for x in tree_flatten(spec[1:])[0] if isinstance(x, TensorSpec))


_TIMING_RUNS = 2
#: Runs this long are timed once. A second run guards against a scheduler hiccup of a millisecond
#: or so, a few percent of such a run; repeating the long ops of a large model is what made its
#: profile cost more than its training step (an SD-1.5 U-Net at 512x512 on a 2-core CPU: op timing
#: 16 s of a 40 s profile, against a 23 s naive step).
SINGLE_RUN_NS = 20_000_000


def _is_communication(func: Any) -> bool:
    """Collectives (FSDP2's all-gathers run inside the forward): timing one alone on one process
    would wait for the others forever, and no plan recomputes them."""
    return func.namespace in _COMMUNICATION_NAMESPACES


_COMMUNICATION_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "fsdp"})


def best_ns(run: Callable[[], object], device: torch.device, warm_up_ns: float | None = None) -> float:
    """Nanoseconds of ``run()``: best of ``_TIMING_RUNS`` runs after a warm-up run (allocator,
    kernel selection). ``warm_up_ns``: the caller already made the warm-up run, which took that
    long; otherwise it is made and timed here. A run of ``SINGLE_RUN_NS`` or more is not repeated
    (see there), and a warm-up that long is the time: on an SD-1.5 U-Net's long ops a first run
    took what the next ones did, within their own spread, and repeating each of them once was a
    third of its profile."""
    if warm_up_ns is None:
        warm_up_ns = timed_ns(run, device)
    if warm_up_ns >= SINGLE_RUN_NS:
        return float(warm_up_ns)
    best = timed_ns(run, device)
    for _ in range(_TIMING_RUNS - 1):
        if best >= SINGLE_RUN_NS:
            break
        best = min(best, timed_ns(run, device))
    return float(best)


def first_run(
    run: Callable[[], object], device: torch.device, metered: bool = True
) -> tuple[float, AllocatorPeak | None]:
    """Run once, timed (the warm-up whose time ``best_ns`` keeps when it is long) and, if
    ``metered``, under the exact allocator meter (whose reading is returned, else None)."""
    if not metered:
        return float(timed_ns(run, device)), None
    with allocator_peak(device) as reading:
        elapsed = timed_ns(run, device)
    return float(elapsed), reading


def _measure_op(
    func: Any, spec_args: tuple, spec_kwargs: dict, gradients: tuple[int, ...], *, timed: bool, metered: bool
) -> tuple[float, float, int, int]:
    """One op alone: its forward and backward time (if ``timed``; the backward for random
    gradients at the output tensors ``gradients`` counts as reached, in order) and workspace (if
    ``metered``: the forward's peak beyond its outputs, the backward's beyond the gradients it
    returns). The first forward and backward, metered or not, warm the kernels up for the timed
    runs and are timed themselves (a long one is not repeated, ``best_ns``). Zeros where the op
    cannot run alone."""
    specs = [x for x in tree_flatten((spec_args, spec_kwargs))[0] if isinstance(x, TensorSpec)]
    device = specs[0].device if specs else torch.device("cpu")
    metered = metered and any(x.needs_grad for x in specs) and device.type in ("cpu", "cuda")
    args, kwargs = tree_map(
        lambda x: x.materialise() if isinstance(x, TensorSpec) else x,
        (spec_args, spec_kwargs),
        is_leaf=lambda x: isinstance(x, TensorSpec),
    )
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    forward_ns = backward_ns = 0.0
    forward_workspace = backward_workspace = 0
    try:
        returned: list[object] = []
        with torch.enable_grad():
            first_ns, forward = first_run(lambda: returned.append(func(*args, **kwargs)), device, metered)
        results = tree_flatten(returned)[0]
        if forward is not None:
            forward_workspace = max(0, forward.peak_bytes - forward.net_bytes)
        if timed:
            with torch.no_grad():
                forward_ns = best_ns(lambda: func(*args, **kwargs), device, warm_up_ns=first_ns)
        tensors = [o for o in results if isinstance(o, torch.Tensor)]
        counts = gradients + (1,) * (len(tensors) - len(gradients))  # a data-dependent count: all
        outs = [o for o, count in zip(tensors, counts, strict=False) if count and o.requires_grad]
        summed = [count > 1 for o, count in zip(tensors, counts, strict=False) if count and o.requires_grad]
        if not (inputs and outs and (timed or metered)):
            return forward_ns, 0.0, forward_workspace, 0

        def backward() -> None:
            torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)

        grads = [_random_like(o) for o in outs]
        backward_first_ns: float | None = None
        if metered:
            grad_bytes = sum(x.numel() * x.element_size() for x in inputs)
            backward_first_ns, reading = first_run(backward, device)
            assert reading is not None  # metered
            backward_workspace = max(0, reading.peak_bytes - grad_bytes)
            if any(mixed and _channels_last(g) for g, mixed in zip(grads, summed, strict=True)):
                # A channels-last output read by several ops gets the sum of their gradients, which is
                # row-major where their layouts differ (an output read by a group norm and, through
                # ``.contiguous()``, by a shortcut convolution: a VAE's up-block), and a kernel given
                # mixed layouts copies one of them first: 1 MiB more than measured for the VAE's
                # upsampling convolution, whose plan ran 1.11x its prediction. The larger is kept.
                dense = [g.contiguous() if mixed else g for g, mixed in zip(grads, summed, strict=True)]

                def dense_backward() -> None:
                    torch.autograd.grad(outs, inputs, dense, retain_graph=True, allow_unused=True)

                _, reading = first_run(dense_backward, device)
                assert reading is not None
                backward_workspace = max(backward_workspace, reading.peak_bytes - grad_bytes)
        if timed:
            backward_ns = best_ns(backward, device, warm_up_ns=backward_first_ns)
    except (RuntimeError, IndexError, ValueError):  # data-dependent ops fail on random data: keep what ran
        return forward_ns, backward_ns, forward_workspace, backward_workspace
    return forward_ns, backward_ns, forward_workspace, backward_workspace


def _channels_last(tensor: torch.Tensor) -> bool:
    """A dense tensor in channels-last order (not row-major): what convolutions keep on CPU."""
    if tensor.is_contiguous():
        return False
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return tensor.dim() in formats and tensor.is_contiguous(memory_format=formats[tensor.dim()])


def _random_like(tensor: torch.Tensor) -> torch.Tensor:
    """A random tensor in ``tensor``'s memory format (``empty_like`` is dense: one flat run)."""
    out = torch.empty_like(tensor)
    fill_random(out.as_strided((out.numel(),), (1,)))
    return out


def _device_of(spec: tuple) -> torch.device:
    tensors = [x for x in tree_flatten(spec[1:])[0] if isinstance(x, TensorSpec)]
    return tensors[0].device if tensors else torch.device("cpu")
