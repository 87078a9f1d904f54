"""What each metered step saw on CUDA: its peak above the meter's opening level and what was alive
there, by the Python lines that allocated it.

For a prediction that a GPU's meter disagrees with (a CPU cannot show what a CUDA step
allocates). Runs named cases with CUDA's allocation history recorded; every ``StepMeter`` window
(``Plan.verify`` and the strategy's metered forward and backward) is bracketed by two marker
allocations of sizes nothing else makes, and the history is replayed between them: the peak above
the opening level, the blocks made inside the window still alive at that peak (by their innermost
frames outside torch), and blocks made before the window that it freed (a meter reads those as the
step's frees).

    python benchmarks/metered_windows.py --out DIR [--cases main_job zoo_fit streamed]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_tbp.compat import cuda_memory_snapshot, record_cuda_memory_history, stop_cuda_memory_history
from lightning_tbp.environment import machine_info
from lightning_tbp.remat.verify import StepMeter

ROOT = Path(__file__).resolve().parents[1]

#: Marker sizes (multiples of the allocator's 512-byte rounding) that open and close a window.
OPEN_MARK, CLOSE_MARK = 7777 * 512, 7779 * 512


def _place(frames: list[dict[str, Any]]) -> str:
    """The three innermost frames outside torch's own files, and the innermost frame."""
    names = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames]
    outside = [name for name, f in zip(names, frames, strict=True) if "/torch/" not in f["filename"]][:3]
    return " <- ".join(outside) + " | " + (names[0] if names else "?")


def metered_windows(events: Iterable[dict[str, Any]], top: int = 14) -> list[dict[str, Any]]:
    """Replay allocation ``events`` (a snapshot's device trace, in order) and describe each window
    between an ``OPEN_MARK`` and a ``CLOSE_MARK`` allocation."""
    alive: dict[int, tuple[int, str]] = {}
    level = 0
    window: dict[str, Any] | None = None
    found = []
    for event in events:
        action = event["action"]
        if action == "alloc" and event["size"] in (OPEN_MARK, CLOSE_MARK):  # marks only: not counted
            if event["size"] == OPEN_MARK:
                window = {"open": level, "peak": level, "made": {}, "at_peak": {}, "old_freed": Counter()}
            elif window is not None:
                at_peak: Counter[str] = Counter()
                for size, place in window["at_peak"].values():
                    at_peak[place] += size
                found.append(
                    {
                        "open_level": window["open"],
                        "peak_above_open": window["peak"] - window["open"],
                        "end_above_open": level - window["open"],
                        "made_inside_alive_at_peak": dict(at_peak.most_common(top)),
                        "made_before_freed_inside": dict(window["old_freed"].most_common(top)),
                    }
                )
                window = None
        elif action == "alloc":
            alive[event["addr"]] = (event["size"], _place(event.get("frames", [])))
            level += event["size"]
            if window is not None:
                window["made"][event["addr"]] = alive[event["addr"]]
                if level > window["peak"]:
                    window["peak"], window["at_peak"] = level, dict(window["made"])
        elif action == "free_completed" and event["addr"] in alive:
            size, place = alive.pop(event["addr"])
            level -= size
            if window is not None and window["made"].pop(event["addr"], None) is None:
                window["old_freed"][place] += size
    return found


def _mark(size: int) -> None:
    torch.empty(size, dtype=torch.uint8, device="cuda")  # made and freed at once: the allocation is the mark


class _MarkedMeters:
    """``StepMeter.start``/``stop`` bracketed by the marker allocations while inside."""

    def __enter__(self) -> None:
        self._start, self._stop = StepMeter.start, StepMeter.stop
        start, stop = self._start, self._stop

        def marked_start(meter: StepMeter, device: torch.device) -> bool:
            _mark(OPEN_MARK)
            return start(meter, device)

        def marked_stop(meter: StepMeter) -> Any:
            reading = stop(meter)
            _mark(CLOSE_MARK)
            return reading

        StepMeter.start, StepMeter.stop = marked_start, marked_stop  # type: ignore[method-assign]

    def __exit__(self, *_: object) -> None:
        StepMeter.start, StepMeter.stop = self._start, self._stop  # type: ignore[method-assign]


def _case(name: str) -> Callable[[], None]:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    import test_cuda

    cases: dict[str, Callable[[], None]] = {
        "main_job": test_cuda.test_the_main_jobs_whole_fit_holds_its_budget_on_cuda,
        "zoo_fit": test_cuda.test_a_zoo_whole_fit_holds_its_budget_on_cuda,
        "streamed": lambda: test_cuda.test_streamed_weights_on_cuda_leave_the_device_and_hold_the_budget(
            lambda key, value: print(key, value)
        ),
    }
    return cases[name]


def run_case(name: str) -> dict[str, Any]:
    """One case under recorded history: its windows, and its error if it raised."""
    gc.collect()
    torch.cuda.empty_cache()
    error = None
    record_cuda_memory_history(2_000_000, python_stacks_only=True)
    try:
        with _MarkedMeters():
            _case(name)()
    except Exception:  # a failing case is still described: that is what this is for
        error = traceback.format_exc(limit=-3)
    snapshot = cuda_memory_snapshot()
    stop_cuda_memory_history()
    events = [event for trace in snapshot["device_traces"] for event in trace]
    del snapshot
    return {"error": error, "windows": metered_windows(events)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=["main_job", "zoo_fit", "streamed"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("metered_windows.py reads CUDA's allocation history: run it on a GPU")
    rows = {}
    for name in args.cases:
        rows[name] = run_case(name)
        print(name, json.dumps(rows[name], indent=1)[:4000], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metered_windows.json").write_text(json.dumps({"machine": machine_info(), "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
