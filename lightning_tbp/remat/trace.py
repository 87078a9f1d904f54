"""The trace: what one profiled forward pass did, as flat lists the later stages read.

Built once by the recorder (``record.py``), from a memory-safe forward that keeps no activation,
and read by everything after it (the simulator, the solver, the estimate) without being changed,
except for the prices the pricing stage sets (op times scaled to their blocks, option scales).
It holds

* the storages (bytes, whether they get a gradient, which op made them, when their last Python
  reference went away),
* the ops in order: the storages each reads and makes, what autograd saved at it, its FLOPs,
  measured times and workspaces, and its traits (``ops.py``: view, heavy, how its backward hands
  on the gradient, ...),
* the candidate modules (blocks) as a tree of nodes with their first and last op and the
  tensors entering and leaving them,
* stand-ins of the module's outputs, from which the loss a step computes is measured above the
  trace (``loss.py``).

The simulator runs this trace under any plan, so the trace is all the planner needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_tbp.remat.ops import OpTraits
from lightning_tbp.remat.overheads import StepOverheads

if TYPE_CHECKING:
    from lightning_tbp.remat.calibrate import TensorSpec
    from lightning_tbp.remat.step import LayerNote


#: Separates a module's path from its call number in a plan key (``call_key``).
CALL_SEPARATOR = "#"


def call_key(path: str, call: int) -> str:
    """The plan's name for the ``call``-th call (from 0) of the module at ``path`` in one step.

    A module called once per step is named by its path alone, as is the first call of one called
    several times; later calls add their number (``unet#1``: the U-Net's second call), so every
    call has a decision of its own and plans of modules called once read as before.
    """
    return path if call == 0 else f"{path}{CALL_SEPARATOR}{call}"


def module_path(key: str) -> str:
    """The module path in a plan key (``call_key``'s inverse, without the call)."""
    return key.partition(CALL_SEPARATOR)[0]


@dataclass
class Node:
    """One candidate block: one call of a module in the profiled forward (a module called several
    times, as a U-Net in an unrolled sampling chain, is a node per call)."""

    index: int
    path: str
    parent: int  # index of the enclosing candidate node, -1 for the root
    call: int = 0  # which call of the module at ``path`` this is, from 0, in the step
    kind: str = ""  # the module's class name (plans that checkpoint every block of a kind)
    first_event: int = -1
    last_event: int = -1
    inputs: tuple[int, ...] = ()  # storage ids of the tensors passed in (args and kwargs)
    outputs: tuple[int, ...] = ()
    children: list[int] = field(default_factory=list)
    replayable: bool = True  # a recorder takes its full checkpoint, and no two outputs share memory (``replay.py``)

    @property
    def key(self) -> str:
        """The plan's name for this call (``call_key``)."""
        return call_key(self.path, self.call)

    @property
    def has_events(self) -> bool:
        return self.first_event >= 0 and self.last_event >= self.first_event


@dataclass(frozen=True)
class GatherSpan:
    """One call of an FSDP2 unit in the profiled forward: its events and what it gathers."""

    first_event: int
    last_event: int
    nbytes: int
    regathered: bool  # freed when its forward ends and gathered again for its backward
    # the unit's post-backward runs after this call's backward (its first call in the forward),
    # and its reduce-scatter input, kept after it, holds ``reduce_bytes`` (its gradients' bytes);
    # ``largest_reduced_bytes``: its largest trainable parameter's (one optimizer step at a time)
    post_backward: bool = False
    reduce_bytes: int = 0
    largest_reduced_bytes: int = 0


@dataclass
class Gathers:
    """What a profile records of FSDP2: its units' spans, and how many reduce-scatter inputs it keeps."""

    spans: list[GatherSpan] = field(default_factory=list)
    reduce_inputs_kept: int = 1
    world: int = 1  # the processes FSDP2 shards over
    # gloo all-gathers into a flat copy of the output and copies out of it: a second buffer of the
    # output's size for the collective's instant (NCCL writes into the output)
    gathers_through_copy: bool = False


@dataclass
class Trace:
    """Everything the simulator needs, as flat lists indexed by storage id or event index."""

    storage_bytes: list[int] = field(default_factory=list)
    storage_needs_grad: list[bool] = field(default_factory=list)
    storage_is_activation: list[bool] = field(default_factory=list)  # False: parameter/buffer/input
    storage_producer: list[int] = field(default_factory=list)  # event index, -1 if made outside
    storage_written: list[bool] = field(default_factory=list)  # changed in place after it was made
    # Index of the last event before the storage's last Python reference went away (observed,
    # not inferred: the profiling forward saves nothing, so only Python keeps tensors alive);
    # -1 while alive at the end of the forward.
    storage_death: list[int] = field(default_factory=list)
    event_node: list[int] = field(default_factory=list)
    event_inputs: list[tuple[int, ...]] = field(default_factory=list)
    # inputs an op reads through a view smaller than their storage (a chunk, a slice): bytes seen
    event_partial_inputs: list[dict[int, int]] = field(default_factory=list)
    event_outputs: list[tuple[int, ...]] = field(default_factory=list)
    event_saves: list[list[int]] = field(default_factory=list)
    # storages made outside the step (parameters, buffers, inputs) that autograd saved at each op:
    # torch's checkpoint counts their packs too (where a recompute stops), and a streamed block's
    # weights saved there stay on the device until the op's backward (``host_weights.py``)
    event_resident_saves: list[list[int]] = field(default_factory=list)
    # what each op is (``ops.py``): every later stage reads these flags and decides nothing itself
    event_traits: list[OpTraits] = field(default_factory=list)
    event_flops: list[int] = field(default_factory=list)
    # measured forward time, ns: the op alone, scaled to its block's real forward (``forward_timing``)
    event_cost: list[float] = field(default_factory=list)
    event_backward_cost: list[float] = field(default_factory=list)  # measured backward time, ns (alone)
    event_forward_workspace: list[int] = field(default_factory=list)  # transient bytes inside the op
    event_workspace: list[int] = field(default_factory=list)  # transient bytes of the op's backward
    nodes: list[Node] = field(default_factory=list)
    # frozen parameters the host tier may stream, by storage: their names in the module
    # (``host_weights.streamable``); a storage under two names is not streamed
    frozen_weights: dict[int, str] = field(default_factory=dict)
    # trainable parameters by storage: their names in the module (a loop that steps some of them
    # on the host, ``LoopModel.hosted_parameters``)
    trainable_weights: dict[int, str] = field(default_factory=dict)
    module_outputs: tuple[int, ...] = ()
    # Trainable weights' casts that autocast keeps in its cache (alive at the forward's end):
    # referenced until the autocast context exits, which the training loop does after the loss
    # and before the backward (torch's AMP recipe), and from then on only by what saved them.
    # Empty under Lightning, whose precision plugins turn autocast's cache off
    autocast_cached: set[int] = field(default_factory=set)
    parameter_grad_bytes: int = 0
    overheads: StepOverheads = field(default_factory=StepOverheads)  # what plan options add (overheads.py)
    # Measured over modelled extra time of each plan option, from real block steps
    # (``calibrate_blocks.py``); the model's estimate stands where none was measured
    option_scale: dict = field(default_factory=dict)
    # layers the step model treats apart, as reported during the profile (``step.LayerNote``)
    step_notes: list[LayerNote] = field(default_factory=list)
    # stand-ins (shape, strides, dtype, gradient) of the module's tensor outputs, in order: what
    # the loss a step computes from them is measured on (``loss.assumed_loss_bytes``)
    output_specs: list[TensorSpec] = field(default_factory=list)
    # FSDP2 units' calls, the parameters each gathers and its buffers (``fsdp_gathers.py``): added
    # by the simulation
    fsdp: Gathers = field(default_factory=Gathers)
    # heavy ops whose workspace a fake trace did not measure (``record_trace``'s ``workspaces_below``)
    unmeasured_workspaces: int = 0
    # channels-last storages an op also copies to row-major (``.contiguous()``): read by other ops
    # as well, their gradient is the row-major sum of gradients of both layouts (``_gradients``)
    densified_storages: set[int] = field(default_factory=set)
    # per op that ran without grad and wrote into storages it read (in place or ``out=``): those
    # storages, which get no gradient from it (FSDP2 copying a unit's gathered weights into its
    # parameters); an op under no grad inside a custom Function still gives its inputs theirs
    no_grad_writes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Bytes each checkpoint holds besides its inputs on the profiled device: the CPU RNG state
    # it stashes (a CPU tensor, so nothing on a GPU); a recompute holds one more copy while it runs
    checkpoint_state_bytes: int = 0

    @property
    def num_events(self) -> int:
        return len(self.event_node)

    @property
    def output_gradient_bytes(self) -> int:
        """Bytes of the gradients the module's outputs receive: the scale of the loss computed from them."""
        return sum(self.storage_bytes[sid] for sid in set(self.module_outputs) if self.storage_needs_grad[sid])

    def step_ns(self, backward_passes: int) -> float:
        """Predicted time of the unplanned step: every op's forward (in its block's real forward)
        and, per backward pass, its backward; recomputation is priced against it."""
        return sum(self.event_cost) + backward_passes * sum(self.event_backward_cost)

    def block_edges(self) -> list[tuple[str, str, int]]:
        """Data edges between blocks: (producer block, consumer block, bytes).

        A block's input made by another block is an edge from the deepest block that made it
        (and does not enclose the consumer) to the consumer, so a U-Net skip shows up as an edge
        from a down-path block to an up-path block.
        """
        edges: dict[tuple[int, int], int] = {}
        for node in self.nodes[1:]:
            ancestors = set()
            walk = node.parent
            while walk >= 0:
                ancestors.add(walk)
                walk = self.nodes[walk].parent
            for sid in set(node.inputs):
                producer_event = self.storage_producer[sid] if self.storage_is_activation[sid] else -1
                if producer_event < 0:
                    continue
                producer = self.event_node[producer_event]
                if producer > 0 and producer not in ancestors:
                    key = (producer, node.index)
                    edges[key] = edges.get(key, 0) + self.storage_bytes[sid]
        return [(self.nodes[a].key, self.nodes[b].key, size) for (a, b), size in sorted(edges.items())]
