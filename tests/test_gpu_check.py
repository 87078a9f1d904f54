"""The GPU check's CPU dry-run: every part of ``scripts/gpu_check.py`` at tiny sizes, so that the
one command a lent GPU runs cannot rot between the rare times one is lent."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def test_the_gpu_run_fits_its_time_by_its_own_limits() -> None:
    listing = subprocess.run([sys.executable, str(SCRIPT), "--list", "--out", "unused"], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    total = int(listing.stdout.splitlines()[-1].split()[1])
    assert total <= 9 * 60  # a lent GPU gives 15 minutes, start-up included: room to fix and rerun a part


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_packs_its_results(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    with tarfile.open(tmp_path / "gpu_check.tgz") as archive:
        names = archive.getnames()
        summary = json.loads(archive.extractfile("./summary.json").read())  # type: ignore[union-attr]
    failed = {name: part for name, part in summary["parts"].items() if part.get("returncode") != 0}
    assert not failed, failed
    assert completed.returncode == 0, completed.stdout[-2000:]
    assert summary["machine"]["torch"]
    assert sum(name.endswith(".json") for name in names) >= 4, names  # each benchmark part wrote its result


def test_metered_windows_replays_a_cuda_history_between_its_marks() -> None:
    """``benchmarks/metered_windows.py`` (run on a GPU only) on a history written by hand: two
    nested regions, one with a mark; the peak above each opening level, the stretches between
    marks, what a region made alive at its peak, and an older block it freed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from metered_windows import MARKER, MarkerCall, metered_windows

    def event(action: str, addr: int, size: int, line: int = 1, name: str = "f") -> dict:
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "frames": [{"filename": "m.py", "line": line, "name": name}],
        }

    def marker(number: int) -> list[dict]:
        return [event("alloc", 100 + number, 512 * (1 + number), name=MARKER), event("free_completed", 100 + number, 0)]

    calls = [MarkerCall("open", 0, "outer"), MarkerCall("open", 1, "inner"), MarkerCall("mark", 1, "half")]
    calls += [MarkerCall("close", 1, "inner end"), MarkerCall("close", 0, "outer end")]
    events = [
        event("alloc", 1, 1000, line=5),  # made before both regions
        *marker(0),
        event("alloc", 2, 300, line=6),
        *marker(1),
        event("alloc", 3, 4000, line=7),
        event("free_completed", 1, 1000),
        *marker(2),
        event("alloc", 4, 2000, line=8),
        event("free_completed", 3, 4000),
        *marker(3),
        event("alloc", 5, 9000, line=9),
        event("free_completed", 5, 9000),
        *marker(4),
    ]
    inner, outer = metered_windows(events, calls)
    assert (inner["region"], outer["region"]) == ("inner end", "outer end")
    assert inner["open_level"] == 1300
    assert inner["peak_above_open"] == 5000  # the 4000 and 2000 blocks together, less the 1000 freed
    assert inner["stretches_above_open"] == [("half", 4000), ("inner end", 5000)]
    assert inner["end_above_open"] == 1000
    assert inner["made_inside_alive_at_peak"] == {"m.py:7 f | m.py:7 f": 4000, "m.py:8 f | m.py:8 f": 2000}
    assert inner["largest_alive_at_peak"] == [(4000, "m.py:7 f | m.py:7 f"), (2000, "m.py:8 f | m.py:8 f")]
    assert inner["made_before_freed_by_peak"] == {"m.py:5 f | m.py:5 f": 1000}
    assert outer["peak_above_open"] == 300 + 2000 + 9000 - 1000  # at the last block, after the inner region
