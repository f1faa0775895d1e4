"""remat: fit a PyTorch training step in a memory budget by optimal rematerialisation.

>>> model = remat.optimize(model, budget="2GiB")   # or budget=0.5 of the store-all peak
>>> loss = model(x, y); loss.backward()
"""

from remat import errors, memory, nn
from remat.api import backend, optimize, partitioner, plan
from remat.backends import RematBackend
from remat.config import configure
from remat.errors import (
    InfeasibleBudget,
    InvalidOption,
    NothingCompiled,
    RecompileLimitHit,
    RecurrentModules,
    RematError,
    SizeAboveMaximum,
    SolverOverBudget,
)
from remat.report import PlanReport
from remat.solvers import Budget, Plan
from remat.version import __version__ as __version__

__all__ = [
    "Budget",
    "InfeasibleBudget",
    "InvalidOption",
    "NothingCompiled",
    "Plan",
    "PlanReport",
    "RecompileLimitHit",
    "RecurrentModules",
    "RematBackend",
    "RematError",
    "SizeAboveMaximum",
    "SolverOverBudget",
    "backend",
    "configure",
    "errors",
    "memory",
    "nn",
    "optimize",
    "partitioner",
    "plan",
]
