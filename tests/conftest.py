import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_tbp.remat.pricing import priced_by_flops
from lightning_tbp.remat.shared_prefix import SharedPrefix
from lightning_tbp.remat.simulate import Simulator

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared helpers (models.py, dp_reference.py)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # workers share the machine's cores (``pytest -n auto``: one per core): one thread each, for
    # them and the processes they start, so that no worker's OpenMP threads spin against another's
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def flop_priced_plans() -> Iterator[None]:
    """Plans priced by FLOPs (``remat/pricing.py``) instead of measured times: the same model
    and budget always get the same plan.

    On the tiny test models a noisy machine can time a block's convolutions below the overhead
    that selective and lazy blocks pay, so which option wins would ride on timing noise. Tests
    that assert *which* options a plan picks use this; a full checkpoint then always costs more
    than a selective or lazy block that keeps its heavy outputs. Property tests use it so that a
    failing draw replays with the plan that failed."""
    with priced_by_flops():
        yield


@pytest.fixture
def shared_prefixes(monkeypatch: pytest.MonkeyPatch) -> list[SharedPrefix]:
    """Every prefix the simulations share while the test runs (``Simulator.sharing_prefix``), in
    the order the searches opened them: which searches shared, and how often a rest was taken."""
    opened: list[SharedPrefix] = []
    sharing_prefix = Simulator.sharing_prefix

    @contextlib.contextmanager
    def recorded(self: Simulator, split: int) -> Iterator[SharedPrefix]:
        with sharing_prefix(self, split) as prefix:
            opened.append(prefix)
            yield prefix

    monkeypatch.setattr(Simulator, "sharing_prefix", recorded)
    return opened
