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
