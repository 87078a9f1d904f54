"""Memory budgets: what users may write, and how it becomes a number of bytes.

Accepted forms (anything else raises ``ValueError`` listing them):

* a float in (0, 1]: that fraction of the module's naive peak (forward + backward without any
  checkpoint, measured above the memory held before the forward; the loss computed from the
  module's outputs counts once a metered step has measured it, see ``verify.StepMeter``);
* an int: bytes;
* a string with a unit, "6GiB", "512MiB", "1.5GB", "300kB" (binary units are powers of 1024,
  decimal ones powers of 1000). Bytes are always the device's total: what training holds on it
  outside the step (``HeldMemory``: the parameters, the optimizer state, DDP's buckets; for
  ``rematerialize``, the module's parameters and the state of the optimizers it is given) comes
  off first, and the step is planned in the rest;
* "auto": on CUDA, the device's free memory at planning time minus a margin of
  ``AUTO_CUDA_MARGIN`` of its total memory (room for allocator fragmentation and the loss) and,
  under a strategy, minus the optimizer state that the first step will create; on other
  devices ``AUTO_DEFAULT_FRACTION`` of the naive peak, since host memory gives no useful bound;
  a model that cannot reach that fraction is planned at its minimum feasible budget, with a
  warning.

Whatever the form, the planner plans for ``1 - PLANNING_MARGIN`` of it (``solve.py``): the
unplanned step too is only kept when it fits there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from lightning_tbp.memory.held import HeldMemory

AUTO_CUDA_MARGIN = 0.10
AUTO_DEFAULT_FRACTION = 0.5
ACCEPTED_FORMS = (
    "a float in (0, 1] (fraction of the naive peak; as a string too, '0.4'), an int number of bytes, "
    "a string such as '6GiB', '512MiB' or '1.5GB', or 'auto'"
)
_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")
_FRACTION = re.compile(r"^\s*(?:0?\.\d+|1(?:\.0*)?)\s*$")


@dataclass(frozen=True)
class MemoryBudget:
    """A parsed budget; :meth:`resolve` turns it into bytes for one traced shape."""

    kind: str  # "fraction", "bytes" or "auto"
    value: float = 0.0

    def resolve(self, naive_peak_bytes: int, device: torch.device, held: HeldMemory | None = None) -> int:
        """Bytes the step may peak at. With ``held`` (what training keeps on the device outside
        the step), a byte budget is the device's total: the held bytes come off it; "auto" on
        CUDA leaves room for the optimizer state still to come (the rest is already not free).
        A fraction is of the step's own naive peak and ignores ``held``."""
        held = held or HeldMemory()
        if self.kind == "bytes":
            return int(self.value) - held.total
        if self.kind == "fraction":
            return int(self.value * naive_peak_bytes)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return max(0, int(free - AUTO_CUDA_MARGIN * total) - held.optimizer_state_pending)
        return int(AUTO_DEFAULT_FRACTION * naive_peak_bytes)

    def is_fraction_default(self, device: torch.device) -> bool:
        """Whether this is "auto" on a device without a memory limit to fit (a default fraction).

        There the fraction is only a default, so a model that cannot reach it is planned at its
        minimum feasible budget instead (with a warning); on CUDA "auto" is the free memory, a
        hard limit, and an infeasible one raises like any explicit budget.
        """
        return self.kind == "auto" and device.type != "cuda"

    def describe_resolved(self, device: torch.device) -> str:
        if self.is_fraction_default(device):
            return f"{AUTO_DEFAULT_FRACTION:g} of naive"
        return self.describe()

    def describe(self) -> str:
        if self.kind == "fraction":
            return f"{self.value:g} of naive"
        if self.kind == "bytes":
            return format_bytes(int(self.value))
        return "auto"


#: What a caller may pass as ``memory_budget``: bytes (int), a fraction of the naive peak (float),
#: a size or "auto" (str: ``ACCEPTED_FORMS``), or a parsed budget.
BudgetSpec = int | float | str | MemoryBudget


def parse_budget(spec: object) -> MemoryBudget:
    """Parse a user-facing budget; raise ``ValueError`` naming the accepted forms."""
    if isinstance(spec, MemoryBudget):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"memory_budget={spec!r} is not valid; use {ACCEPTED_FORMS}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"memory_budget={spec} bytes must be positive; use {ACCEPTED_FORMS}")
        return MemoryBudget("bytes", spec)
    if isinstance(spec, float):
        if not 0.0 < spec <= 1.0:
            raise ValueError(f"memory_budget={spec} as a fraction must lie in (0, 1]; use {ACCEPTED_FORMS}")
        return MemoryBudget("fraction", spec)
    if isinstance(spec, str):
        if spec.strip().lower() == "auto":
            return MemoryBudget("auto")
        if _FRACTION.match(spec):  # from a command line: a fraction, as the float would be
            return parse_budget(float(spec))
        match = _PATTERN.match(spec)
        if match and match.group(2).lower() in _UNITS:
            value = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if value > 0:
                return MemoryBudget("bytes", int(value))
    raise ValueError(f"memory_budget={spec!r} is not valid; use {ACCEPTED_FORMS}")


def device_level_ratio(measured_bytes: int, reference_bytes: int, streamed_bytes: int) -> float:
    """``measured_bytes`` over ``reference_bytes`` (a prediction, a budget), both counted above
    what stays on the device outside the step, as device levels: against the parameters as
    loaded, a plan that streams ``streamed_bytes`` of weights can peak below zero, so those
    bytes come back in on both sides."""
    return (measured_bytes + streamed_bytes) / max(reference_bytes + streamed_bytes, 1)


def format_level(step_bytes: int, streamed_bytes: int) -> str:
    """A step's bytes as reports give them: above what stays on the device outside the step.
    Counted against the parameters as loaded, a plan that streams ``streamed_bytes`` of frozen
    weights from the host reads them below zero (a Flux LoRA's step on a card smaller than its
    weights); those bytes are added back, as :func:`device_level_ratio` adds them."""
    return format_bytes(step_bytes + streamed_bytes)


def format_room(budget_bytes: int) -> str:
    """What a device budget leaves a step beside what training holds: bytes, or none and how
    many short (the frozen weights must then leave the device)."""
    return format_bytes(budget_bytes) if budget_bytes >= 0 else f"nothing ({format_bytes(-budget_bytes)} short)"


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
