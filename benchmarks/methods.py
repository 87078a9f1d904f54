"""The ways to train a model that the benchmarks compare, as ``--modes`` strings.

Each mode installs itself on a model, hands back what the step should call, and uninstalls
itself, so one model instance (same weights) runs every mode in turn.

| spec | what it is |
| --- | --- |
| ``naive`` | plain autograd |
| ``diffusers`` | ``enable_gradient_checkpointing()``: every block diffusers can checkpoint |
| ``diffusers_every:K`` | the same API with a checkpointing function that checkpoints every K-th block call (K ≥ 2) |
| ``compile:B`` | ``torch.compile`` (Inductor) with ``activation_memory_budget = B`` ∈ (0, 1] |
| ``tbp:B`` | a lightning_tbp plan at ``memory_budget = B`` (a fraction, bytes, "6GiB") |
| ``tbp:lowest`` | a lightning_tbp plan at its lowest feasible budget |
| ``tbp:at:MODE`` | a lightning_tbp plan whose budget is the peak measured for ``MODE`` (listed before it) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from cases import Case
from common import measure_step
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_tbp import InfeasibleBudgetError, rematerialize
from lightning_tbp.remat import parse_budget

KINDS = ("naive", "diffusers", "diffusers_every", "compile", "tbp")


@dataclass(frozen=True)
class Mode:
    """One parsed ``--modes`` entry; ``spec`` is how it was written (and how results name it)."""

    spec: str
    kind: str
    value: object = None


@dataclass
class Installed:
    """A mode on a model: the callable the step runs, how to take it off, what it reports."""

    forward: Callable[..., Any]
    remove: Callable[[], None]
    info: dict[str, Any] = field(default_factory=dict)


def parse_mode(spec: str) -> Mode:
    """``"tbp:0.4"`` → Mode; raises ``ValueError`` naming what is wrong."""
    kind, _, value = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown mode {spec!r}: the kinds are {', '.join(KINDS)} (e.g. naive, tbp:0.4, compile:0.5)")
    if kind in ("naive", "diffusers"):
        if value:
            raise ValueError(f"mode {kind!r} takes no value, got {spec!r}")
        return Mode(spec, kind)
    if not value:
        raise ValueError(f"mode {kind!r} needs a value after ':', e.g. {kind}:{_EXAMPLE[kind]}")
    if kind == "diffusers_every":
        if not value.isdigit() or int(value) < 2:
            raise ValueError(f"diffusers_every:K needs an integer K >= 2, got {spec!r}")
        return Mode(spec, kind, int(value))
    if kind == "compile":
        try:
            budget = float(value)
        except ValueError:
            budget = -1.0
        if not 0 < budget <= 1:
            raise ValueError(f"compile:B needs an activation memory budget B in (0, 1], got {spec!r}")
        return Mode(spec, kind, budget)
    if value == "lowest":
        return Mode(spec, kind, "lowest")
    if value.startswith("at:"):
        parse_mode(value.removeprefix("at:"))  # the mode whose peak becomes the budget
        return Mode(spec, kind, value)
    parse_budget(value if not _is_number(value) else float(value))  # raises on a malformed budget
    return Mode(spec, kind, float(value) if _is_number(value) else value)


_EXAMPLE = {"diffusers_every": "2", "compile": "0.5", "tbp": "0.4"}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_modes(specs: list[str]) -> list[Mode]:
    modes = [parse_mode(s) for s in specs]
    if len({m.spec for m in modes}) != len(modes):
        raise ValueError(f"a mode is listed twice: {specs}")
    for index, mode in enumerate(modes):
        if isinstance(mode.value, str) and mode.value.startswith("at:"):
            other = mode.value.removeprefix("at:")
            if other not in specs[:index]:
                raise ValueError(f"{mode.spec} reads the peak of {other!r}, which must be listed before it")
    return modes


def install(mode: Mode, case: Case) -> Installed:
    """Put ``mode`` on the case's model (a plan is made for the case's call)."""
    model = case.model
    if mode.kind == "naive":
        return Installed(model, lambda: None)
    if mode.kind in ("diffusers", "diffusers_every"):
        func = None if mode.kind == "diffusers" else EveryKthCheckpoint(int(mode.value))
        model.enable_gradient_checkpointing(func)
        return Installed(model, model.disable_gradient_checkpointing)
    if mode.kind == "compile":
        return Installed(compile_with_budget(model, "inductor", float(mode.value)), reset_compile_budget)
    if isinstance(mode.value, str) and mode.value.startswith("at:"):
        raise ValueError(f"{mode.spec}: resolve the measured peak it refers to first (see at_measured_peak)")
    budget = lowest_feasible_budget(case) if mode.value == "lowest" else mode.value
    with case.autocast():
        plan = rematerialize(model, *case.args, memory_budget=budget, **case.kwargs)
    shape_plan = plan.current
    assert shape_plan is not None
    info = {
        "predicted_peak_bytes": shape_plan.predicted_peak_bytes,
        "budget_bytes": shape_plan.budget_bytes,  # the step's: what the device's total leaves it
        "memory_budget": budget,  # as given ("lowest" and "at:" resolved)
        "plan_seconds": shape_plan.profile_seconds + shape_plan.solve_seconds,
        "max_nesting": max(b.level for b in shape_plan.blocks),
        "decisions": {p: o.name.lower() for p, o in shape_plan.options.items()},
    }
    return Installed(model, plan.remove, info)


def at_measured_peak(mode: Mode, rows: list[dict[str, Any]], case: Case) -> Mode:
    """``tbp:at:diffusers`` → a tbp mode whose budget is the peak measured in the diffusers row:
    that step's peak, and the model's parameters beside it (a byte budget is the device's total)."""
    if not (isinstance(mode.value, str) and mode.value.startswith("at:")):
        return mode
    other = mode.value.removeprefix("at:")
    row = next((r for r in rows if r["mode"] == other), None)
    if row is None or "peak_bytes" not in row:
        raise ValueError(f"{mode.spec}: mode {other!r} has no measured peak ({(row or {}).get('error', 'not run')})")
    parameters = sum(p.numel() * p.element_size() for p in case.model.parameters())
    return Mode(mode.spec, mode.kind, row["peak_bytes"] + parameters)


def measure_mode(
    mode: Mode,
    case: Case,
    trials: int,
    reference: dict[str, torch.Tensor],
    warmup: int = 1,
    earlier_rows: list[dict[str, Any]] = (),
) -> dict[str, Any]:
    """One row: ``mode``'s measured step on ``case`` and what the mode reports, or its ``error``.

    A mode that cannot run (out of memory, no feasible plan, a ``tbp:at:`` reference that
    failed) is a result too; the caller goes on with the next. ``earlier_rows``: the results
    ``tbp:at:MODE`` reads its budget from."""
    row: dict[str, Any] = {"mode": mode.spec, "kind": mode.kind}
    try:
        installed = install(at_measured_peak(mode, earlier_rows, case), case)
        try:
            measured = measure_step(case.model, lambda: case.step(installed.forward), trials, reference, warmup=warmup)
        finally:
            installed.remove()
    except Exception as error:
        if case.device.type == "cuda":
            torch.cuda.empty_cache()
        return row | {"error": f"{type(error).__name__}: {error}"}
    return row | measured.as_dict() | installed.info


def lowest_feasible_budget(case: Case) -> int:
    """The minimum feasible budget in bytes, as the planner names it when asked for 1 byte."""
    try:
        with case.autocast():
            rematerialize(case.model, *case.args, memory_budget=1, **case.kwargs).remove()
    except InfeasibleBudgetError as error:
        return error.minimum_budget_bytes
    return 1


class EveryKthCheckpoint:
    """A diffusers ``gradient_checkpointing_func`` that checkpoints every K-th block it is handed.

    Blocks are numbered in the order of the first forward, so the same blocks are checkpointed
    on every step (a plain call counter would drift when the number of calls is not a multiple
    of K)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.order: dict[int, int] = {}

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        index = self.order.setdefault(id(module), len(self.order))
        if index % self.k:
            return module(*args)
        return checkpoint(module.__call__, *args, use_reentrant=False)


def compile_with_budget(model: nn.Module, backend: str, budget: float) -> Callable:
    """``torch.compile`` under ``activation_memory_budget``.

    "inductor" is what users run. "aot_eager_min_cut" keeps AOTAutograd's min-cut partitioner (the
    part that honours the budget) but runs eager kernels, so its memory effect can be seen with
    exact gradients: on this CPU, torch 2.13's Inductor backward differs from eager (see the
    ``grad_max_rel_diff`` column).
    """
    import torch._functorch.config as functorch_config
    from functorch.compile import min_cut_rematerialization_partition, nop
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget
    if backend == "inductor":
        return torch.compile(model)
    return torch.compile(
        model, backend=aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition)
    )


def reset_compile_budget() -> None:
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = 1.0
    torch._dynamo.reset()
