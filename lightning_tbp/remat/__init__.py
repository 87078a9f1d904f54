"""Planned rematerialization: profile -> simulate -> solve -> apply, usable without Lightning."""

from lightning_tbp.remat.budget import MemoryBudget, format_bytes, parse_budget
from lightning_tbp.remat.options import Option
from lightning_tbp.remat.plan import NothingToPlanWarning, Plan, ShapePlan, rematerialize
from lightning_tbp.remat.pricing import priced_by_flops
from lightning_tbp.remat.record import record_trace
from lightning_tbp.remat.simulate import Simulator
from lightning_tbp.remat.solve import InfeasibleBudgetError, Solver, StallingPlanError
from lightning_tbp.remat.verify import Verification

__all__ = [
    "InfeasibleBudgetError",
    "MemoryBudget",
    "NothingToPlanWarning",
    "Option",
    "Plan",
    "ShapePlan",
    "Simulator",
    "Solver",
    "StallingPlanError",
    "Verification",
    "format_bytes",
    "parse_budget",
    "priced_by_flops",
    "record_trace",
    "rematerialize",
]
