"""A recorded step planned as one: its runs composed into one problem (``solvers.step``),
solved against the budget, and split back into a program per run (``StepPlan``)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from remat.agree import planning_solver
from remat.as_given import below_eager, eager_peak, stored_phases
from remat.cache import PlanCache
from remat.passes._torch_compat import backward_holds_tangents
from remat.passes.sizes import Binding, larger
from remat.runtime.handed import keeping, own_order
from remat.runtime.recording import Recording, Run
from remat.solvers import InfeasibleBudget, Plan, evaluate, lowest_budget, solve, store_all
from remat.solvers.budget import Budget
from remat.solvers.heuristics import repaired
from remat.solvers.solve import Solver
from remat.solvers.step import (
    Composed,
    Step,
    compose,
    joint_order,
    joint_saved,
    split,
    split_orders,
)

log = logging.getLogger("remat")


@dataclass(frozen=True)
class StepPlan:
    """The joint plan of a recorded step: per run, its graph and program."""

    graphs: tuple[str, ...]  # per run, in forward order
    programs: tuple[int, ...]  # per run, the index into its graph's programs
    composed: Composed
    plan: Plan  # of ``composed.problem``
    first_peak: int  # what the recorded (first) step's plans peak at, predicted
    limit: int  # the budget in bytes for this step
    store_all_peak: int  # of ``composed.problem``: what a fraction of a budget is of
    # per run, the sizes its graph's problem was read at: its programs fit the budget at
    # every size no larger (``passes.sizes.covers``); empty where sizes are static
    bindings: tuple[Binding, ...] = ()
    # per run, the largest sizes a step it planned ran at, where the code between the runs
    # was measured (no larger than ``bindings``: a declared maximum is planned for before
    # it runs): the plan serves every step whose runs are no larger than these
    measured: tuple[Binding, ...] = ()

    @property
    def runs(self) -> int:
        return len(self.graphs)


def plan_step(
    step: Recording,
    budget: Budget,
    solver: str | Solver,
    cache: PlanCache | None,
    release: bool = True,
    grown: StepPlan | None = None,
) -> StepPlan:
    """The joint plan of the recorded ``step`` under ``budget``, its limit resolved once against the
    composed problem's store-all peak; with ``release``, counting the outputs its caller dropped
    before the backwards as freed there (``Step.released``). A step of one run whose compile-time
    plan already fits keeps it, unless that plan left room for code outside
    (``first_step.outside_reserve``, ``widest_room``): now measured; so does a step recorded because
    its sizes grew past ``grown`` (the joint plan of the same runs at smaller sizes), with
    ``grown``'s programs where they still fit, else its runs' own: sizes that grow cost a solve only
    where neither fits. ``InfeasibleBudget`` in the step's terms where nothing fits."""
    runs = step.runs
    composed, released = _composed(step, release)
    names = ", ".join(r.graph.name for r in runs)
    used = tuple(r.graph.programs[r.program].plan for r in runs)
    first = _as_run(composed, used, "compile-time")
    log.info("remat: first step of (%s) predicted at %d bytes", names, first.peak)
    stored = store_all(composed.problem)
    store_all_peak = stored.peak
    eager = _as_given(composed, runs, stored)
    reference = _reference(composed, runs, store_all_peak, eager)
    agree = not any(r.graph.sizes for r in runs)  # (``agree.planning_solver``)
    if budget.lowest:
        limit = lowest_budget(composed.problem, planning_solver(solver, cache, agree))
    else:
        limit = budget.resolve(reference)
    kept = _kept_after_growth(composed, runs, grown, first, limit) if grown else None
    if kept is not None:
        plan, programs = kept
        log.info("remat: step (%s) keeps its plan at larger sizes: %s", names, plan)
    elif len(runs) == 1 and first.peak <= limit and not _left_room(runs[0].graph.record):
        compiled = runs[0].graph.programs[runs[0].program].plan
        plan = _kept(first, compiled, limit)
        programs = (runs[0].program,)
    else:
        try:
            plan = solve(composed.problem, limit, planning_solver(solver, cache, agree))
        except InfeasibleBudget as refusal:
            refused = _in_step_terms(refusal, runs, reference)
            if eager is not None and eager <= reference:
                refused = below_eager(refused, eager)
            raise refused from None
        programs = _programs(composed, plan, runs)
        if released:
            # a run's program still hands a held output its backward reads over to
            # it: the step's plan is what the programs run, checked against the limit
            ran = tuple(r.graph.programs[k].plan for r, k in zip(runs, programs, strict=True))
            again = _as_run(composed, ran, plan.solver)
            if again.peak > limit:
                return plan_step(step, budget, solver, cache, release=False)
            plan = dataclasses.replace(again, status=plan.status, bound=plan.bound)
        log.info("remat: step (%s) planned as one: %s", names, plan)
    signature = tuple(r.graph.name for r in runs)
    bindings = tuple(dict(r.graph.binding) for r in runs)
    return StepPlan(
        signature, programs, composed, plan, first.peak, limit, store_all_peak, bindings,
        _measured_at(runs, grown),
    )  # fmt: skip


def _measured_at(runs: list[Run], grown: StepPlan | None) -> tuple[Binding, ...]:
    """Per run, the sizes the step's plan is known to serve: the run's own, and those of
    the plan it grew from (``StepPlan.measured``). Not its graph's binding, which may be
    larger (a declared maximum): what code outside the graphs holds is measured, not
    derived, so a step larger than any measured is recorded again and its plan checked
    (kept where it fits: ``_kept_after_growth``)."""
    if grown is None:
        return tuple(dict(r.binding) for r in runs)
    pairs = zip(runs, grown.measured, strict=True)
    return tuple(larger(r.binding, before) for r, before in pairs)


def _left_room(record) -> bool:
    """Whether a graph's compile-time plan kept room for code outside it."""
    return bool(record.reserve) or record.room is not None


def _reference(composed: Composed, runs: list[Run], store_all_peak: int, eager: int | None) -> int:
    """What a fraction of the budget is of: the store-all peak, or where it peaks lower the
    step as the user wrote it (their own checkpointing, ``candidates.user_plan``; ``eager``,
    the step with the module's eager step in its only run's place: ``_as_given``) or as
    torch partitions it (``candidates.torch_partition``), each run's graph so planned."""
    peaks = [store_all_peak]
    if eager is not None:
        peaks.append(eager)
    for name in ("yours", "theirs"):
        if any(getattr(r.graph.record, name) for r in runs):
            plans = tuple(getattr(r.graph.record, name) or r.graph.record.store_all for r in runs)
            peaks.append(_as_run(composed, plans, name).peak)
    return min(peaks)


def _as_given(composed: Composed, runs: list[Run], stored: Plan) -> int | None:
    """The step's peak with the module run eagerly (``as_given.eager_peak``), from
    ``stored``, the step storing everything, where the step is one run of a graph that is
    the module's whole forward, its eager step run under fake tensors at its sizes; else
    None."""
    record = runs[0].graph.record
    if len(runs) != 1 or record.as_given is None:
        return None
    problem = record.extracted.problem
    where = composed.index[0]
    forward = {where[i] for i, node in enumerate(problem.nodes) if node.phase == "fwd"}
    backward = set(where) - forward
    graph = stored_phases(problem, record.store_all)
    return eager_peak(stored.timeline, forward, backward, graph, record.as_given)


def _kept_after_growth(
    composed: Composed, runs: list[Run], grown: StepPlan, first: Plan, limit: int
) -> tuple[Plan, tuple[int, ...]] | None:
    """The plan of a step whose sizes grew past ``grown``: ``grown``'s programs where they
    still fit ``limit``, else those its runs ran (``first``), else ``grown``'s plan
    repaired to fit (``heuristics.repaired``); None where none fits."""
    ran = tuple(r.program for r in runs)
    name = grown.plan.solver.removesuffix(" (kept)").removesuffix(" (repaired)")
    candidates = ((grown.programs, f"{name} (kept)"), (ran, f"{first.solver} (kept)"))
    for programs, solver in candidates:
        plans = tuple(r.graph.programs[k].plan for r, k in zip(runs, programs, strict=True))
        again = _as_run(composed, plans, solver)
        if again.peak <= limit:
            return dataclasses.replace(again, limit=limit), programs
    plans = tuple(r.graph.programs[k].plan for r, k in zip(runs, grown.programs, strict=True))
    start = _as_run(composed, plans, f"{name} (repaired)")
    if start.ordered:  # a chain schedule's order is not repaired flip by flip
        return None
    fixed = repaired(composed.problem, start, limit)
    if fixed.peak > limit:
        return None
    programs = _programs(composed, fixed, runs)
    plans = tuple(r.graph.programs[k].plan for r, k in zip(runs, programs, strict=True))
    again = _as_run(composed, plans, fixed.solver)  # what the programs run, checked
    return (dataclasses.replace(again, limit=limit), programs) if again.peak <= limit else None


def _composed(step: Recording, release: bool) -> tuple[Composed, tuple]:
    """The recorded runs laid out as one problem, with the outputs released early."""
    runs = step.runs
    outside, released, freed = step.outside_memory(release)
    problems = tuple(
        keeping(r.graph.problem, freed.get(k, frozenset()) | _held_tangents(r))
        for k, r in enumerate(runs)
    )
    order = tuple(step.backward_order)
    accumulate = _accumulate(runs, order)
    shape = Step(problems, order, tuple(step.links), accumulate, outside, released)
    names = ", ".join(r.graph.name for r in runs)
    return compose(shape, name=f"step ({names})"), released


def _held_tangents(run: Run) -> frozenset[int]:
    """The tangent nodes of ``run`` where its backward holds them until it returns
    (``backward_holds_tangents``): its graph's problem keeps them to its end, which in a
    step is the end of that backward, not of the step."""
    if not backward_holds_tangents():
        return frozenset()
    return frozenset(node for _arg, node in run.graph.programs[run.program].tangents)


def _programs(composed: Composed, plan: Plan, runs: list[Run]) -> tuple[int, ...]:
    """Per run, the index of the program running its share of the joint ``plan``."""
    saved = split(composed, plan)
    orders = (
        tuple(
            own_order(o, r.graph.problem)
            for o, r in zip(split_orders(composed, plan), runs, strict=True)
        )
        if plan.ordered
        else (None,) * len(runs)
    )
    return tuple(
        r.graph.program_for(evaluate(r.graph.problem, s, backward=o, solver=plan.solver))
        for r, s, o in zip(runs, saved, orders, strict=True)
    )


def _as_run(composed: Composed, plans: tuple[Plan, ...], solver: str) -> Plan:
    """The plan of ``composed`` that runs each run's own ``plans[r]``."""
    saved = joint_saved(composed, tuple(p.saved for p in plans))
    order = joint_order(composed, plans) if any(p.ordered for p in plans) else None
    return evaluate(composed.problem, saved, backward=order, solver=solver)


def _kept(first: Plan, compiled: Plan, limit: int) -> Plan:
    """A one-run step keeping the plan its graph was compiled with. Its status and bound
    carry over when the step's limit is within the graph's: outside memory only adds to
    a peak, so every plan that fits the step fit the graph."""
    if compiled.limit is not None and limit <= compiled.limit:
        return dataclasses.replace(
            first, solver=compiled.solver, status=compiled.status, bound=compiled.bound
        )
    return dataclasses.replace(first, solver=f"{compiled.solver} (compile-time)")


def _accumulate(runs: list[Run], order: tuple[int, ...]) -> tuple[int, ...]:
    """Per run: the largest parameter it shares with a run whose backward ran before its
    own (autograd sums the two gradients into a new tensor before freeing the old)."""
    out = [0] * len(runs)
    seen: set = set()
    for position in order:
        leaves = {leaf for leaf in runs[position].graph.record.leaves if leaf is not None}
        out[position] = max((b for ident, b in leaves if (ident, b) in seen), default=0)
        seen |= leaves
    return tuple(out)


def _in_step_terms(refusal: InfeasibleBudget, runs: list[Run], reference: int) -> InfeasibleBudget:
    names = ", ".join(r.graph.name for r in runs)
    note = (
        ""
        if len(runs) == 1
        else f"The step runs {len(runs)} graphs ({names}), planned together: the minimum is "
        "the whole step's."
    )
    r = refusal
    where = f"step ({names})"
    return InfeasibleBudget(
        r.limit, r.minimum, r.store_all, where, r.proven, note=note,
        lowest_proven=r.lowest_proven, reference=reference,
    )  # fmt: skip
