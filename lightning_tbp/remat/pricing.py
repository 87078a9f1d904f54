"""How the planner prices recomputation: by measured time (the default) or by FLOPs.

Measured op and block times make the cheapest plan for the machine at hand, but on small models
a noisy machine can time a block's convolutions below the overhead that selective and lazy
blocks pay, so which option wins rides on timing noise. Priced by FLOPs (plus one per op, with
no option overheads and no block calibration) the same model and budget always get the same
plan: for tests that assert which options a plan picks, and for runs that must be reproducible.
Memory is modelled the same either way.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_tbp.remat.overheads import StepOverheads
from lightning_tbp.remat.trace import Trace

_BY_FLOPS: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_tbp_priced_by_flops", default=False)


@contextmanager
def priced_by_flops() -> Iterator[None]:
    """Plans made inside this context price recomputation by FLOPs, not by measured time."""
    token = _BY_FLOPS.set(True)
    try:
        yield
    finally:
        _BY_FLOPS.reset(token)


def pricing_by_flops() -> bool:
    """Whether plans made now are priced by FLOPs (:func:`priced_by_flops`)."""
    return _BY_FLOPS.get()


def price_by_flops(trace: Trace) -> None:
    """Replace the trace's measured op times by FLOPs plus one per op, and drop option overheads."""
    trace.event_cost = [float(flops) + 1.0 for flops in trace.event_flops]
    trace.overheads = StepOverheads()
