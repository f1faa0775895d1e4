"""The LP bound: CP-SAT models turned into LPs whose optimum is known by hand, and the
bound's place in ``cpsat`` (a proof before the search, and never above a plan)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from synthetic import layered

from remat.solvers import greedy, store_all
from remat.solvers.cpsat import _Search, cpsat
from remat.solvers.exact import add_point, add_points
from remat.solvers.linear_bound import solve_lp
from remat.solvers.plan import evaluate
from remat.solvers.relaxation import Relaxation


def lp_value(model: cp_model.CpModel) -> float:
    solution = solve_lp(model, 10.0)
    assert solution is not None
    return solution.bound


def test_a_linear_model_gives_its_fractional_optimum_and_objective_offset():
    model = cp_model.CpModel()
    x, y = model.new_int_var(0, 5, "x"), model.new_int_var(0, 5, "y")
    model.add(2 * x + 2 * y >= 3)
    model.minimize(x + y + 7)
    assert lp_value(model) == pytest.approx(8.5, rel=1e-5)  # CP-SAT: 9


# (the enforced row, the hard row, the objective's x term): x >= 4 where the literal
# holds with x <= 2, and the mirror x <= 6 with x >= 8 (10 - x for x), each a CP-SAT row
# with only that side
SIDES = {
    "lower": (lambda x: x >= 4, lambda x: x <= 2, lambda x: x),
    "upper": (lambda x: x <= 6, lambda x: x >= 8, lambda x: 10 - x),
}


@pytest.mark.parametrize("negated", [False, True])
@pytest.mark.parametrize("side", sorted(SIDES))
def test_an_enforced_side_is_relaxed_by_how_far_its_terms_reach(side, negated):
    # the literal is false in every integer answer (cost 5, through c); the LP (for the
    # lower side x >= 4 * literal, a big-M of 4) takes it at one half: 4.5 (a big-M of
    # 10, the variable's whole range, gives 5)
    enforced, hard, term = SIDES[side]
    model = cp_model.CpModel()
    x, c = model.new_int_var(0, 10, "x"), model.new_bool_var("c")
    b = model.new_bool_var("b")
    literal = ~b if negated else b
    model.add(enforced(x)).only_enforce_if(literal)
    model.add_bool_or([literal, c])
    model.add(hard(x))
    model.minimize(term(x) + 5 * c)
    assert lp_value(model) == pytest.approx(4.5, rel=1e-5)


def test_clauses_become_sums_with_negated_literals_as_one_minus():
    model = cp_model.CpModel()
    a, b, c, d = (model.new_bool_var(n) for n in "abcd")
    model.add_exactly_one([a, ~b])  # a = b
    model.add_at_most_one([c, d, a])
    model.add_bool_and([d]).only_enforce_if(b)  # b -> d
    model.minimize(2 * a - 4 * b - c)
    # with a = b: -2b - c, and a + c + d <= 1 with d >= b: 2b + c <= 1, so -1 (without
    # b -> d: -2; a negation read as x: -4; without at-most-one: -3)
    assert lp_value(model) == pytest.approx(-1.0, abs=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(-5, 5), min_size=3, max_size=3),
            st.integers(-8, 8),
            st.sampled_from([None, 0, 1, -1]),
        ),
        min_size=1,
        max_size=5,
    ),
    st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_the_bound_never_exceeds_the_integer_optimum(rows, costs):
    model = cp_model.CpModel()
    xs = [model.new_int_var(0, 3, f"x{i}") for i in range(3)]
    flags = [model.new_bool_var("p"), model.new_bool_var("q")]
    for coeffs, rhs, enforce in rows:
        ct = model.add(sum(c * x for c, x in zip(coeffs, xs, strict=True)) <= rhs)
        if enforce is not None:
            ct.only_enforce_if(flags[0] if enforce == 0 else ~flags[1] if enforce < 0 else flags[1])
    model.minimize(sum(c * x for c, x in zip(costs, xs, strict=True)) + 2 * flags[0])
    solver = cp_model.CpSolver()
    status = solver.solve(model)
    solution = solve_lp(model, 10.0)
    if status == cp_model.OPTIMAL:
        assert solution is not None
        assert solution.bound <= solver.objective_value + 1e-6
    else:
        assert status == cp_model.INFEASIBLE


def test_cpsat_stops_before_the_search_where_the_lp_proves_the_greedy_close_enough(monkeypatch):
    # layered(3) at 70%: the greedy's plan is 30% over the LP bound, so a gap limit of
    # 35% needs no search; at 1% it does
    problem = layered(3)
    budget = int(store_all(problem).peak * 0.7)

    def no_search(*args, **kwargs):
        raise AssertionError("searched although the LP bound sufficed")

    with monkeypatch.context() as m:
        m.setattr(_Search, "solve", no_search)
        plan = cpsat(problem, budget, gap_limit=0.35)
    relax = Relaxation(problem, budget, exact=False)
    lp = solve_lp(relax.model, 10.0)
    assert plan.bound == pytest.approx(lp.bound / relax.scale)
    assert plan.bound <= plan.recompute_cost <= greedy(problem, budget).recompute_cost
    assert 0 < plan.gap <= 0.35
    with monkeypatch.context() as m:
        m.setattr(_Search, "solve", no_search)
        with pytest.raises(AssertionError, match="searched"):
            cpsat(problem, budget, gap_limit=0.01)


def test_exact_points_bind_in_the_lp_and_stay_under_the_optimum():
    # layered(2) at 80%: the LP's rounded answer overflows at backward steps 4 and 3.
    # With those points its LP rose 1.6% while their literals were bounded from one side
    # only (lin_max, half-linearised ANDs); now 31%, and still under the proven optimum
    problem = layered(2)
    budget = int(store_all(problem).peak * 0.8)
    relax = Relaxation(problem, budget, exact=False)
    before = lp_value(relax.model)
    for k in (4, 3):
        add_point(relax, k)
    after = lp_value(relax.model)
    optimum = cpsat(problem, budget, gap_limit=0)
    assert optimum.status == "optimal"
    assert after >= 1.2 * before
    assert after / relax.scale <= optimum.recompute_cost


def test_points_at_the_rounded_answers_overflow_bring_the_lp_to_the_optimum():
    # layered(2) at 50%: each round adds the point where the LP's rounded answer overflows
    # most. While a point counted a storage half saved and half recomputed as half live,
    # two points left the LP 15% under the proven optimum; now within 1%, never over it
    problem = layered(2)
    budget = int(store_all(problem).peak * 0.5)
    optimum = cpsat(problem, budget, gap_limit=0)
    assert optimum.status == "optimal"
    relax = Relaxation(problem, budget, exact=False)
    lp = solve_lp(relax.model, 10.0)
    for _ in range(2):
        rounded = evaluate(problem, relax.saved_set(lp.value), solver="test")
        assert add_points(relax, rounded, count=1) == 1
        lp = solve_lp(relax.model, 10.0, after=lp)
    assert 0.99 * optimum.cost <= lp.bound / relax.scale <= optimum.cost


def test_an_extended_model_solved_after_its_first_lp_is_the_lp_converted_whole():
    # only the rows added since ``after`` are converted: the same LP as from scratch
    problem = layered(2)
    budget = int(store_all(problem).peak * 0.8)
    relax = Relaxation(problem, budget, exact=False)
    first = solve_lp(relax.model, 10.0)
    for k in (4, 3):
        add_point(relax, k)
    extended = solve_lp(relax.model, 10.0, after=first)
    whole = solve_lp(relax.model, 10.0)
    assert extended.converted == whole.converted > first.converted
    assert len(extended.program.constraint) == len(whole.program.constraint)
    assert extended.bound == pytest.approx(whole.bound, rel=1e-9)
    assert extended.bound >= 1.2 * first.bound


def test_the_lp_answer_names_the_first_rounds_points_and_lifts_its_cap(monkeypatch):
    problem = layered(2)
    budget = int(store_all(problem).peak * 0.8)
    seen = []
    real = _Search.bound_round

    def spy(self, relax, seconds, capped):
        seen.append((set(relax.points), capped))
        return real(self, relax, seconds, capped)

    monkeypatch.setattr(_Search, "bound_round", spy)
    cpsat(problem, budget)
    assert seen == [({3, 4}, False)]
