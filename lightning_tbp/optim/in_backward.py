"""The optimizer's step inside the backward: each parameter is stepped as soon as autograd has
completed its gradient, and the gradient is freed at once.

A training step then never holds the gradients of the whole model, nor the temporaries an
optimizer makes over all of them together: what it holds at a time is one parameter's gradient
and that parameter's step. The weights are exactly those of the ordinary step for optimizers whose
update of a parameter reads only that parameter's gradient and state (SGD, Adam/AdamW, Adafactor,
low-bit AdamW), because each parameter is stepped by the user's own optimizer, with its own
state, learning rate and hooks: for that one step every parameter group but the parameter's own
is emptied and the parameter's group holds only it, so schedulers, ``state_dict`` and checkpoints
see the optimizer as it is. Optimizers that read every gradient (LBFGS re-evaluates a closure)
are refused.

Autograd sums every contribution to a leaf before it accumulates it into ``.grad``, so the hook
(``Tensor.register_post_accumulate_grad_hook``) runs once per parameter per backward, with the
finished gradient, also through checkpoints that recompute. Outside :meth:`OptimizerInBackward.stepping`
nothing is stepped: a micro-batch that only accumulates keeps its gradients as usual, and the
backward that runs inside steps on the sums. A parameter that has a gradient but got none in that
backward (it took part only in earlier micro-batches) is stepped as the block ends, as the
ordinary step would have.

Gradients that do not arrive through autograd's accumulation (DP's engine writes each clipped sum
itself; DDP's communication hook has a bucket's sums once its all-reduce is done) are announced
by whoever writes them, through :meth:`OptimizerInBackward.gradient_done`; FSDP2 runs the hooks
on its sharded parameters itself, after their reduce-scatter. Each parameter is stepped at most
once per ``stepping`` block, whoever announces it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch.optim import Optimizer

from lightning_tbp.memory.breakdown import plain_tensors
from lightning_tbp.optim.choice import is_low_bit

if TYPE_CHECKING:
    from lightning_tbp.optim.host_state import HostOptimizerState

#: Optimizers whose step needs every gradient at once (a closure that re-evaluates the loss).
NEEDS_EVERY_GRADIENT: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)

#: Optimizers whose update of a parameter reads only its own gradient and state, checked bitwise
#: against their ordinary step (tests/test_optimizer_in_backward.py): the ones a planner may step
#: inside the backward without being asked (``optimizer_in_backward="auto"``). Exact classes:
#: a subclass may override ``step`` with anything.
PER_PARAMETER: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adafactor,
)


def steps_per_parameter(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is known to update each parameter from its own gradient alone: one of
    :data:`PER_PARAMETER`, or torchao's low-bit AdamW (checked bitwise in the same tests)."""
    return type(optimizer) in PER_PARAMETER or is_low_bit(optimizer)


class OptimizerInBackward:
    """Steps ``optimizer`` on each of its parameters inside the backward that completes its gradient.

    ``before_step(param)``, if given, runs on each parameter's finished gradient before its step
    (clipping a gradient by value, which reads only that gradient). ``state_made(nbytes)``, if
    given, is told when a parameter's first step is about to make its optimizer state (0) and
    how many bytes it made (a meter that keeps the state apart from the step marks both
    instants). ``enabled=False`` keeps the hooks idle (and ``stepping`` a no-op) until
    ``enabled`` is set, so that a planner can take the step into the backward from the next
    backward on. ``every_parameter``: a block ends by stepping every parameter it did not step,
    with a gradient or not (``before_step`` makes the gradient: DP noises every parameter, reached
    or not). ``host``: set a :class:`~lightning_tbp.optim.host_state.HostOptimizerState` of the
    same optimizer to step each parameter on the host instead, its state kept there. Call
    :meth:`remove` to detach the hooks (and give the host state back).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        before_step: Callable[[torch.Tensor], None] | None = None,
        state_made: Callable[[int], None] | None = None,
        enabled: bool = True,
        every_parameter: bool = False,
        hooks: bool = True,
    ) -> None:
        if isinstance(optimizer, NEEDS_EVERY_GRADIENT):
            raise ValueError(
                f"{type(optimizer).__name__} cannot step inside the backward: its step re-evaluates the loss "
                "with every gradient at hand; use a per-parameter optimizer (SGD, Adam, AdamW, ...)"
            )
        self.optimizer = optimizer
        self.before_step = before_step
        self.state_made = state_made
        self.enabled = enabled
        self.every_parameter = every_parameter
        self._active = False
        self._stepped_now: set[int] = set()  # ids of the parameters the running block stepped
        self._group_index: dict[torch.Tensor, int] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if param in self._group_index:
                    raise ValueError("a parameter is in two parameter groups of the optimizer")
                self._group_index[param] = index
                if param.requires_grad and hooks:
                    self._handles.append(param.register_post_accumulate_grad_hook(self.gradient_done))
        self.host: HostOptimizerState | None = None  # the state and step on the host (``host_state.py``)
        self.stepped = 0  # parameters stepped in the current (or last) ``stepping`` block
        self.stepped_after = 0  # of those, stepped as the block ended, after its backward

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Step each parameter whose gradient a backward inside completes, then any still holding one."""
        self._active, self.stepped, self.stepped_after = True, 0, 0
        self._stepped_now.clear()
        try:
            yield
            for param in self._group_index:
                if not self.enabled:
                    break
                if id(param) in self._stepped_now:
                    param.grad = None  # written again after its step (a gradient bucket copied back)
                elif param.grad is not None or (self.every_parameter and param.requires_grad):
                    self._step_and_free(param)
                    self.stepped_after += 1
        finally:
            self._active = False
            if self.host is not None:
                self.host.wait()

    def remove(self) -> None:
        if self.host is not None:
            self.host.remove()
            self.host = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def gradient_done(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete: inside a ``stepping`` block, step it and free the gradient."""
        waiting = self._active and self.enabled and id(param) not in self._stepped_now
        if waiting and (param.grad is not None or self.every_parameter):
            self._step_and_free(param)

    def _step_and_free(self, param: torch.Tensor) -> None:
        if self.before_step is not None:
            self.before_step(param)
        if self.host is not None and self.host.hosts(param):
            self.host.step(param, self._group_index[param])
        else:
            report = self.state_made if not self.optimizer.state.get(param) else None
            if report is not None:
                report(0)
            step_only(self.optimizer, param, self._group_index[param])
            param.grad = None
            if report is not None:
                report(sum(t.numel() * t.element_size() for t in plain_tensors(self.optimizer.state.get(param, {}))))
        self._stepped_now.add(id(param))
        self.stepped += 1


def step_only(optimizer: Optimizer, param: torch.Tensor, group_index: int) -> None:
    """One step of ``optimizer`` on ``param`` alone, a member of its group ``group_index``: for
    that step every other group is emptied and the parameter's own holds only it, so its options,
    state and learning rate are the optimizer's own."""
    groups = optimizer.param_groups
    own = groups[group_index]
    kept = [group["params"] for group in groups]
    for group in groups:
        group["params"] = [param] if group is own else []
    try:
        optimizer.step()
    finally:
        for group, params in zip(groups, kept, strict=True):
            group["params"] = params
