"""The shortcuts that keep the heuristics fast on large graphs: batched drop-saves
steps, the capped descend round and the gap placement from precomputed first reads."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_properties import any_problem

from remat.solvers import Node, Problem, evaluate, store_all
from remat.solvers.heuristics import (
    _drop_saves,
    _new_recomputes,
    _victims,
    descend,
    greedy,
    savable,
)
from remat.solvers.problem import without_free_views
from remat.solvers.synthetic import random_joint

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _one_at_a_time_best(problem, plan):
    """The victim the unbatched greedy picks: ``_victims`` with a one-byte step."""
    return _victims(problem, plan, 1)


@settings(max_examples=60, **SETTINGS)
@given(problem=any_problem(120), step=st.sampled_from([1, 1000, 10**6, 10**12]))
def test_a_batch_starts_with_the_unbatched_choice_and_its_chains_are_disjoint(problem, step):
    plan = store_all(problem)
    batch = _victims(problem, plan, step)
    single = _one_at_a_time_best(problem, plan)
    assert len(single) <= 1
    assert single <= batch
    assert bool(batch) == bool(single)
    chains = [_new_recomputes(problem, plan, v) for v in sorted(batch)]
    assert sum(map(len, chains)) == len(set().union(*chains))
    freed = sum(problem.nodes[problem.storage[v]].bytes for v in batch)
    assert len(batch) <= 1 or freed <= step


@settings(max_examples=40, **SETTINGS)
@given(problem=any_problem(80))
def test_descend_stops_only_where_no_single_flip_lowers_the_peak(problem):
    start = store_all(problem)
    plan = descend(problem, start, -1)  # an unreachable target: descend to the end
    assert plan.peak <= start.peak
    live = plan.timeline.live_at_peak
    movable = savable(problem)
    for i in plan.saved | plan.recomputed:
        if i in movable and problem.storage[i] in live and problem.nodes[i].recomputable:
            assert evaluate(problem, plan.saved ^ {i}, solver="t").peak >= plan.peak


def _stuck_where_no_flip_lowers_the_peak(problem, plan):
    """The descent by peak alone: stops at the first plan no single flip lowers."""
    movable = savable(problem)
    while True:
        live = plan.timeline.live_at_peak
        flips = [
            i
            for i in sorted(plan.saved | plan.recomputed)
            if i in movable and problem.storage[i] in live and problem.nodes[i].recomputable
        ]
        trials = [evaluate(problem, plan.saved ^ {i}, solver="t") for i in flips]
        best = min(trials, key=lambda t: t.peak, default=plan)
        if best.peak >= plan.peak:
            return plan
        plan = best


def test_descend_crosses_a_plateau_where_no_single_flip_lowers_the_peak():
    """Two steps at the same peak: lowering either alone leaves the peak where it is, so
    a descent by peak alone stops; lowering the memory summed over the steps gets past."""
    problem = random_joint(30, 2)
    start = evaluate(problem, without_free_views(problem, store_all(problem).saved), solver="t")
    stuck = _stuck_where_no_flip_lowers_the_peak(problem, start)
    assert descend(problem, start, -1).peak < stuck.peak


def _chain_read_through_views(layers: int = 6, size: int = 1000) -> Problem:
    """Each activation is read by the backward directly and through a free view of it
    (as attention probabilities are, by softmax's and bmm's backwards)."""
    nodes = [Node("x", "fwd", size, 1.0)]
    for k in range(1, layers + 1):
        nodes.append(Node(f"a{k}", "fwd", size, 1.0, (len(nodes) - 1,)))
        nodes.append(Node(f"v{k}", "fwd", 0, 0.0, (len(nodes) - 1,), alias_of=len(nodes) - 1))
    nodes.append(Node("loss", "fwd", 4, 1.0, (len(nodes) - 2,)))
    loss = len(nodes) - 1
    nodes.append(Node("tangent", "bwd", 4))
    grad = len(nodes) - 1
    for k in range(layers, 0, -1):
        a, v = 2 * k - 1, 2 * k
        nodes.append(Node(f"g{k}", "bwd", size, 1.0, (grad, a, v)))
        grad = len(nodes) - 1
    return Problem(nodes, outputs=(loss,), grads=(grad,))


def test_dropping_saves_frees_storages_also_saved_through_views():
    """Store-all saves each activation and its view; dropping either alone frees nothing,
    so the greedy must treat saving the view as saving its base to get anywhere."""
    problem = _chain_read_through_views()
    trajectory = _drop_saves(problem)
    assert trajectory[-1].peak < store_all(problem).peak
    assert greedy(problem).peak <= trajectory[-1].peak
