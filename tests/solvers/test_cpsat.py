"""Properties of the CP-SAT solver (``cpsat.py``) and its model (``relaxation.py``).

The model's claims, checked on random problems and random saved sets:

- every plan's canonical assignment satisfies the model (exact, and the linear
  relaxation ``exact=False``) at a budget of the plan's own simulated peak, with
  the plan's recompute cost as objective: costs are floored to integer units of
  ``1 / scale`` (the costliest relevant node is ``COST_RESOLUTION`` units), so the
  objective is never above the cost and below it by under one unit per recomputed node;
- the backward memory is exact: a plan whose peak is in the backward (above its
  forward peak) is infeasible in the exact model one byte under that peak;
- saving a free view is the same plan as saving its root (the model's reduction).

The solver's claims: valid plans that fit the budget, an honest bound, never
worse than the greedy, deterministic, a refusal only when no plan fits, and on
tiny problems (at most ``EXHAUSTIVE_MAX`` savable values) "optimal" means the
minimum over every saved set, found by exhaustive search.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, example, given, note, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from synthetic import chain, layered, random_joint
from test_properties import (
    SETTINGS,
    any_problem,
    check_plan,
    joint_graphs,
    minimum_peak,
    problems,
    savable_subsets,
)

from remat.solvers import (
    InfeasibleBudget,
    InvalidPlan,
    Node,
    Plan,
    Problem,
    evaluate,
    greedy,
    solve,
    store_all,
)
from remat.solvers.cpsat import cpsat, default_time_limit
from remat.solvers.cuts import explain
from remat.solvers.exact import add_point
from remat.solvers.heuristics import savable
from remat.solvers.relaxation import (
    COST_RESOLUTION,
    Relaxation,
    free_views,
    without_free_views,
)

FILTERING = dict(
    SETTINGS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
HERE = Path(__file__).resolve().parent  # where ``synthetic`` is, for fresh processes
EXHAUSTIVE_MAX = 12  # savable values: 2**12 saved sets at most
REL = 1e-6


def tol(x: float) -> float:
    """Float noise on a cost."""
    return 1e-9 * max(1.0, abs(x))


def resolution(problem: Problem) -> float:
    """An upper bound on one objective unit, ``1 / scale``, in cost."""
    fwd = [n for n in problem.nodes if n.phase == "fwd"]
    return max((max(n.cost, n.save_cost) for n in fwd), default=0.0) / COST_RESOLUTION


def floor_slack(problem: Problem, plan: Plan) -> float:
    """How far below the true cost flooring may put a bound: one unit per recomputed node
    and per saved storage."""
    terms = len(plan.recomputed) + len(plan.saved)
    return terms * resolution(problem) + tol(plan.cost)


def size_bucket(problem: Problem) -> str:
    n = len(problem.forward_nodes)
    return "<=30" if n <= 30 else "<=100" if n <= 100 else ">100"


def time_limit_for(problem: Problem) -> float:
    """Deterministic seconds: enough to prove small problems, short on big ones."""
    n = len(problem.forward_nodes)
    return 1.0 if n <= 30 else 0.3 if n <= 100 else 0.1


# ----------------------------------------------------------------------------- problems


@st.composite
def sized_joint_graphs(draw, low: int, high: int) -> Problem:
    """``random_joint`` with at least ``low`` forward nodes (hypothesis favours tiny ones)."""
    return random_joint(
        draw(st.integers(low, high)),
        draw(st.integers(0, 2**32 - 1)),
        max_inputs=draw(st.integers(1, 4)),
        p_view=draw(st.sampled_from([0.0, 0.1, 0.3])),
        p_random=draw(st.sampled_from([0.0, 0.05, 0.3])),
        p_multi=draw(st.sampled_from([0.0, 0.05, 0.2])),
    )


def solver_problems(high: int = 200):
    """Any problem, a good share of them with over 30 forward nodes."""
    return st.one_of(any_problem(high), sized_joint_graphs(31, high))


def tiny_problems():
    """Mostly problems with at most ``EXHAUSTIVE_MAX`` savable values (tests assume it)."""
    return st.one_of(problems(max_steps=12), joint_graphs(max_forward=11))


# ----------------------------------------------------------------------------- helpers


def solve_fixed(problem: Problem, plan: Plan, budget: int, *, exact: bool = True, points=()):
    """Fix every variable the canonical assignment names and solve for the rest."""
    relax = Relaxation(problem, budget, exact=exact)
    for k in points:
        add_point(relax, *(k if isinstance(k, tuple) else (k,)))
    for var, value in relax.canonical(plan).items():
        relax.model.Add(var == value)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = 60.0
    status = solver.Solve(relax.model)
    return relax, solver, status


def solve_decisions(problem: Problem, plan: Plan, budget: int, points=()):
    """Fix only the plan's decisions (saved and recomputed values) and solve for every
    derived literal: a point that binds must bind whatever the solver sets them to."""
    relax = Relaxation(problem, budget, exact=False)
    for k in points:
        add_point(relax, *k)
    values = relax.canonical(plan)
    for var in (*relax.s.values(), *relax.r.values()):
        relax.model.Add(var == values[var])
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 60.0
    return solver, solver.Solve(relax.model)


def plan_of(problem: Problem, saved) -> Plan:
    try:
        return evaluate(problem, saved, solver="test")
    except InvalidPlan:
        assume(False)
        raise


@functools.lru_cache(maxsize=256)
def all_plans(problem: Problem) -> tuple[tuple[int, float, frozenset[int]], ...]:
    """(peak, cost, saved) of every saved set that is a plan."""
    values = sorted(savable(problem))
    seen: dict[frozenset[int], tuple[int, float]] = {}
    for k in range(len(values) + 1):
        for subset in itertools.combinations(values, k):
            try:
                plan = evaluate(problem, subset, solver="exhaustive")
            except InvalidPlan:
                continue
            seen[plan.saved] = (plan.peak, plan.cost)
    return tuple((peak, cost, saved) for saved, (peak, cost) in seen.items())


def exhaustive_minimum(problem: Problem, budget: int) -> float | None:
    return min((cost for peak, cost, _ in all_plans(problem) if peak <= budget), default=None)


def assert_solver_plan(problem: Problem, plan: Plan, budget: int) -> None:
    """What every cpsat answer promises, whatever its status."""
    check_plan(problem, plan)
    assert plan.solver == "cpsat"
    assert plan.limit == budget
    assert plan.peak <= budget
    assert plan.status in ("optimal", "feasible")
    assert plan.bound is not None
    assert plan.cost >= plan.bound - tol(plan.cost)
    assert 0.0 <= plan.gap <= 1.0
    if plan.status == "optimal":  # up to the objective's integer resolution
        assert plan.cost - plan.bound <= floor_slack(problem, plan)


def draw_budget(data, problem: Problem) -> int:
    """A fraction of the way from greedy's minimum peak up to the store-all peak."""
    full = store_all(problem).peak
    minimum = minimum_peak(problem)
    fraction = data.draw(
        st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)), label="fraction"
    )
    return max(1, minimum + int(fraction * (full - minimum)))


# ----------------------------------------------------------------------------- the model


def check_canonical(problem: Problem, plan: Plan, *, exact: bool = True) -> None:
    relax, solver, status = solve_fixed(problem, plan, plan.peak, exact=exact)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), (
        f"canonical assignment of saved={sorted(plan.saved)} is {solver.StatusName(status)} "
        f"(exact={exact}) at budget = its peak {plan.peak} ({plan.timeline.peak_phase})"
    )
    objective = solver.ObjectiveValue() / relax.scale
    cost = plan.cost
    # floored per term: never above the cost, under it by < 1 unit per recomputed node
    # and per saved storage
    assert objective <= cost + tol(cost)
    terms = len(plan.recomputed) + len(plan.saved)
    assert cost - objective <= terms / relax.scale + tol(cost)


def check_exact_backward(problem: Problem, plan: Plan) -> bool:
    """A backward peak above the forward one is exact: one byte less is infeasible."""
    timeline = plan.timeline
    if timeline.peak_phase != "bwd" or timeline.forward_peak >= plan.peak or plan.peak < 1:
        return False
    _, solver, status = solve_fixed(problem, plan, plan.peak - 1)
    assert status == cp_model.INFEASIBLE, (
        f"canonical assignment of saved={sorted(plan.saved)} is {solver.StatusName(status)} "
        f"at budget {plan.peak - 1}, one under its backward peak {plan.peak} "
        f"(forward peak {timeline.forward_peak})"
    )
    return True


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), problem=solver_problems(200))
def test_canonical_assignment_satisfies_the_model(data, problem):
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    check_canonical(problem, plan, exact=True)
    check_canonical(problem, plan, exact=False)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), problem=solver_problems(120))
def test_backward_memory_is_exact(data, problem):
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    assume(check_exact_backward(problem, plan))


def recompute_steps(relax: Relaxation, plan: Plan) -> list[tuple[int, int]]:
    """``(k, x)`` for each recompute x of ``plan``, in the gap before core step k."""
    steps, k = [], 0
    for node in plan.schedule.backward:
        if node in relax.pos:
            k = relax.pos[node] + 1
        else:
            steps.append((k, node))
    return steps


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), problem=solver_problems(120))
def test_exact_points_hold_for_every_plan(data, problem):
    """Every core step's point, and the points of the recomputes of this plan and of
    another (which this plan may place elsewhere, or not recompute)."""
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    other = plan_of(problem, data.draw(savable_subsets(problem), label="other"))
    relax = Relaxation(problem, plan.peak, exact=False)
    points = [*range(len(relax.core)), *recompute_steps(relax, plan)]
    points += recompute_steps(relax, other)
    _, solver, status = solve_fixed(problem, plan, plan.peak, exact=False, points=points)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), (
        f"saved={sorted(plan.saved)} violates an exact point: {solver.StatusName(status)}"
    )


@settings(max_examples=30, **SETTINGS)
@given(data=st.data(), problem=solver_problems(120))
def test_hints_name_every_variable_of_the_relaxation(data, problem):
    """With exact points too: CP-SAT often cannot use a hint it must complete."""
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    relax = Relaxation(problem, plan.peak, exact=False)
    for k in range(len(relax.core)):
        add_point(relax, k)
    hinted = {var.Index() for var in relax.canonical(plan)}
    free = {
        i
        for i, var in enumerate(relax.model.Proto().variables)
        if len(var.domain) > 2 or var.domain[0] != var.domain[-1]
    }
    names = relax.model.Proto().variables
    assert free <= hinted, [names[i].name for i in free - hinted]


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), problem=solver_problems(120))
def test_an_exact_point_at_the_peak_is_tight(data, problem):
    """A backward peak during a core step: one byte less, and its point refuses the plan."""
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    timeline = plan.timeline
    relax = Relaxation(problem, plan.peak, exact=False)
    assume(timeline.peak_phase == "bwd" and timeline.forward_peak < plan.peak)
    assume(timeline.peak_node in relax.pos and plan.peak > 1)
    k = relax.pos[timeline.peak_node]
    solver, status = solve_decisions(problem, plan, plan.peak - 1, points=[(k,)])
    assert status == cp_model.INFEASIBLE, solver.StatusName(status)


@settings(max_examples=60, **FILTERING)
@given(data=st.data(), problem=solver_problems(120))
def test_an_exact_point_at_a_recompute_peak_is_tight(data, problem):
    """A backward peak while a recompute runs: one byte less, and that recompute's point
    refuses the plan (the chains alone cannot: they count the gap only in part)."""
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    timeline = plan.timeline
    relax = Relaxation(problem, plan.peak, exact=False)
    assume(timeline.peak_phase == "bwd" and timeline.forward_peak < plan.peak)
    assume(timeline.peak_node not in relax.pos and plan.peak > 1)
    (step,) = [s for s in recompute_steps(relax, plan) if s[1] == timeline.peak_node]
    solver, status = solve_decisions(problem, plan, plan.peak - 1, points=[step])
    assert status == cp_model.INFEASIBLE, solver.StatusName(status)


@settings(max_examples=80, **FILTERING)
@given(data=st.data(), problem=solver_problems(120))
def test_a_forward_overflow_is_explained_by_saved_values_that_overflow_it_always(data, problem):
    """One byte under a forward peak: ``explain`` names saved values, and every plan
    saving them all (another drawn set joined with them) peaks in its forward over
    that budget too, also where the forward runs extra nodes to compute them."""
    plan = plan_of(problem, data.draw(savable_subsets(problem), label="saved"))
    assume(plan.timeline.peak_phase == "fwd" and plan.peak > 1)
    budget = plan.peak - 1
    relax = Relaxation(problem, budget, exact=False)
    literals = explain(relax, plan)
    assert literals is not None, "a forward overflow is always explained"
    pinned = {v for v, var in relax.s.items() if any(var.Index() == x.Index() for x in literals)}
    event(f"{len(pinned)} saved values pinned")
    other = plan_of(problem, data.draw(savable_subsets(problem), label="other") | pinned)
    values = relax.canonical(other)
    assume(all(values[x] for x in literals))  # a later saved value may cut one off
    assert other.timeline.forward_peak > budget


@settings(max_examples=30, **SETTINGS)
@given(problem=solver_problems(200))
def test_canonical_assignment_of_the_fixed_plans(problem):
    for make in (store_all, greedy):
        plan = make(problem)
        check_canonical(problem, plan)
        check_exact_backward(problem, plan)


@settings(max_examples=100, **SETTINGS)
@given(data=st.data(), problem=any_problem(60))
def test_saving_a_free_view_is_saving_its_root(data, problem):
    saved = data.draw(savable_subsets(problem), label="saved")
    plan = plan_of(problem, saved)
    reduced = evaluate(problem, without_free_views(problem, plan.saved), solver="test")
    assert reduced.peak == plan.peak
    assert math.isclose(reduced.recompute_cost, plan.recompute_cost, rel_tol=1e-12, abs_tol=1e-12)


def test_a_view_of_a_costly_view_is_not_free():
    """Saving a cost-free view of a view that costs something keeps that view's work
    done; replacing it by the root would run the costly view again (a hypothesis find:
    the model charged 0.1 for a plan that costs 0)."""
    nodes = (
        Node("x", "fwd", 0, 0.0, (), recomputable=False),
        Node("g", "bwd", 0, 0.0, ()),
        Node("costly", "fwd", 0, 0.1, (0,), alias_of=0),
        Node("free", "fwd", 0, 0.0, (2,), alias_of=2),
        Node("dx", "bwd", 0, 0.0, (1, 0, 3)),
    )
    problem = Problem(nodes=nodes, outputs=(0, 2), grads=(4,))
    assert free_views(problem) == frozenset()
    check_canonical(problem, plan_of(problem, {0, 3}))


# ----------------------------------------------------------------------------- the solver


@settings(max_examples=24, **SETTINGS)
@given(data=st.data(), problem=solver_problems(200))
def test_cpsat_plans_fit_and_beat_greedy(data, problem):
    budget = draw_budget(data, problem)
    plan = cpsat(problem, budget, time_limit=time_limit_for(problem))
    note(f"{plan}, bound {plan.bound!r}")
    assert_solver_plan(problem, plan, budget)
    base = greedy(problem, budget)  # fits: budget >= greedy's minimum
    assert plan.cost <= base.cost + tol(base.cost)
    event(f"fwd nodes {size_bucket(problem)}, {plan.status}")
    event("beats greedy" if plan.cost < base.cost - 1e-9 else "ties greedy")


@settings(max_examples=15, **SETTINGS)
@given(problem=any_problem(60))
def test_cpsat_without_budget_uses_greedys_minimum(problem):
    plan = cpsat(problem, time_limit=time_limit_for(problem))
    assert_solver_plan(problem, plan, minimum_peak(problem))


@settings(max_examples=20, **SETTINGS)
@given(data=st.data(), problem=solver_problems(120))
def test_cpsat_below_greedys_minimum_fits_or_refuses(data, problem):
    minimum = minimum_peak(problem)
    assume(minimum > 1)
    budget = data.draw(st.integers(max(1, minimum // 2), minimum - 1), label="budget")
    try:
        plan = cpsat(problem, budget, time_limit=time_limit_for(problem))
    except InfeasibleBudget as e:
        event("refused" if e.minimum == minimum else "refused, naming a lower minimum")
        assert budget < e.minimum <= minimum
        assert e.limit == budget
    else:
        event("fits below greedy's minimum")
        assert_solver_plan(problem, plan, budget)


@settings(max_examples=15, **SETTINGS)
@given(data=st.data(), problem=solver_problems(100))
def test_cpsat_is_deterministic(data, problem):
    budget = draw_budget(data, problem)
    limit = time_limit_for(problem)
    twin = Problem(problem.nodes, problem.outputs, problem.grads, name=problem.name)
    a = cpsat(problem, budget, time_limit=limit, seed=3)
    b = cpsat(twin, budget, time_limit=limit, seed=3)
    assert a.saved == b.saved
    assert (a.status, a.bound, a.cost) == (b.status, b.bound, b.cost)


@settings(max_examples=30, **SETTINGS)
@example(problem=random_joint(5, 0, max_inputs=1, p_view=0.1))
@given(problem=any_problem(40))
def test_optimal_means_zero_gap(problem):
    """``Plan.gap``: 0 when proven optimal (the bound of an optimal plan is its cost)."""
    plan = cpsat(problem, time_limit=time_limit_for(problem))
    assume(plan.status == "optimal")
    note(f"cost {plan.cost!r}, bound {plan.bound!r}")
    assert plan.gap == 0.0


# ----------------------------------------------------------------------------- tiny problems


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), problem=tiny_problems())
def test_cpsat_is_optimal_on_tiny_problems(data, problem):
    assume(len(savable(problem)) <= EXHAUSTIVE_MAX)
    peaks = sorted({peak for peak, _, _ in all_plans(problem)})
    full = store_all(problem).peak
    # the plans' own peaks are the tightest budgets (below greedy's minimum too):
    # mostly binding ones, under the store-all peak
    binding = [peak for peak in peaks if peak < full] or peaks
    budget = data.draw(
        st.one_of(st.sampled_from(binding), st.integers(peaks[0], max(peaks[0], full))),
        label="budget",
    )
    assume(budget >= 1)
    expected = exhaustive_minimum(problem, budget)
    assert expected is not None
    plan = cpsat(problem, budget, time_limit=5.0, gap_limit=0)
    note(f"{plan}, bound {plan.bound!r}; exhaustive minimum {expected!r}")
    event(f"savable {len(savable(problem))}, {plan.status}")
    event("below greedy's minimum" if budget < minimum_peak(problem) else "greedy fits")
    event("binding" if budget < full else "store-all fits")
    assert_solver_plan(problem, plan, budget)
    slack = len(savable(problem)) * resolution(problem)  # the floored objective's blur
    assert plan.cost >= expected - tol(expected)
    assert plan.bound <= expected + REL * max(1.0, expected)  # a bound on the true optimum
    assert plan.status == "optimal", "not proven optimal in 5 deterministic seconds"
    assert math.isclose(plan.cost, expected, rel_tol=REL, abs_tol=slack + 1e-9)


@settings(max_examples=40, **SETTINGS)
@given(data=st.data(), problem=tiny_problems(), gap_limit=st.sampled_from([0.01, 0.1, 0.3]))
def test_gap_limit_stops_within_it_of_the_optimum(data, problem, gap_limit):
    """Stopping early at ``gap_limit`` still returns a plan that close to the optimum."""
    assume(len(savable(problem)) <= EXHAUSTIVE_MAX)
    full = store_all(problem).peak
    peaks = sorted({peak for peak, _, _ in all_plans(problem) if peak <= full})
    budget = data.draw(st.sampled_from(peaks), label="budget")
    assume(budget >= 1)
    expected = exhaustive_minimum(problem, budget)
    plan = cpsat(problem, budget, time_limit=5.0, gap_limit=gap_limit)
    note(f"{plan}, bound {plan.bound!r}; exhaustive minimum {expected!r}")
    assert_solver_plan(problem, plan, budget)
    slack = len(savable(problem)) * resolution(problem)  # the floored objective's blur
    assert plan.cost - plan.bound <= gap_limit * plan.cost + slack
    assert plan.cost <= expected / (1 - gap_limit) + slack + tol(expected)
    assert plan.bound <= expected + REL * max(1.0, expected)
    if plan.status == "optimal":  # CP-SAT says OPTIMAL at its gap limit too: not proof
        assert math.isclose(plan.cost, expected, rel_tol=REL, abs_tol=slack + 1e-9)


@settings(max_examples=12, **SETTINGS)
@given(data=st.data(), problem=solver_problems(120))
def test_a_gap_limited_optimal_is_optimal(data, problem):
    """CP-SAT reports OPTIMAL when it stops at its gap limit; a plan is "optimal" only
    when nothing cheaper exists, so the search without a limit finds nothing cheaper."""
    budget = draw_budget(data, problem)
    limit = time_limit_for(problem)
    loose = cpsat(problem, budget, time_limit=limit, gap_limit=0.5)
    note(f"{loose}, bound {loose.bound!r}")
    assume(loose.status == "optimal")
    exact = cpsat(problem, budget, time_limit=limit, gap_limit=0)
    assert exact.cost >= loose.cost - tol(loose.cost)


@pytest.mark.parametrize("gap_limit", [-0.1, 1.0, 2.0])
def test_gap_limit_must_be_a_fraction(gap_limit):
    with pytest.raises(ValueError, match="gap_limit"):
        cpsat(small_problem(), gap_limit=gap_limit)


@settings(max_examples=20, **FILTERING)
@given(data=st.data(), problem=tiny_problems())
def test_cpsat_finds_plans_greedy_cannot(data, problem):
    """Under greedy's minimum peak cpsat starts with no plan; it still refuses only
    when no plan fits, and is optimal where one does."""
    assume(len(savable(problem)) <= EXHAUSTIVE_MAX)
    minimum = minimum_peak(problem)
    peaks = sorted({peak for peak, _, _ in all_plans(problem) if peak < minimum})
    assume(peaks and peaks[-1] >= 1)
    budget = data.draw(st.sampled_from([p for p in peaks if p >= 1]), label="budget")
    expected = exhaustive_minimum(problem, budget)
    try:
        plan = cpsat(problem, budget, time_limit=5.0, gap_limit=0)
    except InfeasibleBudget:
        raise AssertionError(f"refused, yet a plan peaks at {budget} (cost {expected!r})") from None
    note(f"{plan}, bound {plan.bound!r}; exhaustive minimum {expected!r}")
    assert_solver_plan(problem, plan, budget)
    assert plan.status == "optimal", "not proven optimal in 5 deterministic seconds"
    slack = len(savable(problem)) * resolution(problem)
    assert math.isclose(plan.cost, expected, rel_tol=REL, abs_tol=slack + 1e-9)


@settings(max_examples=30, **SETTINGS)
@given(data=st.data(), problem=tiny_problems())
def test_budget_below_every_plan_is_refused(data, problem):
    assume(len(savable(problem)) <= EXHAUSTIVE_MAX)
    lowest = min(peak for peak, _, _ in all_plans(problem))
    assume(lowest >= 1)
    budget = data.draw(st.integers(0, lowest - 1), label="budget")
    with pytest.raises(InfeasibleBudget) as info:
        cpsat(problem, budget, time_limit=2.0)
    assert lowest <= info.value.minimum <= minimum_peak(problem)
    assert info.value.limit == budget
    # the minimum it names is a budget it fits (it found a plan there while refusing)
    assert cpsat(problem, info.value.minimum, time_limit=2.0).peak <= info.value.minimum


# ----------------------------------------------------------------------------- the API


def small_problem() -> Problem:
    return random_joint(8, 1)


@pytest.mark.parametrize("limit", [0, 0.0, -1.0])
def test_time_limit_must_be_positive(limit):
    with pytest.raises(ValueError, match="time_limit"):
        cpsat(small_problem(), time_limit=limit)


@pytest.mark.parametrize("workers", [0, -2])
def test_workers_must_be_at_least_one(workers):
    with pytest.raises(ValueError, match="workers"):
        cpsat(small_problem(), workers=workers)


@settings(max_examples=10, **SETTINGS)
@given(data=st.data(), problem=any_problem(25))
def test_solve_with_cpsat_auto_and_a_callable(data, problem):
    budget = draw_budget(data, problem)
    base = greedy(problem, budget)
    solvers = (
        "cpsat",
        "auto",
        functools.partial(cpsat, time_limit=0.5),
        lambda p, b: cpsat(p, b, time_limit=0.2),
    )
    for solver in solvers:
        plan = solve(problem, budget, solver=solver)
        assert_solver_plan(problem, plan, budget)
        assert plan.cost <= base.cost + tol(base.cost)


def test_solve_with_cpsat_at_the_store_all_peak():
    problem = small_problem()
    full = store_all(problem).peak
    plan = solve(problem, full, solver="cpsat")
    assert_solver_plan(problem, plan, full)
    assert plan.recompute_cost == 0


def test_cpsat_plan_is_the_same_in_fresh_processes():
    """What distributed ranks see: separate processes, separate thread timings."""
    code = (
        "from remat.solvers import greedy, store_all\n"
        "from remat.solvers.cpsat import cpsat\n"
        "from synthetic import random_joint\n"
        "p = random_joint(90, 56)\n"
        "lo, hi = greedy(p).peak, store_all(p).peak\n"
        "plan = cpsat(p, lo + (hi - lo) // 3, time_limit=0.3)\n"
        "print(plan.status, plan.recompute_cost, sorted(plan.saved))\n"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(3)
    }
    assert len(runs) == 1, runs


def test_refusal_says_when_it_is_proven():
    """Below what the backward alone holds, the relaxation is infeasible: a proof; and one
    byte below the greedy's minimum too, so the minimum it names is the proven lowest."""
    problem = chain(6)
    with pytest.raises(InfeasibleBudget) as refusal:
        cpsat(problem, 1024)
    assert refusal.value.proven and refusal.value.lowest_proven
    assert "proven lowest peak" in str(refusal.value)
    assert refusal.value.minimum == greedy(problem).peak


def test_refusal_names_a_budget_below_the_greedys_minimum(caplog):
    """The greedy's minimum only bounds the true one from above: a refusal spends up to
    ``PROBES`` solves below it (saying so first: each takes as long as the first solve),
    one just below it and one at the peak of the plan found there, and names the lowest
    budget a plan was found under, whatever budget was refused."""
    problem = random_joint(30, 16)
    greedy_minimum = greedy(problem).peak
    found = cpsat(problem, greedy_minimum - 1).peak  # CP-SAT undercuts the greedy here
    lowest = found if _fits(problem, found) else greedy_minimum - 1
    named = set()
    for budget in (1, lowest // 2, lowest - 1):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="remat"), pytest.raises(InfeasibleBudget) as r:
            cpsat(problem, budget)
        named.add(r.value.minimum)
        assert str(r.value.minimum) in str(r.value)
        assert [m.getMessage() for m in caplog.records if "2 more solves below" in m.getMessage()]
    assert named == {lowest} and lowest < greedy_minimum
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="remat"), pytest.raises(InfeasibleBudget) as r:
        cpsat(problem, 1, probes=0)
    assert r.value.minimum == greedy_minimum
    assert not caplog.records


def _fits(problem, budget: int) -> bool:
    try:
        cpsat(problem, budget)
    except InfeasibleBudget:
        return False
    return True


def test_the_default_time_limit_grows_with_the_graph_beyond_4000_nodes():
    """At 10,000 nodes a limit of 2 ends inside CP-SAT's presolve, with no bound at all."""
    assert default_time_limit(random_joint(60, 0)) == 2.0
    assert default_time_limit(layered(227)) == len(layered(227)) / 2_000 > 4.9


@pytest.mark.parametrize("gap_limit", [0.0, 0.99])
@pytest.mark.parametrize("given_limit", [None, 1.0])
def test_more_time_goes_only_to_an_open_gap_under_the_default_limit(
    monkeypatch, gap_limit, given_limit
):
    """``EXTRA_LIMIT`` is spent only with the default limit, while the plan is not proven
    within ``gap_limit``."""
    from remat.solvers import cpsat as module

    problem = layered(2)
    budget = store_all(problem).peak * 6 // 10
    rounds = []

    def unproven_round(self, relax, seconds, capped):  # a round that proves nothing
        rounds.append(seconds)
        return seconds

    monkeypatch.setattr(module._Search, "bound_round", unproven_round)
    monkeypatch.setattr(module._Search, "exact_rounds", lambda self, seconds: None)
    cpsat(problem, budget, time_limit=given_limit, gap_limit=gap_limit)
    if gap_limit:  # the LP's bound proves the greedy's plan within 99%: no search at all
        assert rounds == []
    else:
        assert rounds[1:] == ([module.EXTRA_LIMIT] if given_limit is None else [])
