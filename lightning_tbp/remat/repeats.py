"""Calls that repeat: the same module run several times in one step on the same shapes (an
unrolled sampling chain's K calls of one U-Net, a video VAE's equal temporal chunks).

The solver moves such calls together, as one sequence: every simulation replays the whole
step, so a search over each call's blocks apart costs about K times the simulations of a search
over one call's, and for little: at a chain's peak (the last call's backward) every earlier
call's saved tensors are live together, so a block whose checkpoint frees memory in one call
frees the same in each. What differs between calls is settled after (``Solver.untie``).
"""

from __future__ import annotations

from lightning_tbp.remat.trace import Trace


def repeated_calls(trace: Trace, counting_inputs: bool = False) -> list[list[int]]:
    """Per node, the nodes of the calls it repeats with (itself included), in forward order.

    Calls repeat when they are of one module, run the same number of ops, make the same bytes and
    save the same of what they make, and sit in blocks that repeat too (or in the same block):
    calls of one module at two shapes (a U-Net on an image and on its half-size copy) stay apart,
    since what a checkpoint frees differs between them, and tied blocks' ancestors move together,
    so a move legal for one of them is legal for each. What a call saves of its inputs is left
    out (unless ``counting_inputs``: calls equal op by op, as ``folding.py`` needs): a chain's
    first call saves the caller's input, which the trace does not count as made in the step,
    the others the previous call's output, which it does, and a checkpoint of the call keeps
    its input either way.
    """
    classes: dict[tuple[str, int, int, int, int], list[int]] = {}
    members: list[list[int]] = [[node.index] for node in trace.nodes]
    for node in trace.nodes[1:]:
        if not node.has_events:
            continue
        events = range(node.first_event, node.last_event + 1)
        made = sum(trace.storage_bytes[s] for e in events for s in trace.event_outputs[e])
        saved = sum(
            trace.storage_bytes[s]
            for e in events
            for s in trace.event_saves[e]
            if counting_inputs or node.first_event <= trace.storage_producer[s] <= node.last_event
        )
        parent = members[node.parent][0] if node.parent >= 0 else -1
        group = classes.setdefault((node.path, parent, len(events), made, saved), [])
        group.append(node.index)
        members[node.index] = group
    return members


def repeated_at_least(members: list[list[int]], times: float) -> bool:
    """Whether the blocks repeat ``times`` calls each on average: a step worth searching as one
    sequence when that is more than the calls the solver plans apart after (``Solver.untie``)."""
    distinct = sum(1 for index, group in enumerate(members) if index > 0 and group[0] == index)
    return len(members) > 1 and distinct * times <= len(members) - 1
