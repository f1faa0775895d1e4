"""The step-time objective: recompute seconds plus the seconds saved storages cost, and
saved sets from elsewhere (torch's partition) taken where they are cheaper."""

from __future__ import annotations

import dataclasses

import pytest

from remat.solvers import InvalidPlan, Node, Problem, evaluate, solve, store_all
from remat.solvers.cpsat import GAP_LIMIT, cpsat
from remat.solvers.plan import save_cost, step_seconds


def chain(save: float) -> Problem:
    """x -> a (cheap, big) -> b (costly, small) -> loss; the backward reads a and b."""
    nodes = [
        Node("a", "fwd", bytes=1000, cost=0.1, save_cost=save),
        Node("b", "fwd", bytes=10, cost=5.0, inputs=(0,), save_cost=save / 100),
        Node("loss", "fwd", bytes=4, cost=0.01, inputs=(1,)),
        Node("tangent", "bwd", bytes=4),
        Node("grad_b", "bwd", bytes=10, cost=0.2, inputs=(3, 0)),
        Node("grad_a", "bwd", bytes=1000, cost=0.2, inputs=(4, 1)),
    ]
    return Problem(tuple(nodes), outputs=(2,), grads=(5,), name="chain")


def test_a_storage_dearer_to_keep_than_to_rebuild_is_recomputed_with_room_to_spare():
    problem = chain(save=1.0)  # keeping a: 1.0 s; rebuilding it: 0.1 s
    full = store_all(problem)
    assert full.recompute_cost == 0 and full.save_cost == pytest.approx(1.01)
    plan = cpsat(problem, full.peak, gap_limit=0)
    assert plan.status == "optimal"
    assert plan.recomputed == {0} and plan.saved == {1}
    assert plan.cost == pytest.approx(0.1 + 0.01)
    assert plan.cost < full.cost
    assert plan.bound == pytest.approx(plan.cost, rel=1e-5)


def test_without_save_costs_storing_everything_is_the_cheapest_plan():
    problem = chain(save=0.0)
    plan = cpsat(problem, store_all(problem).peak, gap_limit=0)
    assert plan.recomputed == frozenset() and plan.cost == 0


def test_a_saved_storage_is_charged_once_however_many_views_of_it_are_saved():
    nodes = [
        Node("a", "fwd", bytes=100, cost=1.0, save_cost=0.5),
        Node("view", "fwd", inputs=(0,), alias_of=0),
        Node("out", "fwd", bytes=4, cost=1.0, inputs=(1,)),
        Node("tangent", "bwd", bytes=4),
        Node("grad", "bwd", bytes=100, cost=1.0, inputs=(3, 0, 1)),
    ]
    problem = Problem(tuple(nodes), outputs=(2,), grads=(4,))
    plan = evaluate(problem, {0, 1}, solver="test")
    assert plan.save_cost == save_cost(problem, {0}) == 0.5
    assert step_seconds(problem, plan) == pytest.approx(3.0 + 0.5)


def test_an_output_kept_for_the_caller_costs_nothing_to_save():
    nodes = [
        Node("out", "fwd", bytes=100, cost=1.0, save_cost=0.5),
        Node("tangent", "bwd", bytes=100),
        Node("grad", "bwd", bytes=100, cost=1.0, inputs=(1, 0)),
    ]
    problem = Problem(tuple(nodes), outputs=(0,), grads=(2,))
    assert store_all(problem).save_cost == 0


def test_a_cheaper_candidate_that_fits_is_taken_with_the_solvers_bound():
    problem = chain(save=1.0)
    full = store_all(problem)
    greedy_plan = solve(problem, full.peak, "store-all")
    assert greedy_plan.saved == {0, 1}
    plan = solve(problem, full.peak, "store-all", candidates=lambda: {"elsewhere": {1}})
    assert plan.solver == "elsewhere" and plan.saved == {1}
    assert plan.cost < greedy_plan.cost and plan.limit == full.peak
    bounded = solve(problem, full.peak, "greedy", candidates=lambda: {"elsewhere": {0, 1}})
    assert bounded.solver == "greedy"  # costlier than the solver's own: not taken


def test_candidates_are_not_even_made_where_the_solver_proved_its_plan_near_optimal():
    problem = chain(save=1.0)

    def made():
        raise AssertionError("no candidate can beat a plan proven within the gap limit")

    plan = solve(problem, store_all(problem).peak, "cpsat", candidates=made)
    assert plan.gap <= GAP_LIMIT


def test_a_candidate_over_the_budget_or_that_cannot_run_is_not_taken():
    problem = chain(save=1.0)
    tight = evaluate(problem, {1}, solver="test").peak - 1
    assert solve(problem, tight, "greedy").peak <= tight
    plan = solve(problem, tight, "greedy", candidates=lambda: {"over": {1}, "invalid": {4}})
    assert plan.solver == "greedy"


def test_a_plan_that_misstates_its_save_cost_is_refused():
    problem = chain(save=1.0)

    def forged(p, budget):
        return dataclasses.replace(store_all(p), save_cost=0.0)

    with pytest.raises(InvalidPlan, match="save cost"):
        solve(problem, store_all(problem).peak, forged)
