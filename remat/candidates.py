"""Plans a graph is offered beside the solver's: the one the user's own checkpointing
makes, torch's own partition, a plan kept from smaller sizes (as it is, or repaired to
fit), and the plans made for the same graph under smaller budgets. Each is a ``Plan`` of
the graph's ``Problem`` (or its saved set), so the planner weighs them like any other."""

from __future__ import annotations

import dataclasses

from torch import fx

from remat.cache import PlanCache
from remat.passes.extract import Extracted, user_recomputes
from remat.passes.min_cut import torch_saved
from remat.solvers import InvalidPlan, Plan, Problem, evaluate
from remat.solvers.heuristics import repaired
from remat.solvers.solve import REPEATED_MIN_NODES

YOURS = "your checkpointing"  # the name of the plan the user's own checkpointing makes
TORCH_CANDIDATE = "torch-min-cut"  # the name a plan taken from torch's partition carries
MADE_KEPT = 8  # plans kept per graph (``made_under``): the budgets a sweep asks, and more
MADE_GRAPHS = 64  # graphs whose plans are kept, the latest planned

# graph key -> limit -> (solver, saved set) of the plan made under it, in this process
_made: dict[str, dict[int, tuple[str, frozenset[int]]]] = {}


def remember(key: str, limit: int, plan: Plan) -> None:
    """Keep the saved set a graph was planned with under ``limit``: a candidate for every
    larger budget (``made_under``)."""
    made = _made.pop(key, {})
    _made[key] = made  # the latest planned graph last
    made[limit] = (plan.solver, plan.saved)
    while len(made) > MADE_KEPT:
        del made[min(made)]
    while len(_made) > MADE_GRAPHS:
        del _made[next(iter(_made))]


def made_under(key: str, limit: int) -> dict[str, frozenset[int]]:
    """The saved sets planned for the graph under smaller budgets than ``limit``, by name:
    a plan that fits a smaller budget fits this one, so offering it keeps a larger budget
    from being planned slower than a smaller one (docs/cost-model.md, "Monotone in the
    budget")."""
    return {
        f"{solver}, as under {smaller} B": saved
        for smaller, (solver, saved) in _made.get(key, {}).items()
        if smaller < limit
    }


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


def fraction_reference(store_all: Plan, yours: Plan | None, theirs: Plan | None) -> Plan:
    """The plan a fraction of the budget is of: the lowest peak of store-all, the user's
    checkpointing and torch's partition (None where not made), store-all where tied."""
    return min((p for p in (store_all, yours, theirs) if p is not None), key=lambda p: p.peak)


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


def torch_partition(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    extracted: Extracted,
    cache: PlanCache | None,
    before: Plan | None = None,
) -> Plan | None:
    """torch's own partition of ``joint`` (``min_cut_rematerialization_partition``, what
    ``torch.compile`` runs) as a plan of the graph's problem, on graphs below
    ``REPEATED_MIN_NODES`` (above, it takes longer than remat's plan: docs/benchmarks.md,
    "Planning at LLM depth"), from ``cache`` where a process stored it; at larger sizes of
    a symbolic graph, the saved set it had at the earlier ones (``before``). A candidate
    for ``auto``, and with its peak what a fraction of a budget is of where that is lower:
    budget 1.0 is then at most what ``torch.compile`` holds."""
    if before is not None:
        return evaluate(extracted.problem, before.saved, solver=before.solver)
    if len(extracted.problem) >= REPEATED_MIN_NODES:
        return None

    def partition() -> dict[str, frozenset[int]]:
        saved = torch_saved(joint, num_fwd_outputs, extracted)
        return {} if saved is None else {TORCH_CANDIDATE: saved}

    found = partition() if cache is None else cache.candidates(joint, num_fwd_outputs, partition)
    if TORCH_CANDIDATE not in found:
        return None
    try:
        return evaluate(extracted.problem, found[TORCH_CANDIDATE], solver=TORCH_CANDIDATE)
    except InvalidPlan:  # a saved set remat's programs cannot run: not a candidate
        return None


def offered(
    yours: Plan | None, theirs: Plan | None, made: dict[str, frozenset[int]]
) -> dict[str, frozenset[int]]:
    """What the ``auto`` solver is offered: the plan of the user's own checkpointing
    (``yours``), torch's partition (``theirs``, ``torch_partition``) and the plans
    ``made`` for the graph under smaller budgets (``made_under``)."""
    found = dict(made)
    for plan in (yours, theirs):
        if plan is not None:
            found[plan.solver] = plan.saved
    return found


def forget_made() -> None:
    """Forget the plans made in this process (``remember``), as a new process would."""
    _made.clear()
