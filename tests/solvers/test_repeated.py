"""Repeated blocks found from the graph, and the pattern solver built on them."""

from __future__ import annotations

import dataclasses
import importlib

import oracle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic import chain, layered, random_joint

from remat.solvers import InfeasibleBudget, Problem, greedy, solve, store_all
from remat.solvers.blocks import find_blocks
from remat.solvers.cpsat import cpsat
from remat.solvers.repeated import repeated

solve_module = importlib.import_module(
    "remat.solvers.solve"
)  # the package's ``solve`` is the function
NODES_PER_LAYER = 44  # synthetic.layered: len(layered(k)) == 44 * k + 5


@pytest.mark.parametrize("layers", [6, 12])
def test_a_stack_of_layers_has_one_block_per_layer(layers):
    problem = layered(layers)
    blocks = find_blocks(problem)
    assert blocks is not None and blocks.count == layers
    assert {len(m) for m in blocks.members} == {NODES_PER_LAYER}
    every = [i for m in blocks.members for i in m]
    assert len(set(every)) == len(every)  # no node in two blocks
    # each block holds one layer's forward nodes and their backward
    for members in blocks.members:
        forward = {problem.nodes[i].name.split(".")[0] for i in members if i < len(problem) // 2}
        assert len(forward) <= 2  # a block may start inside a layer, the same way each time


def test_a_block_that_reads_elsewhere_breaks_the_repetition():
    problem = layered(8)
    blocks = find_blocks(problem)
    middle = blocks.members[4]
    reader = next(i for i in middle if len(problem.nodes[i].inputs) == 2)
    farther = blocks.members[1][0]  # a read three blocks back, which no other block makes
    nodes = list(problem.nodes)
    node = nodes[reader]
    nodes[reader] = dataclasses.replace(node, inputs=(node.inputs[0], farther))
    rewired = Problem(tuple(nodes), problem.outputs, problem.grads, problem.resident_bytes)
    assert find_blocks(rewired) is None


@pytest.mark.parametrize("problem", [random_joint(60, seed=3), chain(3)], ids=["random", "short"])
def test_graphs_without_repeated_blocks_are_planned_by_cpsat(problem):
    assert find_blocks(problem) is None
    budget = store_all(problem).peak * 9 // 10
    assert repeated(problem, budget).solver == "cpsat"


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_pattern_plans_fit_and_their_bound_is_below_any_plan(fraction):
    problem = layered(12)
    budget = int(store_all(problem).peak * fraction)
    plan = solve(problem, budget, "repeated")  # checked: derived again and simulated
    assert plan.solver == "repeated" and plan.peak <= budget
    # the LP bound is a lower bound: no plan that fits costs less, CP-SAT's included
    other = cpsat(problem, budget)
    assert plan.bound <= other.recompute_cost + 1e-12
    assert plan.bound <= plan.recompute_cost


def test_an_open_gap_gets_the_bound_of_a_pointed_lp():
    # layered(12) at 70%: the first LP leaves the pattern plan 9% open; one exact point
    # lifts the bound (to 7%), which stays under every plan's cost, CP-SAT's included
    problem = layered(12)
    budget = int(store_all(problem).peak * 0.7)
    first = repeated(problem, budget, gap_limit=0.5)  # within 50%: no pointed LP
    plan = repeated(problem, budget)
    assert plan.saved == first.saved
    assert first.bound < plan.bound <= cpsat(problem, budget).cost + 1e-12


def test_where_no_pattern_fits_cpsat_plans_the_whole_graph():
    problem = layered(12)
    budget = int(store_all(problem).peak * 0.3)  # ten middle blocks: the edges weigh
    plan = repeated(problem, budget)
    assert plan.solver == "cpsat" and plan.peak <= budget


def test_middle_blocks_share_their_saved_positions():
    problem = layered(12)
    budget = int(store_all(problem).peak * 0.5)
    plan = repeated(problem, budget)
    blocks = find_blocks(problem)
    position_of = blocks.position_of
    saved_positions = [
        {position_of[i] for i in members if i in plan.saved} for members in blocks.members[1:-1]
    ]
    # a pattern and a longer one, or the LP's shares: a few distinct patterns, not ten
    assert len({frozenset(p) for p in saved_positions}) <= len(saved_positions) // 2


def test_auto_plans_large_graphs_by_pattern_alone(monkeypatch):
    problem = layered(12)
    budget = int(store_all(problem).peak * 0.5)
    monkeypatch.setattr(solve_module, "REPEATED_MIN_NODES", len(problem))
    assert solve(problem, budget).solver == "repeated"


def test_auto_takes_a_pattern_plan_its_bound_proves_and_searches_no_further(monkeypatch):
    # layered(12) at 80%: the pattern plan is proven within 2.9%, so within a 10% limit
    problem = layered(12)
    budget = int(store_all(problem).peak * 0.8)
    cpsat_module = importlib.import_module("remat.solvers.cpsat")

    def no_search(*args, **kwargs):
        raise AssertionError("searched")

    monkeypatch.setattr(cpsat_module, "cpsat", no_search)
    plan = solve_module.auto(problem, budget, gap_limit=0.1)
    assert plan.solver == "repeated" and plan.gap <= 0.1 and plan.peak <= budget


def test_auto_searches_where_the_pattern_plan_is_not_proven_and_keeps_the_cheaper(monkeypatch):
    # layered(12) at 50%: the pattern plan is 7.6% over its bound, CP-SAT proves its own
    problem = layered(12)
    budget = int(store_all(problem).peak * 0.5)
    patterns = repeated(problem, budget)
    assert patterns.solver == "repeated" and patterns.gap > 0.01
    cpsat_module = importlib.import_module("remat.solvers.cpsat")
    searches = []

    def watched(*args, **kwargs):
        searches.append(cpsat(*args, **kwargs))
        return searches[-1]

    monkeypatch.setattr(cpsat_module, "cpsat", watched)
    plan = solve_module.auto(problem, budget)
    assert len(searches) == 1
    assert plan.cost == min(patterns.cost, searches[0].cost) and plan.peak <= budget
    assert plan.bound == pytest.approx(min(plan.cost, max(patterns.bound, searches[0].bound)))
    assert plan.gap <= 0.01


def test_a_budget_no_pattern_meets_is_refused_with_the_minimum():
    problem = layered(12)
    with pytest.raises(InfeasibleBudget) as refusal:
        repeated(problem, store_all(problem).peak // 50)
    assert refusal.value.minimum > store_all(problem).peak // 50


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    layers=st.integers(4, 9),
    width=st.sampled_from([64, 128, 256]),
    seq=st.sampled_from([64, 128]),
    fraction=st.floats(0.0, 0.95),
)
def test_pattern_plans_on_random_stacks_are_valid_and_fit(layers, width, seq, fraction):
    """At budgets from the greedy's lowest peak (where no pattern fits, CP-SAT starts
    from the greedy's plan: never a refusal) toward the store-all peak."""
    problem = layered(layers, width=width, seq=seq)
    lowest, full = greedy(problem).peak, store_all(problem).peak
    budget = lowest + int(fraction * (full - lowest))
    plan = repeated(problem, budget, time_limit=0.5)
    assert plan.peak <= budget
    oracle.check(problem, plan.schedule, plan.timeline)  # an independent re-derivation
    if plan.solver == "repeated":
        assert plan.bound is not None and plan.bound <= plan.recompute_cost
