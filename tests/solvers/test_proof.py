"""The MIP bound (``linear_bound.solve_mip``) and ``proof.prove``: never above the
integer optimum, at least the LP's, exact where the LP takes a fraction of a value."""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from synthetic import chain, layered
from test_heuristic_steps import _read_last
from test_properties import any_problem, minimum_peak

from remat.solvers import RematError, evaluate, greedy, store_all
from remat.solvers.chain import revolve
from remat.solvers.cpsat import cpsat
from remat.solvers.linear_bound import solve_lp, solve_mip
from remat.solvers.plan import with_bound
from remat.solvers.proof import prove
from remat.solvers.relaxation import Relaxation

pytest.importorskip("highspy", reason="the MIP bound needs the 'prove' extra")


def test_integral_booleans_give_the_integer_optimum_where_the_lp_takes_a_fraction():
    model = cp_model.CpModel()
    x, y = model.new_bool_var("x"), model.new_bool_var("y")
    model.add(2 * x + 2 * y >= 3)
    model.minimize(3 * x + 2 * y + 7)
    assert solve_lp(model, 10.0).bound == pytest.approx(10.5, rel=1e-5)  # y = 1, x = 1/2
    assert solve_mip(model, 10.0).bound == pytest.approx(12.0, rel=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(-5, 5), min_size=4, max_size=4), st.integers(-8, 8)),
        min_size=1,
        max_size=5,
    ),
    st.lists(st.integers(0, 6), min_size=4, max_size=4),
)
def test_the_mip_bound_lies_between_the_lp_and_the_integer_optimum(rows, costs):
    model = cp_model.CpModel()
    xs = [model.new_bool_var(f"b{i}") for i in range(2)] + [
        model.new_int_var(0, 3, f"x{i}") for i in range(2)
    ]
    for coeffs, rhs in rows:
        model.add(sum(c * x for c, x in zip(coeffs, xs, strict=True)) <= rhs)
    model.minimize(sum(c * x for c, x in zip(costs, xs, strict=True)))
    solver = cp_model.CpSolver()
    assume(solver.solve(model) == cp_model.OPTIMAL)  # random rows may leave no solution
    mip = solve_mip(model, 10.0)
    assert mip is not None and mip.closed
    assert solve_lp(model, 10.0).bound - 1e-6 <= mip.bound <= solver.objective_value + 1e-6


def _knapsack():
    """Room for the costly value and one cheap one: the LP saves the costly value and
    a fraction of a second cheap one, so its bound is under the optimum."""
    problem = _read_last([("costly", 20, 50.0), ("cheap1", 8, 1.0), ("cheap2", 8, 1.0)])
    return problem, evaluate(problem, (), solver="t").peak + 32


def test_prove_closes_a_knapsack_gap_the_lp_leaves_open():
    problem, budget = _knapsack()
    optimum = cpsat(problem, budget, gap_limit=0)
    assert optimum.status == "optimal"
    relax = Relaxation(problem, budget, exact=False)
    assert solve_lp(relax.model, 10.0).bound / relax.scale < 0.99 * optimum.cost
    proved = prove(problem, optimum, seconds=10.0)
    assert proved.bound == pytest.approx(optimum.cost, rel=1e-5)  # to the safety margin
    assert proved.saved == optimum.saved


def test_prove_returns_the_mips_plan_where_it_fits_and_is_cheaper():
    problem, budget = _knapsack()
    optimum = cpsat(problem, budget, gap_limit=0)
    nothing = evaluate(problem, (), solver="recompute-all", limit=budget)
    assert nothing.cost > optimum.cost
    proved = prove(problem, nothing, seconds=10.0)
    assert proved.peak <= budget
    assert proved.cost == pytest.approx(optimum.cost)
    assert proved.bound == pytest.approx(optimum.cost, rel=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=any_problem(60), share=st.floats(0.0, 0.9))
def test_prove_never_lowers_a_bound_nor_passes_the_optimum(problem, share):
    """At budgets from the greedy's lowest peak (so CP-SAT always has a plan) up."""
    lowest, full = minimum_peak(problem), store_all(problem).peak
    budget = lowest + int(share * (full - lowest))
    plan = cpsat(problem, budget, gap_limit=0)
    proved = prove(problem, plan, seconds=10.0)
    assert proved.peak <= budget and proved.cost <= plan.cost
    assert (plan.bound or 0.0) - 1e-12 <= proved.bound <= proved.cost
    again = evaluate(problem, proved.saved, solver="t")
    assert (again.cost, again.peak) == (proved.cost, proved.peak)
    if plan.status == "optimal":
        assert proved.bound <= plan.cost * (1 + 1e-9)


def test_prove_lifts_the_lp_bound_of_a_layered_graph():
    problem = layered(2)
    budget = int(store_all(problem).peak * 0.8)
    plan = greedy(problem, budget)
    optimum = cpsat(problem, budget, gap_limit=0)
    relax = Relaxation(problem, budget, exact=False)
    lp = solve_lp(relax.model, 10.0).bound / relax.scale
    proved = prove(problem, plan, seconds=20.0)
    assert optimum.status == "optimal"
    assert lp < 0.9 * optimum.cost
    assert 0.99 * optimum.cost <= proved.bound <= optimum.cost * (1 + 1e-6)


def test_prove_refuses_a_plan_over_its_budget_and_a_bad_time():
    problem = layered(2)
    plan = greedy(problem, int(store_all(problem).peak * 0.8))
    over = evaluate(problem, (), solver="t", limit=plan.peak - 1)
    with pytest.raises(ValueError, match="fits its budget"):
        prove(problem, over)
    with pytest.raises(ValueError, match="seconds must be positive"):
        prove(problem, plan, seconds=0)


def test_prove_refuses_a_plan_that_recomputes_a_value_more_than_once():
    problem = chain(12)
    plan = revolve(problem, None, slots=1)
    assert plan.multiple
    fitting = with_bound(plan, 0.0, solver="revolve", limit=plan.peak, seconds=0.0)
    with pytest.raises(ValueError, match="more than once"):
        prove(problem, fitting)


def test_without_highspy_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy raises ImportError
    model = cp_model.CpModel()
    model.minimize(model.new_bool_var("x"))
    with pytest.raises(RematError, match=r"'prove' extra"):
        solve_mip(model, 1.0)
