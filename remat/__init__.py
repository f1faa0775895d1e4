"""remat: fit a PyTorch training step in a memory budget by optimal rematerialisation.

>>> model = remat.optimize(model, budget="2GiB")   # or budget=0.5 of the store-all peak
>>> loss = model(x, y); loss.backward()
"""

from remat import memory
from remat.api import (
    NothingCompiled,
    PlanReport,
    RecompileLimitHit,
    RematBackend,
    backend,
    optimize,
    partitioner,
    plan,
)
from remat.solvers import InfeasibleBudget, Plan

__all__ = [
    "InfeasibleBudget",
    "NothingCompiled",
    "Plan",
    "PlanReport",
    "RecompileLimitHit",
    "RematBackend",
    "backend",
    "memory",
    "optimize",
    "partitioner",
    "plan",
]
__version__ = "0.1.0"
