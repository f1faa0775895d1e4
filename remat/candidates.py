"""Plans a graph is offered beside the solver's: the one the user's own checkpointing
makes, and a plan kept from smaller sizes (as it is, or repaired to fit). Each is a
``Plan`` of the graph's ``Problem``, so the planner weighs them like any other."""

from __future__ import annotations

import dataclasses

from remat.passes.extract import Extracted, user_recomputes
from remat.solvers import InvalidPlan, Plan, Problem, evaluate
from remat.solvers.heuristics import repaired

YOURS = "your checkpointing"  # the name of the plan the user's own checkpointing makes


def user_plan(extracted: Extracted, baseline: Plan) -> Plan | None:
    """The plan the user's own checkpointing makes, where the graph has checkpointed
    regions: everything store-all saves but what the regions recompute. A candidate for
    ``auto`` (kept where it fits and costs less than remat's) and, with its peak, what a
    fraction of a budget is of where that is below the store-all peak: budget 1.0 is at
    most the program as the user wrote it."""
    recomputed = user_recomputes(extracted)
    if not recomputed:
        return None
    try:
        return evaluate(extracted.problem, baseline.saved - recomputed, solver=YOURS)
    except InvalidPlan:  # a tag on a value that may not be recomputed: not a plan remat runs
        return None


def cheaper_and_fits(candidate: Plan | None, plan: Plan, limit: int) -> bool:
    return candidate is not None and candidate.peak <= limit and candidate.cost < plan.cost


def still_fitting(problem: Problem, kept: Plan | None, limit: int) -> Plan | None:
    """``kept`` (a plan of the same graph at smaller sizes) as a plan of ``problem``: as
    it is where it fits ``limit``, else repaired to fit (``heuristics.repaired``: a flip
    or a few, then polished), so sizes that grow cost milliseconds rather than a solve;
    None where there is none, or no repair fits."""
    if kept is None:
        return None
    name = kept.solver.removesuffix(" (kept)").removesuffix(" (repaired)")
    order = kept.schedule.backward if kept.ordered else None
    again = evaluate(problem, kept.saved, backward=order, solver=f"{name} (kept)", limit=limit)
    if again.peak <= limit:
        return again
    if kept.ordered:  # a chain schedule's order is not repaired flip by flip
        return None
    fixed = repaired(problem, evaluate(problem, kept.saved, solver=f"{name} (repaired)"), limit)
    return dataclasses.replace(fixed, limit=limit) if fixed.peak <= limit else None
