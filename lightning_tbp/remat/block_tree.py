"""What the solver knows of each block before it simulates a plan: the block's subtree, what
recomputing it under each option would cost, and which bytes live at an instant a checkpoint of
it would release.

Blocks are the trace's nodes, recorded in call (pre-)order, so a subtree is a contiguous index
range (``subtree_end``). The byte estimates only rank moves; the simulator decides.
"""

from __future__ import annotations

from lightning_tbp.remat.host_tier import offloaded
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.simulated_step import Holdings
from lightning_tbp.remat.trace import Trace


class BlockTree:
    """Per-block facts of one trace, computed once per solver."""

    def __init__(self, trace: Trace, block_weights: list[list[int]] | None = None) -> None:
        """``block_weights``: per block, the frozen weights streaming it moves to the host
        (``TraceFacts.block_weights``; None: none)."""
        self.trace = trace
        self.nodes = trace.nodes
        n = len(self.nodes)
        self.subtree_cost = [0.0] * n  # the block's ops, priced (a full checkpoint recomputes them all)
        self.cheap_cost = [0.0] * n  # the block's ops that are not heavy (a selective or lazy block's)
        self.heavy_outputs: list[list[int]] = [[] for _ in range(n)]
        self.event_count = [0] * n
        self.save_count = [0] * n
        self.offload_bytes = [0] * n  # what an offload of the block copies to the host and back
        self.offload_count = [0] * n  # in how many saved tensors
        weights = block_weights or [[] for _ in range(n)]
        self.stream_bytes = [sum(trace.storage_bytes[sid] for sid in sids) for sids in weights]
        self.stream_count = [len(sids) for sids in weights]
        for node in self.nodes:
            if not node.has_events:
                continue
            events = range(node.first_event, node.last_event + 1)
            self.subtree_cost[node.index] = sum(trace.event_cost[e] for e in events)
            self.cheap_cost[node.index] = sum(trace.event_cost[e] for e in events if not trace.event_traits[e].heavy)
            self.event_count[node.index] = len(events)
            self.save_count[node.index] = sum(len(trace.event_saves[e]) for e in events)
            copied = [trace.storage_bytes[s] for e in events for s in trace.event_saves[e] if offloaded(trace, s)]
            self.offload_bytes[node.index], self.offload_count[node.index] = sum(copied), len(copied)
            self.heavy_outputs[node.index] = [
                s for e in events if trace.event_traits[e].heavy for s in trace.event_outputs[e]
            ]
        self.ancestors: list[list[int]] = []
        for node in self.nodes:
            chain, parent = [], node.parent
            while parent > 0:
                chain.append(parent)
                parent = self.nodes[parent].parent
            self.ancestors.append(chain)
        self.subtree_end = list(range(1, n + 1))
        for node in reversed(self.nodes):
            if node.parent >= 0:
                self.subtree_end[node.parent] = max(self.subtree_end[node.parent], self.subtree_end[node.index])

    def cost_of(self, index: int, option: Option) -> float:
        """Estimated extra time of ``option`` on block ``index``: its recomputed ops in the real
        framework, and what the option itself adds (``overheads.py``)."""
        overheads = self.trace.overheads
        checkpoint = overheads.checkpoint_call_ns + self.save_count[index] * overheads.checkpoint_save_ns
        if option == Option.FULL:
            cost = self.subtree_cost[index] + checkpoint
        elif option == Option.SELECTIVE:
            dispatched = 2 * self.event_count[index] * overheads.selective_op_ns  # in the forward and the recompute
            cost = self.cheap_cost[index] + checkpoint + dispatched
        elif option == Option.LAZY:
            cost = self.cheap_cost[index] + self.event_count[index] * overheads.lazy_op_ns
        elif option == Option.OFFLOAD:
            hooks = self.save_count[index] * overheads.checkpoint_save_ns  # each save packed and unpacked in Python
            copies = self.offload_count[index] * overheads.offload_save_ns
            cost = self.offload_bytes[index] * overheads.offload_ns_per_byte + copies + hooks
        elif option == Option.STREAM:  # a full checkpoint, and its weights copied in twice
            copies = self.stream_bytes[index] * overheads.offload_ns_per_byte
            copies += self.stream_count[index] * overheads.offload_save_ns
            return (self.subtree_cost[index] + checkpoint) * self.trace.option_scale.get(Option.FULL, 1.0) + copies
        else:
            return 0.0
        return cost * self.trace.option_scale.get(option, 1.0)

    def releasable_bytes(self, holdings: Holdings) -> tuple[list[int], dict[int, int]]:
        """Per block, bytes live at the snapshot that only that block's subtree holds; and per
        storage, the lowest block that encloses all its holders.

        A storage is released by checkpointing any block that encloses all of its holders, i.e.
        any ancestor of the holders' lowest common block; its bytes are credited along that chain.
        """
        holder_nodes: dict[int, list[int]] = {}
        for event, sids in holdings.event_holds.items():
            for sid in sids:
                holder_nodes.setdefault(sid, []).append(self.trace.event_node[event])
        for node, sids in holdings.node_holds.items():
            for sid in sids:
                holder_nodes.setdefault(sid, []).append(node)
        freed = [0] * len(self.nodes)
        lca: dict[int, int] = {}
        for sid, nodes in holder_nodes.items():
            if sid in holdings.python_refs:
                continue
            common = nodes[0]
            for other in nodes[1:]:
                common = self.common_ancestor(common, other)
            lca[sid] = common
            size = holdings.sizes.get(sid, 0)
            walk = common
            while walk > 0:
                freed[walk] += size
                walk = self.nodes[walk].parent
        return freed, lca

    def common_ancestor(self, a: int, b: int) -> int:
        while not (a <= b < self.subtree_end[a]):
            a = self.nodes[a].parent
        return a

    def kept_inputs(self, index: int, holdings: Holdings, lca: dict[int, int]) -> int:
        """Inputs a checkpoint of ``index`` keeps although they were credited as released."""
        inputs = set(self.nodes[index].inputs)
        return sum(holdings.sizes.get(s, 0) for s in inputs if self._within(index, lca, s))

    def cache_bytes(self, index: int, holdings: Holdings, lca: dict[int, int]) -> int:
        """Heavy-op outputs a selective checkpoint of ``index`` keeps (whether live now or not)."""
        total = 0
        for sid in self.heavy_outputs[index]:
            if sid not in holdings.sizes:
                total += self.trace.storage_bytes[sid]
            elif self._within(index, lca, sid):
                total += holdings.sizes[sid]
        return total

    def _within(self, index: int, lca: dict[int, int], sid: int) -> bool:
        node = lca.get(sid, -1)
        return index <= node < self.subtree_end[index]
