"""Which parameter is clipped how, established from the module and from each loss's graph.

The guarantee the engine gives is that every trainable parameter reaching the loss gets its
gradient only through the engine's clipped path. It is checked by construction, not against a
list of known layers:

- At ``attach``, :func:`survey` sorts every trainable parameter: clipped by its layer's handler,
  or *tracked* (read through the module attribute, its uses clipped op by op; ``tracked.py``).
  A handled layer whose parameter is not a plain leaf (``weight_norm``, ``parametrize``) is
  tracked as a whole, so the reparametrization is differentiated too.
- At every backward, :func:`survey_graph` walks the loss's autograd graph. Plain autograd writes
  a leaf's gradient only through an ``AccumulateGrad`` node, so any such node for a trainable
  parameter (or for a tracked tensor: a custom ``autograd.Function`` given one) is a gradient the
  engine would not clip, and is refused before anything is written. A trainable parameter no
  clipped path reaches is refused as well (it would get noise but no gradient).
- At the first backward of each graph structure the engine probes sets of samples' losses alone
  (``probe_sets``: every ordered pair of samples is separated by one): every clipped path must
  then see a zero output gradient on the rows of every sample outside the set. That is the
  per-sample independence all clipping relies on; batch statistics, a sequence-first layout or a
  batch-sized dimension that is not the batch all fail it, with the module or op named. A layer
  whose dim 0 is a multiple of the batch (a video model's frames folded into it) passes when
  each probed sample's rows are its own block of rows and no other row gets its gradient: each sample's
  gradient is then the sum over its block of rows (``rows_per_sample``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_tbp.compat import FakeTensor
from lightning_tbp.privacy.errors import FIXES, CoverageError
from lightning_tbp.privacy.layers import LayerHandler, handler_for, trainable


@dataclass
class SlotSpec:
    """A layer whose handler clips ``params`` (by their names on the layer)."""

    name: str
    module: nn.Module
    handler: LayerHandler
    params: dict[str, nn.Parameter]


@dataclass
class Survey:
    """Every trainable parameter of a module, sorted by how it is clipped."""

    slots: list[SlotSpec] = field(default_factory=list)
    names: dict[int, list[str]] = field(default_factory=dict)  # id(param) -> qualified names
    params: dict[int, nn.Parameter] = field(default_factory=dict)
    frozen: dict[int, str] = field(default_factory=dict)  # id -> name of parameters frozen at attach
    tracked_only: dict[int, str] = field(default_factory=dict)  # id -> why it has no handler
    owners: list[nn.Module] = field(default_factory=list)  # modules owning trainable parameters
    batch_norms: list[tuple[str, nn.Module]] = field(default_factory=list)

    def describe(self, param: nn.Parameter) -> str:
        return " = ".join(repr(n) for n in self.names.get(id(param), ["<unknown>"]))


def survey(module: nn.Module) -> Survey:
    """Sort the trainable parameters of ``module`` (see the module docstring)."""
    found = Survey()
    found.frozen = {id(p): n for n, p in module.named_parameters() if not p.requires_grad}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            found.batch_norms.append((name or type(sub).__name__, sub))
        own = trainable(sub)
        if not own:
            continue
        found.owners.append(sub)
        for param_name, param in own.items():
            found.names.setdefault(id(param), []).append(f"{name}.{param_name}" if name else param_name)
            found.params[id(param)] = param
        handler, why = _usable_handler(sub)
        handled = {n: own[n] for n in (handler.param_names if handler else ()) if n in own}
        for param_name, param in own.items():
            if param_name not in handled:
                found.tracked_only.setdefault(id(param), why if handler is None else "not one of its layer's own")
        if handler is not None and handled:
            if "forward" in sub.__dict__:
                raise CoverageError(
                    f"module {name!r} already has an instance-level forward (another wrapper?); attach DP to the "
                    "plain module"
                )
            found.slots.append(SlotSpec(name or type(sub).__name__, sub, handler, handled))
    if not found.params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters to train privately")
    return found


def _usable_handler(module: nn.Module) -> tuple[LayerHandler | None, str]:
    """The module's handler if it can clip the module as it runs, else None and the reason."""
    handler = handler_for(module)
    if handler is None:
        return None, f"{type(module).__name__} has no per-sample handler"
    if torch.nn.utils.parametrize.is_parametrized(module):
        return None, f"{type(module).__name__} is parametrized"
    registered = dict(module.named_parameters(recurse=False))
    for param_name in handler.param_names:
        if param_name not in registered and isinstance(getattr(module, param_name, None), Tensor):
            return None, f"{type(module).__name__}.{param_name} is computed in a hook (weight_norm, spectral_norm)"
    return handler, ""


@dataclass
class GraphSurvey:
    """The clipped paths one loss's graph holds, and how many contribute to each parameter."""

    slot_calls: Counter
    uses: list
    contributions: Counter  # id(param) -> number of clipped paths reaching it
    readers: Counter = field(default_factory=Counter)
    """id(param) -> ops whose backward reads it to pass a gradient on (``completion.ReadsDone``)."""

    def structure(self) -> tuple:
        """What the independence probe is keyed by: the same structure is probed once."""
        return tuple(sorted((slot.name, count) for slot, count in self.slot_calls.items())), len(self.uses)


def survey_graph(loss: Tensor, found: Survey, engine: object) -> GraphSurvey:
    """Walk ``loss``'s graph; refuse leaks and unreached parameters (see the module docstring)."""
    from lightning_tbp.privacy.tracked import TrackedTensor

    slot_calls: Counter = Counter()
    readers: Counter = Counter()
    uses: list = []
    leaks: dict[int, str] = {}
    seen, stack = set(), [(loss.grad_fn, "the loss")]
    while stack:
        node, consumer = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        slot = getattr(node, "slot", None)
        use = getattr(node, "use", None)
        if slot is not None and getattr(slot, "engine", None) is engine:
            slot_calls[slot] += 1
        elif use is not None and getattr(use, "owner", None) is engine:
            uses.append(use)
        elif getattr(node, "reads_for", None) is engine:
            readers.update(id(param) for param in cast(Any, node).read_params)
        elif type(node).__name__ == "AccumulateGrad":
            variable = cast(Any, node).variable  # AccumulateGrad's leaf
            if isinstance(variable, TrackedTensor):
                for param in variable._params:
                    leaks[id(param)] = f"{consumer}, which received it without passing through torch functions"
            elif id(variable) in found.params:
                leaks[id(variable)] = consumer
            elif id(variable) in found.frozen:
                raise CoverageError(
                    f"parameter {found.frozen[id(variable)]!r} was frozen when the DP engine was attached but "
                    "requires grad now, so plain autograd would write its unclipped gradient: attach the engine "
                    "after choosing what trains (or freeze it again)"
                )
        stack.extend((next_node, node.name()) for next_node, _ in node.next_functions)
    if leaks:
        lines = [f"  {found.describe(found.params[pid])} (used by {consumer})" for pid, consumer in leaks.items()]
        raise CoverageError(
            "trainable parameters reach the loss through plain autograd, which would write their unclipped batch "
            "gradient:\n" + "\n".join(lines) + "\nThis happens when code uses a parameter without reading it as a "
            "module attribute (module._parameters, parameters(), torch.func.functional_call) or hands it to a "
            f"custom autograd.Function. For each: {FIXES}"
        )
    contributions: Counter = Counter()
    for slot, count in slot_calls.items():
        for param in slot.params.values():
            contributions[id(param)] += count
    for use in uses:
        for param in use.params:
            contributions[id(param)] += 1
    unreached = [pid for pid in found.params if contributions[pid] == 0]
    if unreached:
        names = ", ".join(found.describe(found.params[pid]) for pid in unreached)
        raise CoverageError(
            f"trainable parameters not used in this forward (or not reaching the loss): {names}; per-sample "
            "clipping needs every trainable parameter in the graph (each would get noise but no gradient): "
            "freeze them or use them"
        )
    return GraphSurvey(slot_calls, uses, contributions, readers)


def check_batch_norms(found: Survey) -> None:
    """Batch statistics mix the samples of a batch: no per-sample gradient exists."""
    mixing = [name for name, bn in found.batch_norms if bn.training or not bn.track_running_stats]
    if mixing:
        raise CoverageError(
            f"batch-norm layers {', '.join(mixing)} normalise with statistics of the whole batch, so no sample has a "
            "gradient of its own and per-sample clipping bounds nothing; replace them with GroupNorm/LayerNorm "
            "(or put them in eval mode with running statistics)"
        )


def rows_per_sample(grad: Tensor, batch: int) -> int | None:
    """How many rows of dim 0 each sample owns: 1 where dim 0 is the batch, ``k`` where the model
    folded ``k`` rows of each sample into it (a video model's frames before a per-frame layer),
    None where dim 0 is no multiple of the batch. A fold is sample-major (sample ``i`` owns rows
    ``i·k … i·k+k-1``, as ``reshape`` of a ``[batch, k, ...]`` tensor lays them): the probe checks it."""
    if grad.dim() == 0 or grad.shape[0] == 0 or grad.shape[0] % batch:
        return None
    return grad.shape[0] // batch


def probe_sets(batch: int) -> list[list[int]]:
    """Sets of samples whose summed losses the independence probe backpropagates, each alone.

    Independence means no sample's loss reaches another sample's rows. A probe of a set ``S``
    sees that for the pairs (``i`` in ``S``, ``j`` not in ``S``), so the sets must separate every
    ordered pair: each sample gets a distinct half-size subset of ``m`` probes (no subset holds
    another, so for ``i ≠ j`` some probe holds ``i`` and not ``j``), with the least ``m`` that has
    ``batch`` such subsets: 2 probes for 2 samples, 4 for 4, 6 for 16, 8 for 64, 11 for 256.
    Probing sample 0 alone would miss a model in which a later sample reads an earlier one
    (a cumulative sum over the batch)."""
    probes = 2
    while math.comb(probes, probes // 2) < batch:
        probes += 1
    subsets = itertools.islice(itertools.combinations(range(probes), probes // 2), batch)
    members: list[list[int]] = [[] for _ in range(probes)]
    for sample, subset in enumerate(subsets):
        for probe in subset:
            members[probe].append(sample)
    return members


def row_violation(grad: Tensor, batch: int, probed: Sequence[int]) -> str | None:
    """Why ``grad`` (an output gradient while only the losses of the samples ``probed`` are
    backpropagated) shows that its dim 0 is not the batch (or the batch folded sample-major with
    other rows), or None when it is consistent with it."""
    rows = rows_per_sample(grad, batch)
    if rows is None:
        return f"its gradient has shape {tuple(grad.shape)}, not [batch={batch}, ...] or a multiple of it"
    if isinstance(grad, FakeTensor):  # ``tbp estimate`` runs the step without values: shapes only
        return None
    outside = torch.ones(batch, dtype=torch.bool, device=grad.device)
    outside[list(probed)] = False
    reached = grad.unflatten(0, (batch, rows)).flatten(1).ne(0).any(dim=1) & outside
    if not bool(reached.any()):
        return None
    sample = int(reached.nonzero()[0])
    which = f"rows of sample {sample} receive gradient from the loss of sample(s) {listed_samples(probed)}"
    if rows > 1:
        return (
            f"{which} (dim 0 holds {rows} rows per sample, which must be grouped by sample: reshape a "
            "[batch, frames, ...] tensor, not [frames, batch, ...])"
        )
    return which


def listed_samples(samples: Sequence[int], shown: int = 8) -> str:
    """Sample indices for a message, the first ``shown`` of them."""
    head = ", ".join(str(s) for s in samples[:shown])
    return head if len(samples) <= shown else f"{head}, … ({len(samples)} samples)"
