"""When a parameter may be stepped inside a DP backward: its clipped sum is complete, and no op's
backward still reads its value.

The engine forms each parameter's clipped sum at the taps, whose backward runs *before* the op
it taps; that op's backward still multiplies by the parameter to pass its input gradient on, so
stepping the parameter at its last contribution would change it under a pending backward
(autograd's version counter refuses). With the optimizer inside the backward, each op that reads
parameters gets an identity node on its inputs (:class:`ReadsDone`), whose backward runs after
the op's. A parameter is complete once every clipped contribution and every such node the graph
survey counted are in; blocks that bookkeeping runs again after its book make new nodes, which
count themselves as they are made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_tbp.compat import tree_flatten, tree_map
from lightning_tbp.privacy.tracked import TrackedTensor


class ReadsDone(torch.autograd.Function):
    """Identity on the inputs of an op that reads ``params``; its backward runs after the op's."""

    @staticmethod
    @override
    def forward(
        ctx: Any, owner: object, completion: Completion, params: tuple[nn.Parameter, ...], *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.reads_for, ctx.completion, ctx.read_params = owner, completion, params
        completion.reader_made(params)
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    @override
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        ctx.completion.read_done(ctx.read_params)
        return (None, None, None, *grads)


class Completion:
    """Counts, per parameter, what its step inside the backward still waits for in the running
    backward, and calls ``announce`` with it when nothing is left.

    ``owner``: the engine whose graphs the survey walks (it finds the nodes by it); ``describe``
    names a parameter in errors. The engine says which pass leaves the gradients (``final_pass``)
    and when a recorded block runs again (``rerunning``)."""

    def __init__(self, owner: object, describe: Callable[[nn.Parameter], str]) -> None:
        self.owner = owner
        self.describe = describe
        self.announce: Callable[[nn.Parameter], None] | None = None
        self.final_pass = False  # the pass that leaves the gradients (not a probe, not ghost's norms)
        self.rerunning = False  # a recorded block runs again after bookkeeping's book
        self._awaited: dict[int, int] = {}

    def start(self, contributions: Counter, readers: Counter) -> None:
        """A backward starts whose graph the survey found these clipped paths and readers in."""
        self._awaited = dict(contributions + readers)

    def end(self) -> None:
        self._awaited, self.final_pass = {}, False

    def mark_input(self, params: tuple[nn.Parameter, ...], x: Tensor) -> Tensor:
        """A tapped layer's input, marked when ``params`` may step inside the backward."""
        if self.announce is None or not x.requires_grad:
            return x
        (x,) = ReadsDone.apply(self.owner, self, params, x)
        return x

    def mark_reads(self, params: tuple[nn.Parameter, ...], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` of an op that reads ``params``, with the tensors that pass a
        gradient on through it marked, when parameters may step inside the backward."""
        if self.announce is None:
            return args, kwargs
        plain = tree_flatten((args, kwargs))[0]
        leaves = [x for x in plain if isinstance(x, Tensor) and x.requires_grad and not isinstance(x, TrackedTensor)]
        if not leaves:
            return args, kwargs
        marked = dict(zip(map(id, leaves), ReadsDone.apply(self.owner, self, params, *leaves), strict=True))
        return tree_map(lambda x: marked.get(id(x), x) if isinstance(x, Tensor) else x, (args, kwargs))

    def contributed(self, param: nn.Parameter) -> None:
        """One of ``param``'s clipped contributions is in its ``.grad``."""
        if self.announce is not None:
            self._settle(param)

    def reader_made(self, params: tuple[nn.Parameter, ...]) -> None:
        if self.rerunning:  # a recorded block's new graph: its readers were in no survey
            for param in params:
                self._awaited[id(param)] = self._awaited.get(id(param), 0) + 1

    def read_done(self, params: tuple[nn.Parameter, ...]) -> None:
        if self.final_pass:
            for param in params:
                self._settle(param)

    def _settle(self, param: nn.Parameter) -> None:
        left = self._awaited.get(id(param), 0) - 1
        if left < 0:
            raise RuntimeError(
                f"parameter {self.describe(param)} received a clipped contribution or a read after the graph "
                "survey's last one: its optimizer step inside the backward would have come too early. Please report "
                "this model"
            )
        self._awaited[id(param)] = left
        if left == 0:
            assert self.announce is not None
            self.announce(param)
