"""Planned rematerialization: profile -> simulate -> solve -> apply, usable without Lightning."""

from lightning_tbp.remat.budget import MemoryBudget, format_bytes, parse_budget
from lightning_tbp.remat.plan import NothingToPlanWarning, Plan, ShapePlan, rematerialize
from lightning_tbp.remat.simulate import Option, Simulator
from lightning_tbp.remat.solve import InfeasibleBudgetError, Solver
from lightning_tbp.remat.trace import record_trace

__all__ = [
    "InfeasibleBudgetError",
    "MemoryBudget",
    "NothingToPlanWarning",
    "Option",
    "Plan",
    "ShapePlan",
    "Simulator",
    "Solver",
    "format_bytes",
    "parse_budget",
    "record_trace",
    "rematerialize",
]
