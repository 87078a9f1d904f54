"""Replay a trace under a plan: predicted peak memory and recomputation cost, without running it.

The replay follows what torch does with non-reentrant ``torch.utils.checkpoint``:

* Outside any checkpoint, each op keeps the tensors autograd saves until its backward runs.
* A checkpointed block keeps only its inputs (saved through the enclosing hooks, so an inner
  checkpoint's inputs are themselves recomputed by an outer one). When the backward first needs
  the block, it is re-run from its inputs up to the last op that saves something ("early stop"),
  with inner checkpointed blocks again keeping only their inputs; recomputed tensors are released
  as their ops' backward runs.
* A selective block (selective activation checkpointing) also caches the outputs of heavy ops
  (matmul, convolution, attention) during the forward, so its recomputation re-runs only the
  cheap ops; the cache stays alive until the block's backward is over (measured with torch 2.13,
  CPU allocator events).
* The gradient of a tensor appears when the backward of its last consumer runs and disappears
  after the backward of its producer; parameter gradients stay.
* A tensor's Python reference ends at its last use in the forward pass.

Memory is counted above the state before the forward (parameters and inputs are the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from lightning_tbp.remat.trace import Trace


class Option(IntEnum):
    """What the plan does with one block."""

    KEEP = 0
    """No checkpoint: autograd keeps what it saves (children may still be checkpointed)."""
    FULL = 1
    """Checkpoint the whole block: keep its inputs, recompute it in the backward."""
    SELECTIVE = 2
    """Keep inputs and heavy-op outputs, recompute the cheap ops (norms, activations, adds)."""


@dataclass
class Snapshot:
    """Who holds which storage at one instant of the replay (used to steer the solver)."""

    region: int
    event_holds: dict[int, list[int]]
    node_holds: dict[int, list[int]]
    python_refs: set[int]
    sizes: dict[int, int]


@dataclass
class SimResult:
    peak_bytes: int
    recompute_cost: float
    recompute_flops: int
    forward_end_bytes: int
    peak_step: int
    snapshot: Snapshot | None = None
    recompute_counts: dict[int, int] = field(default_factory=dict)


class Simulator:
    """Replays one trace under many plans; the per-trace preprocessing is done once."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        n_storages = len(trace.storage_bytes)
        n_events = trace.num_events
        self.parent = [node.parent for node in trace.nodes]
        self.first = [node.first_event for node in trace.nodes]
        self.last = [node.last_event for node in trace.nodes]
        end = n_events + 1
        last_use = [-1] * n_storages
        last_consumer = [-1] * n_storages
        for event, inputs in enumerate(trace.event_inputs):
            for sid in inputs:
                last_use[sid] = event
                last_consumer[sid] = event
        for sid in trace.module_outputs:
            last_use[sid] = end
        for sid, producer in enumerate(trace.storage_producer):
            if producer >= 0 and last_use[sid] < producer:
                last_use[sid] = producer  # never read again: dies right after it is made
        self.dies_at: list[list[int]] = [[] for _ in range(n_events)]
        for sid, event in enumerate(last_use):
            if 0 <= event < n_events and trace.storage_is_activation[sid]:
                self.dies_at[event].append(sid)
        self.grads_created: list[list[int]] = [[] for _ in range(n_events)]
        self.grads_freed: list[list[int]] = [[] for _ in range(n_events)]
        for sid in range(n_storages):
            if not trace.storage_needs_grad[sid]:
                continue
            if last_consumer[sid] >= 0:
                self.grads_created[last_consumer[sid]].append(sid)
            producer = trace.storage_producer[sid]
            if producer >= 0:
                self.grads_freed[producer].append(sid)
        self.is_activation = trace.storage_is_activation
        self.sizes = trace.storage_bytes

    # -- plan helpers ---------------------------------------------------------------------------
    def context(self, node: int, region: int, options: list[Option]) -> int:
        """Outermost checkpointed block strictly inside ``region`` that encloses ``node``."""
        found = -1
        while node != region and node >= 0:
            if options[node] != Option.KEEP:
                found = node
            node = self.parent[node]
        return found

    def run(self, options: list[Option], capture_step: int = -1) -> SimResult:
        return _Replay(self, options, capture_step).result()


class _Replay:
    """State of one replay; methods mirror the phases of a training step."""

    def __init__(self, sim: Simulator, options: list[Option], capture_step: int) -> None:
        self.sim = sim
        self.trace = sim.trace
        self.options = options
        self.capture_step = capture_step
        self.snapshot: Snapshot | None = None
        self.extra_sizes: dict[int, int] = {}
        self.next_sid = len(sim.sizes)
        self.holders: dict[int, int] = {}
        self.python_refs: set[int] = set()
        self.alive: set[int] = set()
        self.grads: set[int] = set()
        self.event_holds: dict[int, list[int]] = {}
        self.node_inputs: dict[int, list[int]] = {}
        self.node_cache: dict[int, list[int]] = {}
        self.mem = 0
        self.peak = 0
        self.step = 0
        self.peak_step = 0
        self.region = 0
        self.recompute_cost = 0.0
        self.recompute_flops = 0
        self.recompute_counts: dict[int, int] = {}

        trace = self.trace
        self.forward(0, 0, trace.num_events - 1, recompute=False)
        self.forward_end = self.mem
        for sid in trace.module_outputs:
            if trace.storage_needs_grad[sid] and sid not in self.grads:
                self.grads.add(sid)
                self.mem += sim.sizes[sid]
        self.tick()
        self.backward(0, 0, trace.num_events - 1)

    def result(self) -> SimResult:
        return SimResult(
            peak_bytes=self.peak,
            recompute_cost=self.recompute_cost,
            recompute_flops=self.recompute_flops,
            forward_end_bytes=self.forward_end,
            peak_step=self.peak_step,
            snapshot=self.snapshot,
            recompute_counts=self.recompute_counts,
        )

    # -- bookkeeping ----------------------------------------------------------------------------
    def size(self, sid: int) -> int:
        return self.sim.sizes[sid] if sid < len(self.sim.sizes) else self.extra_sizes[sid]

    def tick(self) -> None:
        if self.mem > self.peak:
            self.peak, self.peak_step = self.mem, self.step
        if self.step == self.capture_step:
            self.snapshot = Snapshot(
                region=self.region,
                event_holds={k: list(v) for k, v in self.event_holds.items()},
                node_holds={k: list(v) + self.node_cache.get(k, []) for k, v in self.node_inputs.items()},
                python_refs=set(self.python_refs),
                sizes={sid: self.size(sid) for sid in self.alive},
            )
        self.step += 1

    def hold(self, sids: list[int]) -> list[int]:
        held = [sid for sid in sids if sid in self.alive]
        for sid in held:
            self.holders[sid] = self.holders.get(sid, 0) + 1
        return held

    def release(self, sids: list[int]) -> None:
        for sid in sids:
            self.holders[sid] -= 1
            self.maybe_free(sid)

    def maybe_free(self, sid: int) -> None:
        if sid in self.alive and not self.holders.get(sid) and sid not in self.python_refs:
            self.alive.discard(sid)
            self.mem -= self.size(sid)

    def allocate(self, sid: int) -> None:
        self.alive.add(sid)
        self.python_refs.add(sid)
        self.mem += self.size(sid)

    # -- phases ---------------------------------------------------------------------------------
    def forward(self, region: int, lo: int, hi: int, recompute: bool) -> None:
        """Forward over events ``lo..hi`` of ``region``; a recompute uses fresh storage ids."""
        sim, trace, options = self.sim, self.trace, self.options
        selective_recompute = recompute and options[region] == Option.SELECTIVE
        remap: dict[int, int] = {}

        def mapped(sid: int) -> int:
            return remap.get(sid, sid)

        for event in range(lo, hi + 1):
            ctx = sim.context(trace.event_node[event], region, options)
            if ctx >= 0 and event == sim.first[ctx]:
                self.node_inputs[ctx] = self.hold([mapped(s) for s in trace.nodes[ctx].inputs])
                self.node_cache[ctx] = []
            cached = selective_recompute and trace.event_heavy[event]
            for sid in trace.event_outputs[event]:
                if cached or not sim.is_activation[sid]:
                    continue
                if recompute:
                    new = self.next_sid
                    self.next_sid += 1
                    self.extra_sizes[new] = sim.sizes[sid]
                    remap[sid] = new
                    sid = new
                self.allocate(sid)
            if ctx < 0:
                self.event_holds[event] = self.hold([mapped(s) for s in trace.event_saves[event]])
            elif options[ctx] == Option.SELECTIVE and trace.event_heavy[event]:
                self.node_cache[ctx].extend(self.hold([mapped(s) for s in trace.event_outputs[event]]))
            if recompute and not cached:
                self.recompute_cost += trace.event_cost[event]
                self.recompute_flops += trace.event_flops[event]
            self.tick()
            for sid in sim.dies_at[event]:
                sid = mapped(sid)
                self.python_refs.discard(sid)
                self.maybe_free(sid)
        if recompute:  # the recomputed function's own results are dropped when it returns
            for sid in remap.values():
                self.python_refs.discard(sid)
                self.maybe_free(sid)

    def backward(self, region: int, lo: int, hi: int) -> None:
        sim, trace, options = self.sim, self.trace, self.options
        event = hi
        while event >= lo:
            ctx = sim.context(trace.event_node[event], region, options)
            if ctx < 0:
                self.backward_event(event)
                event -= 1
                continue
            self.recompute_counts[ctx] = self.recompute_counts.get(ctx, 0) + 1
            outer_region, self.region = self.region, ctx
            self.forward(ctx, sim.first[ctx], self.early_stop_end(ctx), recompute=True)
            self.backward(ctx, sim.first[ctx], sim.last[ctx])
            self.release(self.node_inputs.pop(ctx, []))
            self.region = outer_region
            event = sim.first[ctx] - 1

    def early_stop_end(self, block: int) -> int:
        """Last event a recompute of ``block`` must run: the last one that saves something."""
        sim, trace = self.sim, self.trace
        end = sim.first[block]
        for event in range(sim.first[block], sim.last[block] + 1):
            ctx = sim.context(trace.event_node[event], block, self.options)
            if (ctx < 0 and trace.event_saves[event]) or (ctx >= 0 and event == sim.first[ctx]):
                end = event
        return end

    def backward_event(self, event: int) -> None:
        sizes = self.sim.sizes
        for sid in self.sim.grads_created[event]:
            if sid not in self.grads:
                self.grads.add(sid)
                self.mem += sizes[sid]
        workspace = self.trace.event_workspace[event]
        self.mem += workspace
        self.tick()
        self.mem -= workspace
        self.release(self.event_holds.pop(event, []))
        for sid in self.sim.grads_freed[event]:
            if sid in self.grads:
                self.grads.discard(sid)
                self.mem -= sizes[sid]
