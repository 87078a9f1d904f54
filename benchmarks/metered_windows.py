"""What every exact meter region saw on CUDA: its peak above its opening level and what was alive
there, by the Python lines that allocated it.

For a prediction that a GPU's meter disagrees with (a CPU cannot show what a CUDA step
allocates). Runs named cases with CUDA's allocation history recorded; every region the CUDA
meter opens (``allocator_peak``: a test's whole fit, the loop's metered steps, ``Plan.verify``,
planning's profile and timings), every mark inside one and every close allocates a small marker
tensor from :func:`_tbp_window_marker`, in the history, whose size numbers it. The history is
then replayed: per region, its peak above the opening level, the blocks it made that were still
alive at that peak (by their innermost frames outside torch; allocations on autograd's thread
have no Python frames and read ``?``), the largest of them, blocks made before the region that
it freed (a meter reads those as the step's frees), and the peak of each stretch between its
marks.

    python benchmarks/metered_windows.py --out DIR [--cases main_job zoo_fit streamed fsdp1]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_tbp.compat import cuda_memory_snapshot, record_cuda_memory_history, stop_cuda_memory_history
from lightning_tbp.environment import machine_info
from lightning_tbp.memory import meters

ROOT = Path(__file__).resolve().parents[1]
MARKER = "_tbp_window_marker"
#: markers are numbered by their size, ``MARKER_SIZES`` steps of 512 bytes, cyclically
MARKER_SIZES = 256


@dataclass
class MarkerCall:
    """One region event, as logged on the Python side in call order."""

    kind: str  # "open", "mark" or "close"
    region: int
    label: str


def _place(frames: list[dict[str, Any]]) -> str:
    """The three innermost frames outside torch's own files, and the innermost frame."""
    names = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames]
    outside = [name for name, f in zip(names, frames, strict=True) if "/torch/" not in f["filename"]][:3]
    return " <- ".join(outside) + " | " + (names[0] if names else "?")


def _is_marker(event: dict[str, Any]) -> bool:
    return any(frame["name"] == MARKER for frame in event.get("frames", []))


@dataclass
class _Blocks:
    """Every block of a history: the events that made and freed it (never freed: past the end),
    its size and its place (an index into ``places``)."""

    made: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    place: list[int] = field(default_factory=list)
    places: list[str] = field(default_factory=list)


def metered_windows(
    events: list[dict[str, Any]], calls: list[MarkerCall], top: int = 14, largest: int = 5
) -> list[dict[str, Any]]:
    """Replay allocation ``events`` (a snapshot's device trace, in order) against the region
    ``calls`` their markers stand for, and describe each region that closed."""
    blocks, markers = _Blocks(), []
    by_address: dict[int, int] = {}
    place_ids: dict[tuple[tuple[str, int, str], ...], int] = {}
    delta = torch.zeros(len(events), dtype=torch.int64)
    for index, event in enumerate(events):
        action = event["action"]
        if action == "alloc" and _is_marker(event):
            if len(markers) >= len(calls) or event["size"] != 512 * (1 + len(markers) % MARKER_SIZES):
                raise ValueError(f"marker {len(markers)} does not match the calls logged ({len(calls)}): history lost?")
            markers.append(index)
        elif action == "alloc":
            frames = event.get("frames", [])
            key = tuple((f["filename"], f["line"], f["name"]) for f in frames[:12])
            if key not in place_ids:
                place_ids[key] = len(blocks.places)
                blocks.places.append(_place(frames))
            by_address[event["addr"]] = len(blocks.made)
            blocks.made.append(index)
            blocks.freed.append(len(events))
            blocks.size.append(event["size"])
            blocks.place.append(place_ids[key])
            delta[index] = event["size"]
        elif action == "free_completed" and event["addr"] in by_address:
            block = by_address.pop(event["addr"])
            blocks.freed[block] = index
            delta[index] = -blocks.size[block]
    level = torch.cumsum(delta, 0)  # after each event
    columns = ("made", "freed", "size", "place")
    table = {name: torch.tensor(getattr(blocks, name), dtype=torch.int64) for name in columns}
    opened: dict[int, tuple[int, list[tuple[str, int]]]] = {}
    found = []
    for call, index in zip(calls, markers, strict=False):
        if call.kind == "open":
            opened[call.region] = (index, [])
            continue
        if call.region not in opened:
            continue
        start, marks = opened[call.region]
        marks.append((call.label, index))
        if call.kind == "close":
            del opened[call.region]
            found.append(_describe(call, start, marks, level, table, blocks.places, top, largest))
    return found


def _describe(
    call: MarkerCall,
    start: int,
    marks: list[tuple[str, int]],
    level: torch.Tensor,
    table: dict[str, torch.Tensor],
    places: list[str],
    top: int,
    largest: int,
) -> dict[str, Any]:
    """One region from its opening marker at event ``start`` through its ``marks`` (the last is
    its close)."""
    opening, end = int(level[start]), marks[-1][1]
    peak_index = start + int(torch.argmax(level[start : end + 1]))
    stretches, previous = [], start
    for label, index in marks:
        stretches.append((label, int(level[previous : index + 1].max()) - opening))
        previous = index
    made, freed = table["made"], table["freed"]
    alive = (made > start) & (made <= peak_index) & (freed > peak_index)
    old = (made < start) & (freed > start) & (freed <= peak_index)
    chosen = sorted(zip(table["size"][alive].tolist(), table["place"][alive].tolist(), strict=True), reverse=True)
    return {
        "region": call.label,
        "open_level": opening,
        "peak_above_open": int(level[peak_index]) - opening,
        "end_above_open": int(level[end]) - opening,
        "stretches_above_open": stretches,
        "made_inside_alive_at_peak": _by_place(alive, table, places, top),
        "largest_alive_at_peak": [(size, places[place]) for size, place in chosen[:largest]],
        "made_before_freed_by_peak": _by_place(old, table, places, top),
    }


def _by_place(chosen: torch.Tensor, table: dict[str, torch.Tensor], places: list[str], top: int) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for size, place in zip(table["size"][chosen].tolist(), table["place"][chosen].tolist(), strict=True):
        totals[places[place]] += size
    return dict(totals.most_common(top))


def _tbp_window_marker(number: int) -> None:
    """Made and freed at once: the allocation is the marker, its size its number."""
    torch.empty(512 * (1 + number % MARKER_SIZES), dtype=torch.uint8, device="cuda")


def _caller() -> str:
    """Where a region event comes from: the four innermost frames outside torch and the meters."""
    skipped = ("/torch/", "contextlib", "meters.py", "metered_windows.py")
    frames = [f for f in traceback.extract_stack() if not any(part in f.filename for part in skipped)]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


class MarkedRegions:
    """Every CUDA meter region's open, marks and close logged and marked in the history."""

    def __init__(self) -> None:
        self.calls: list[MarkerCall] = []

    def _log(self, kind: str, region: Any) -> None:
        """Called right after the meter folded the peak counter (every open, close and mark does):
        the marker's own bytes are then taken out of the counter again, so no region reads them."""
        _tbp_window_marker(len(self.calls))
        torch.cuda.reset_peak_memory_stats()
        self.calls.append(MarkerCall(kind, region.key, _caller()))

    def __enter__(self) -> MarkedRegions:
        peaks = meters._CudaPeaks
        self._saved = (peaks.open, peaks.close, peaks._mark)
        open_, close, mark = self._saved
        log = self._log

        def marked_open(self: Any, result: Any) -> Any:
            region = open_(self, result)
            log("open", region)
            return region

        def marked_close(self: Any, region: Any) -> None:
            close(self, region)
            log("close", region)

        def marked_mark(self: Any, region: Any) -> None:
            mark(self, region)
            log("mark", region)

        peaks.open, peaks.close, peaks._mark = marked_open, marked_close, marked_mark  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        meters._CudaPeaks.open, meters._CudaPeaks.close, meters._CudaPeaks._mark = self._saved  # type: ignore[method-assign]


def _case(name: str) -> Callable[[], None]:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    import test_cuda

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import one_gpu_sharded

    def sharded(strategy: str) -> Callable[[], None]:
        def run() -> None:
            out = Path(tempfile.mkdtemp()) / "run.json"
            one_gpu_sharded.main(strategy, out)
            print(strategy, out.read_text())

        return run

    cases: dict[str, Callable[[], None]] = {
        "main_job": test_cuda.test_the_main_jobs_whole_fit_holds_its_budget_on_cuda,
        "zoo_fit": test_cuda.test_a_zoo_whole_fit_holds_its_budget_on_cuda,
        "streamed": lambda: test_cuda.test_streamed_weights_on_cuda_leave_the_device_and_hold_the_budget(
            lambda key, value: print(key, value)
        ),
        # in this process: keep it last, it leaves a process group behind
        "fsdp1": sharded("tiny_backprop_fsdp"),
    }
    return cases[name]


def run_case(name: str, top_regions: int = 40) -> dict[str, Any]:
    """One case under recorded history: its largest regions, and its error if it raised."""
    gc.collect()
    torch.cuda.empty_cache()
    error = None
    record_cuda_memory_history(3_000_000, python_stacks_only=True)
    try:
        with MarkedRegions() as regions:
            _case(name)()
    except Exception:  # a failing case is still described: that is what this is for
        error = traceback.format_exc(limit=-3)
    snapshot = cuda_memory_snapshot()
    stop_cuda_memory_history()
    events = [event for trace in snapshot["device_traces"] for event in trace]
    del snapshot
    try:
        windows = metered_windows(events, regions.calls)
    except ValueError as lost:
        return {"error": error, "windows": [], "replay": str(lost)}
    windows.sort(key=lambda w: -w["peak_above_open"])
    return {"error": error, "regions": len(windows), "windows": windows[:top_regions]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=["main_job", "zoo_fit", "streamed", "fsdp1"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("metered_windows.py reads CUDA's allocation history: run it on a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Any] = {}
    for name in args.cases:
        rows[name] = run_case(name)
        print(name, json.dumps(rows[name], indent=1)[:3000], flush=True)
        (args.out / "metered_windows.json").write_text(json.dumps({"machine": machine_info(), "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
