"""A plan's bound made tighter, at a price in seconds: the MIP of the pointed relaxation.

``cpsat`` and ``repeated`` prove their gaps with linear relaxations, in seconds. Where
the optimum trades whole large values (a knapsack: one more attention projection saved
for a few small values), an LP saves a fraction of one and its bound sits up to that
value's cost under the optimum; on a deep model one projection is about 1% of the plan
(docs/solver-notes.md, "Known gaps"). ``prove`` solves the same relaxation, with the
backward steps where the LP's rounded answer overflows made exact (``cpsat``'s points),
with its Booleans integral (``linear_bound.solve_mip``): every plan satisfies it, so
its optimum is a bound, and integrality is what the LP missed. Seconds to minutes: a
certificate asked for, not part of planning.
"""

from __future__ import annotations

import logging
import time

from .exact import add_points
from .linear_bound import solve_lp, solve_mip
from .plan import Plan, evaluate, with_bound
from .problem import Problem
from .relaxation import Relaxation

log = logging.getLogger("remat")

# Exact points added per round, where the answer overflows most: each grows the MIP, and
# a second lifted no bound (docs/solver-notes.md, "MIP bounds").
POINTS = 1
# HiGHS stops a MIP within this relative gap of its own optimum (its ``mip_rel_gap``), so
# a bound this close to the plan is as close as another round can prove.
CLOSE = 1e-4


def prove(problem: Problem, plan: Plan, seconds: float = 60.0) -> Plan:
    """``plan`` with the higher of its own bound and the MIP's, found in at most about
    ``seconds`` of wall time (the LP before it included; HiGHS's dual bound where it
    stops early, still a bound). Rounds, as ``cpsat``'s relaxation makes them: where the
    MIP's optimum overflows the simulator, the steps where it does are made exact and
    the MIP solved again; where its optimum fits, that is a plan too, returned if it is
    cheaper (the MIP's rounds are an exact solver, slow: see docs/solver-notes.md). ``plan``
    must fit its limit (``Plan.limit``) and recompute each value at most once (the plans
    the relaxation describes)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    if plan.limit is None or plan.peak > plan.limit:
        raise ValueError("prove needs a plan that fits its budget (a solver's answer)")
    if plan.multiple:
        raise ValueError(
            "prove bounds plans that recompute each value once; this plan recomputes some "
            "more than once (sqrt, revolve), and may be cheaper than that bound"
        )
    start, limit = time.perf_counter(), plan.limit
    relax = Relaxation(problem, limit, exact=False)
    lp = solve_lp(relax.model, seconds)
    before = bound = plan.bound or 0.0
    rounds = 0
    answer = None if lp is None else evaluate(problem, relax.saved_set(lp.value), solver="prove")
    if lp is not None:
        bound = max(bound, lp.bound / relax.scale)
    while answer is not None and answer.peak > limit and add_points(relax, answer, POINTS):
        left = seconds - (time.perf_counter() - start)
        mip = solve_mip(relax.model, left) if left > 0 else None
        if mip is None:
            break
        rounds += 1
        bound = max(bound, mip.bound / relax.scale)
        log.info(
            "remat %s: MIP round %d: bound %.6g, %.2f%% under the plan (%.1fs)",
            problem.name or "graph",
            rounds,
            bound,
            100 * (plan.cost - bound) / plan.cost if plan.cost else 0.0,
            time.perf_counter() - start,
        )
        if not mip.closed or not mip.values or plan.cost - bound <= CLOSE * plan.cost:
            break
        answer = evaluate(problem, relax.saved_set(mip.value), solver="prove")
    if answer is not None and answer.peak <= limit and answer.cost < plan.cost:
        plan = answer  # the MIP's optimum fits: a cheaper plan, proven with its bound
    log.info(
        "remat %s: bound %.6g -> %.6g (%d MIP round%s of the pointed relaxation, %.1fs)",
        problem.name or "graph",
        before,
        bound,
        rounds,
        "" if rounds == 1 else "s",
        time.perf_counter() - start,
    )
    spent = time.perf_counter() - start if plan.solver == "prove" else plan.solve_seconds
    return with_bound(plan, bound, solver=plan.solver, limit=limit, seconds=spent)
