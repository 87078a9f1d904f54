"""The optimizer's state and its step in host memory, one parameter at a time inside the backward.

Adam keeps two moments per weight: for a full fine-tune in fp32 that is twice the weights again,
more than the activations of any plan. Here the user's optimizer keeps its state on the host and
steps there: each trainable parameter gets a host copy (its *master*, same dtype, so the weights
are exactly those of the ordinary step) that takes its place in the optimizer's parameter groups,
so the state torch's optimizers make "like the parameter" is made on the host, and schedulers,
``state_dict`` and checkpoints see the same optimizer, groups and options. When the backward
completes a parameter's gradient (:class:`~lightning_tbp.optim.OptimizerInBackward`), the
gradient is copied to a host buffer and freed on the device, the master is stepped, and the new
values are copied into the device parameter in place. The device then holds the weights and the
gradients still being made, nothing else of the optimizer.

With ``master_dtype`` (float32), a bf16 or fp16 parameter's master is float32 instead: its
gradient is widened on the host, the optimizer steps the float32 master with float32 state, and
the device gets the master rounded to its dtype (round to nearest even). Trained in bf16 alone,
an update smaller than half a bf16 ulp of the weight is lost at every step; kept in float32 on
the host it accumulates, at no device memory. That is the classic mixed-precision recipe (float32
masters, low-precision model), not the ordinary bf16 step: the weights equal those of a float32
optimizer over masters widened from the parameters (``tests/test_host_optimizer.py``). A master
that is not the parameter's dtype is kept in its own state under :data:`MASTER_KEY` (the same
tensor, no copy), so that checkpoints carry it and a resumed run goes on from the float32 values,
not from the rounded weights; it is put there after the first step made the state (an optimizer
makes its state where it finds none), and stays there when training ends, so a checkpoint saved
after it carries the masters too. A master brought back that does not round to the weights as
they are (they moved without it) is stale: dropped, with a warning.

The host step runs on a worker thread. On CUDA it overlaps the backward (each step is queued and
the block waits for all of them as it ends; the copy back is ordered after the kernels that read
the old weights on the same stream). On a CPU the host tier is emulated: the masters live in
buffers numpy allocates and the worker thread makes the state and the step's temporaries, none of
which the exact CPU meter (the profiler's memory events of the training thread) counts, and each
step is waited for at once (two compute pools on the same cores would slow both).

Lightning moves optimizer state to the device when it restores a checkpoint; a parameter's state
found off the host is moved back at its next step. :meth:`HostOptimizerState.remove` gives the
groups their device parameters back; the state stays in host memory (as after Lightning's own
teardown), so a later ``step()`` on the device needs it moved first.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from lightning_tbp.memory.breakdown import plain_tensors
from lightning_tbp.memory.held import state_bytes_to_come
from lightning_tbp.memory.homes import set_state_home, take_state_home
from lightning_tbp.optim.in_backward import step_only
from lightning_tbp.remat.host_tier import host_buffer, host_use

#: The key of a widened master in its own optimizer state (see the module's docstring).
MASTER_KEY = "lightning_tbp_master"


def _host_tensor(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor of ``like``'s shape and dtype (or ``dtype``); pinned for CUDA, numpy's for a CPU."""
    dtype = like.dtype if dtype is None else dtype
    nbytes = like.numel() * dtype.itemsize
    return host_buffer(nbytes, like.device, torch.empty(like.shape, dtype=dtype, device="meta"))


def master_dtype_of(param: torch.Tensor, master_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``param``'s master: ``master_dtype`` where that is a wider float, else its own."""
    if master_dtype is None or not param.is_floating_point() or master_dtype.itemsize <= param.dtype.itemsize:
        return param.dtype
    return master_dtype


def host_bytes_with_masters(optimizer: Optimizer, master_dtype: torch.dtype) -> int:
    """What the host will hold for ``optimizer`` with masters of ``master_dtype``: each trainable
    parameter's master and the state its first step makes in the master's dtype (asked before
    the state is made: with wider masters it is on the host from the first step)."""
    return sum(hosting.host_bytes for hosting in hostings(optimizer, master_dtype))


@dataclass(frozen=True)
class Hosting:
    """What moving one parameter's state and step to the host does: the state bytes it takes off
    the device (made, or its first step's to come) and of those still to come, and the bytes it
    puts on the host (its master and the state, in the master's dtype)."""

    param: torch.Tensor
    device_bytes: int
    pending_bytes: int
    host_bytes: int


def hostings(optimizer: Optimizer, master_dtype: torch.dtype | None = None) -> list[Hosting]:
    """Per trainable parameter of ``optimizer``, what hosting its state would do (probing the
    state of each distinct shape once: ``held.state_bytes_to_come``)."""
    probes: dict[tuple[int, tuple[int, ...], torch.dtype], int] = {}

    def to_come(index: int, param: torch.Tensor, dtype: torch.dtype) -> int:
        key = (index, tuple(param.shape), dtype)
        if key not in probes:
            probes[key] = state_bytes_to_come(optimizer, [(index, param, dtype)])
        return probes[key]

    found = []
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if not param.requires_grad:
                continue
            dtype = master_dtype_of(param, master_dtype)
            made = optimizer.state.get(param)
            pending = 0 if made else to_come(index, param, param.dtype)
            device = sum(t.numel() * t.element_size() for t in _own_tensors(made)) if made else pending
            state = device if made and dtype == param.dtype else to_come(index, param, dtype)
            found.append(Hosting(param, device, pending, param.numel() * dtype.itemsize + state))
    return found


def fewest_to_host(candidates: list[Hosting], at_least: int) -> list[Hosting] | None:
    """The fewest parameters, largest state first, whose hosting takes ``at_least`` bytes off the
    device (None: all of them do not)."""
    chosen = fewest_covering([h.device_bytes for h in candidates], at_least)
    return None if chosen is None else [candidates[i] for i in chosen]


def fewest_covering(state_bytes: Sequence[int], at_least: int) -> list[int] | None:
    """Indices of the fewest parameters, largest state (``state_bytes``) first, whose state adds
    up to ``at_least`` bytes (None: all of them do not): per byte moved, few large steps cost the
    host less than many small ones (each has a fixed cost, ``optim/step_cost.py``)."""
    chosen: list[int] = []
    freed = 0
    for index in sorted(range(len(state_bytes)), key=lambda i: state_bytes[i], reverse=True):
        if freed >= at_least:
            break
        chosen.append(index)
        freed += state_bytes[index]
    return chosen if freed >= at_least else None


def drop_masters(optimizer_states: list[dict]) -> int:
    """Take the masters out of saved optimizer states (``state_dict()``s); how many there were."""
    dropped = 0
    for saved in optimizer_states:
        for state in saved.get("state", {}).values():
            dropped += state.pop(MASTER_KEY, None) is not None
    return dropped


class HostOptimizerState:
    """``optimizer``'s state and step on the host; ``master_dtype``: masters of lower-precision
    float parameters in this (wider) dtype; ``hosted``: the trainable parameters whose state goes
    (None: all of them; the others keep theirs on the device and step there)."""

    def __init__(
        self,
        optimizer: Optimizer,
        master_dtype: torch.dtype | None = None,
        hosted: Collection[torch.Tensor] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.master_dtype = master_dtype
        self._only = None if hosted is None else {id(p) for p in hosted}
        self._masters: dict[int, torch.Tensor] = {}  # id(device parameter) -> its master
        self._devices: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device parameter, master)
        self._state_counted: set[int] = set()  # masters whose state ``host_use`` counts
        self._masters_dropped = False  # warned once
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="lightning_tbp-host-step")
        self._pending: list[Future[None]] = []
        self.overlapped = False
        for group in optimizer.param_groups:
            group["params"] = [self._master_of(p) for p in group["params"]]
        set_state_home(optimizer, frozenset(id(master) for _, master in self._devices))

    def hosts(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s state and step are on the host."""
        return id(param) in self._masters

    def _master_of(self, param: torch.Tensor) -> torch.Tensor:
        if not param.requires_grad or (self._only is not None and id(param) not in self._only):
            return param
        if param.device.type not in ("cpu", "cuda") or type(param.data) is not torch.Tensor:
            raise ValueError(
                f"the optimizer's state can go to the host for plain CPU or CUDA parameters only, not a "
                f"{type(param.data).__name__} on {param.device}; pass host_tier='off'"
            )
        self.overlapped = self.overlapped or param.device.type == "cuda"
        master = _host_tensor(param.detach(), master_dtype_of(param, self.master_dtype))
        master.copy_(param.detach())
        state = self.optimizer.state.pop(param, None)
        if state is not None:
            self.optimizer.state[master] = state
            self._run(lambda: self._state_to_host(master, move_all=True), wait=True)
        self._masters[id(param)] = master
        self._devices.append((param, master))
        return master

    @property
    def host_bytes(self) -> int:
        """What the host holds for the optimizer now: the masters and the state made so far."""
        masters = sum(master.numel() * master.element_size() for _, master in self._devices)
        states = (self.optimizer.state.get(master, {}) for _, master in self._devices)
        return masters + sum(t.numel() * t.element_size() for s in states for t in _own_tensors(s))

    @property
    def widened(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device parameter, master) of the masters wider than their parameter."""
        return [(param, master) for param, master in self._devices if master.dtype != param.dtype]

    def step(self, param: torch.Tensor, group_index: int) -> None:
        """Copy ``param``'s finished gradient to the host, free it, and step its master (in the
        optimizer's group ``group_index``) there (queued on CUDA: :meth:`wait` for it)."""
        grad = param.grad
        assert grad is not None
        host_grad = _host_tensor(grad)
        host_grad.copy_(grad)
        param.grad = None
        del grad
        master = self._masters[id(param)]
        self._run(lambda: self._step_master(param, master, host_grad, group_index), wait=not self.overlapped)

    def wait(self) -> None:
        """Until every queued step is done (its error, if any, raised here)."""
        pending, self._pending = self._pending, []
        for job in pending:
            job.result()

    def remove(self) -> None:
        """Give the groups their device parameters back (the state stays in host memory, float32
        masters with it: a checkpoint saved after training ended carries them, as one saved
        during it does)."""
        self.wait()
        self._worker.shutdown()
        back = {id(master): param for param, master in self._devices}
        for group in self.optimizer.param_groups:
            group["params"] = [back.get(id(p), p) for p in group["params"]]
        for param, master in self._devices:
            state = self.optimizer.state.pop(master, None)
            if state is not None:
                self.optimizer.state[param] = state
        self._devices.clear()
        self._masters.clear()
        take_state_home(self.optimizer)

    def _run(self, job: Callable[[], None], wait: bool) -> None:
        future = self._worker.submit(job)
        if wait:
            future.result()
        else:
            self._pending.append(future)

    def _step_master(self, param: torch.Tensor, master: torch.Tensor, grad: torch.Tensor, group_index: int) -> None:
        self._take_restored_master(param, master)
        self._state_to_host(master)
        master.grad = grad.to(master.dtype)  # widened where the master is wider (else the same tensor)
        try:
            step_only(self.optimizer, master, group_index)
        finally:
            master.grad = None
        self._state_to_host(master)  # made by its first step: counted
        if master.dtype != param.dtype:
            self.optimizer.state[master][MASTER_KEY] = master  # in checkpoints from now on
        with torch.no_grad():
            param.detach().copy_(master)

    def _state_to_host(self, master: torch.Tensor, move_all: bool = False) -> None:
        """Move ``master``'s state to the host where it is not (a restored checkpoint's; all of it
        with ``move_all``: state the device made before), on the worker thread (on a CPU, memory
        the exact meter does not count), and count it in ``host_use`` once."""
        state = self.optimizer.state.get(master)
        if not state:
            return
        for key, value in state.items():
            if key == MASTER_KEY:
                continue
            if isinstance(value, torch.Tensor) and (move_all or value.device != master.device):
                # state made like a narrower parameter (before the masters) is widened with it
                widen = value.is_floating_point() and value.shape == master.shape and value.dtype != master.dtype
                state[key] = value.to(master.device, dtype=master.dtype if widen else value.dtype, copy=True)
                self._state_counted.discard(id(master))
        if id(master) not in self._state_counted:
            self._state_counted.add(id(master))
            for tensor in _own_tensors(state):
                nbytes = tensor.numel() * tensor.element_size()
                host_use.allocated(nbytes)
                weakref.finalize(tensor, host_use.freed, nbytes)

    def _take_restored_master(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Go on from a master the state brought (a checkpoint's, cast and moved by its loading, or
        an earlier run's over the same optimizer) where this run keeps masters and it rounds to
        the weights as they are; else drop it, saying why once."""
        state = self.optimizer.state.get(master)
        restored = state.get(MASTER_KEY) if state else None
        if restored is None or restored is master:
            return
        assert state is not None
        del state[MASTER_KEY]
        if master.dtype == param.dtype:
            why = "this run keeps none (master_dtype=None)"
        elif not torch.equal(restored.to(param.dtype), param.detach().to(restored.device)):
            why = "they do not round to the weights (trained on after the masters were saved)"
        else:
            master.copy_(restored)
            state[MASTER_KEY] = master
            return
        if not self._masters_dropped:
            self._masters_dropped = True
            warnings.warn(
                f"lightning_tbp: the optimizer state's float32 masters are dropped: {why}; training goes "
                "on from the weights",
                stacklevel=2,
            )


def _own_tensors(state: dict) -> Iterator[torch.Tensor]:
    """The tensors of a parameter's state, less its master (counted as a master)."""
    return plain_tensors({key: value for key, value in state.items() if key != MASTER_KEY})
