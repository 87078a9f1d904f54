import sys
from pathlib import Path

import pytest

from lightning_tbp.remat import plan as plan_module
from lightning_tbp.remat.calibrate_blocks import Calibration
from lightning_tbp.remat.overheads import StepOverheads
from lightning_tbp.remat.trace import Trace

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared helpers (models.py, dp_reference.py)


@pytest.fixture
def flop_priced_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans priced by FLOPs (plus one per op) with no option overheads or block calibration,
    instead of measured times: the same model and budget always get the same plan.

    On the tiny test models a noisy machine can time a block's convolutions below the overhead
    that selective and lazy blocks pay, so which option wins would ride on timing noise. Tests
    that assert *which* options a plan picks use this; a full checkpoint then always costs more
    than a selective or lazy block that keeps its heavy outputs. Property tests use it so that a
    failing draw replays with the plan that failed."""
    original = plan_module.record_trace

    def flop_priced_trace(*args: object, **kwargs: object) -> Trace:
        trace = original(*args, **kwargs)
        trace.event_cost = [float(flops) + 1.0 for flops in trace.event_flops]
        trace.overheads = StepOverheads()
        return trace

    monkeypatch.setattr(plan_module, "record_trace", flop_priced_trace)
    monkeypatch.setattr(plan_module, "calibrate", lambda *args, **kwargs: Calibration((), {}))
