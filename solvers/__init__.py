"""Pure planning core of remat: problems, plans, the schedule, the simulator, the solvers.

Imports nothing from torch, so it is fast to test on thousands of random graphs
and reusable outside PyTorch.
"""

from .budget import Budget, BudgetLike
from .errors import InfeasibleBudget, InvalidOption, RematError, SolverOverBudget
from .heuristics import greedy, recompute_all, store_all
from .plan import Plan, evaluate, held_bytes, saved_bytes, step_seconds
from .problem import Node, Problem
from .proof import prove
from .schedule import InvalidPlan, Schedule, schedule
from .simulate import Timeline, simulate
from .solve import SOLVERS, lowest_budget, min_peak_plan, solve, solver_for
from .units import format_apart, format_bytes

__all__ = [
    "SOLVERS",
    "Budget",
    "BudgetLike",
    "InfeasibleBudget",
    "InvalidOption",
    "InvalidPlan",
    "Node",
    "Plan",
    "Problem",
    "Schedule",
    "Timeline",
    "evaluate",
    "format_apart",
    "format_bytes",
    "greedy",
    "held_bytes",
    "lowest_budget",
    "min_peak_plan",
    "prove",
    "recompute_all",
    "RematError",
    "saved_bytes",
    "schedule",
    "simulate",
    "solve",
    "solver_for",
    "step_seconds",
    "SolverOverBudget",
    "store_all",
]
