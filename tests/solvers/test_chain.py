"""Chains of stages, multiple recomputation, and the sqrt and revolve schedules on them."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from synthetic import chain, layered, random_joint

from remat.solvers import (
    InfeasibleBudget,
    InvalidPlan,
    evaluate,
    greedy,
    min_peak_plan,
    schedule,
    solve,
    store_all,
)
from remat.solvers.chain import (
    Revolve,
    binomial_forward_steps,
    find_chain,
    revolve,
    sqrt,
    sqrt_actions,
)

simulate_module = importlib.import_module("remat.solvers.simulate")


# ----------------------------------------------------------------------------- revolve's table


@pytest.mark.parametrize("slots", range(1, 9))
def test_revolve_meets_the_binomial_optimum_on_uniform_chains(slots):
    """Griewank's closed form t n - C(s + t, t - 1), for every chain length up to 80."""
    table = Revolve([0.0] + [1.0] * 80, slots)
    for n in range(1, 81):
        part = Revolve([0.0] + [1.0] * n, slots)
        actions = part.actions(slots)
        advanced = sum(a[2] - a[1] for a in actions if a[0] == "advance")
        assert part.cost(slots) == advanced == binomial_forward_steps(n, slots), (n, slots)
    assert table.cost(slots) == binomial_forward_steps(80, slots)


@pytest.mark.parametrize(("n", "slots"), [(1, 1), (5, 1), (12, 3), (30, 4), (64, 6)])
def test_revolve_reverses_every_stage_once_holding_at_most_its_slots(n, slots):
    actions = Revolve([0.0] + [1.0] * n, slots).actions(slots)
    assert [a[1] for a in actions if a[0] == "back"] == list(range(n, 0, -1))
    assert [a[1] for a in actions if a[0] == "tape"] == list(range(n, 0, -1))
    # a boundary is held from the advance that makes it to its last use (as an advance's
    # start, or the start of its stage's tape) before it is made again
    events = []  # (position, boundary, "make" | "use")
    for k, action in enumerate(actions):
        if action[0] == "advance":
            events += [(k, action[1], "use"), (k, action[2], "make")]
        elif action[0] == "tape":
            events.append((k, action[1] - 1, "use"))
    spans, made = [], {0: -1}
    last_use: dict[int, int] = {}
    for k, b, kind in events:
        if kind == "make":
            if b in made:
                spans.append((made[b], last_use.get(b, made[b])))
            made[b], last_use[b] = k, k
        else:
            last_use[b] = k
    spans += [(made[b], last_use.get(b, made[b])) for b in made]
    most = max(sum(1 for a, z in spans if a <= k <= z) for k in range(len(actions)))
    assert most <= slots + 1  # the slots, and the state being advanced


def test_revolve_is_cheaper_where_stages_cost_less():
    """Heterogeneous costs: the table advances over cheap stages rather than dear ones."""
    uniform = Revolve([0.0] + [1.0] * 20, 2).cost(2)
    skewed = Revolve([0.0] + [1.0] * 10 + [0.01] * 10, 2).cost(2)
    assert skewed < uniform


def test_sqrt_actions_tape_segments_from_stored_boundaries():
    actions = sqrt_actions(9, 3)
    assert actions[:2] == [("advance", 0, 3), ("advance", 3, 6)]
    assert [a for a in actions if a[0] == "back"] == [("back", k) for k in range(9, 0, -1)]


# ----------------------------------------------------------------------------- the simulator


@settings(max_examples=120, deadline=None)
@given(st.integers(4, 70), st.integers(0, 10_000), st.floats(0.3, 1.0))
@example(58, 272, 0.90625)  # a re-run multi-output op over an output handed over
@example(4, 917, 0.9375)  # ... over one freed already: a second buffer, not a live storage
def test_copies_walk_equals_the_vectorised_walk(n, seed, fraction):
    """Where no node runs twice, accounting by copies equals the vectorised accounting."""
    problem = random_joint(n, seed=seed)
    try:
        plan = greedy(problem, int(store_all(problem).peak * fraction))
    except InfeasibleBudget:
        plan = store_all(problem)
    sched, storage = plan.schedule, problem.storage
    held = {storage[i] for i in problem.outputs}
    fwd_keep = held | {storage[i] for i in sched.saved}
    bwd_keep = held | {storage[i] for i in problem.grads}
    run, copies = simulate_module._run, simulate_module._run_copies
    for args in (
        ("fwd", sched.forward, (), fwd_keep),
        ("bwd", sched.backward, tuple(fwd_keep), bwd_keep),
    ):
        a, b = run(problem, *args), copies(problem, *args)
        assert (a.peak, a.steps, a.live_at_peak) == (b.peak, b.steps, b.live_at_peak)


# ----------------------------------------------------------------------------- plans on chains


def test_chains_are_found_from_the_graph():
    problem = chain(12)
    found = find_chain(problem)
    assert found is not None and found.length >= 12
    assert find_chain(layered(2)) is None or find_chain(layered(2)).length >= 2


def test_revolve_goes_below_the_floor_of_single_recomputation():
    problem = chain(24)
    single = greedy(problem)  # the greedy's lowest peak
    plans = [revolve(problem, None, slots=s) for s in (1, 2, 3, 5)]
    assert plans[0].multiple and plans[0].peak < single.peak
    assert [p.peak for p in plans] == sorted(p.peak for p in plans)  # more slots, more bytes
    costs = [p.recompute_cost for p in plans]
    assert costs == sorted(costs, reverse=True)  # and less recomputation
    for plan in plans:  # each plan is its schedule: re-deriving it gives the same program
        again = evaluate(problem, plan.saved, backward=plan.schedule.backward, solver="x")
        assert (again.peak, again.schedule) == (plan.peak, plan.schedule)


def test_chain_solvers_keep_the_budget_and_name_their_floor():
    problem = chain(24)
    top = store_all(problem).peak
    for solver in (sqrt, revolve):
        plan = solver(problem, int(0.4 * top))
        assert plan.peak <= 0.4 * top
    with pytest.raises(InfeasibleBudget) as refused:
        revolve(problem, 1000)
    assert revolve(problem, refused.value.minimum).peak <= refused.value.minimum


def test_auto_falls_back_to_revolve_below_the_single_recomputation_floor():
    problem = chain(24)
    single = greedy(problem).peak
    floor = min_peak_plan(problem).peak
    assert floor < single
    plan = solve(problem, (single + floor) // 2, "auto")
    assert plan.multiple and plan.solver == "revolve" and plan.peak <= (single + floor) // 2
    with pytest.raises(InfeasibleBudget) as refused:
        solve(problem, floor - 1, "auto")
    assert refused.value.minimum == floor  # the new floor, and a retry there fits
    assert solve(problem, floor, "auto").peak <= floor


def test_a_given_order_is_checked():
    problem = chain(6)
    plan = revolve(problem, None, slots=1)
    order = plan.schedule.backward
    core = problem.backward_core[0]
    with pytest.raises(InvalidPlan, match="backward core"):
        schedule(problem, (), [i for i in order if i != core[0]])
    with pytest.raises(InvalidPlan, match="not have"):
        schedule(problem, (), (*order, len(problem.nodes)))
    fixed = (
        next(i for i in problem.forward_nodes if not problem.nodes[i].recomputable)
        if any(not problem.nodes[i].recomputable for i in problem.forward_nodes)
        else None
    )
    if fixed is not None:
        with pytest.raises(InvalidPlan, match="may not be recomputed"):
            schedule(problem, (), (fixed, *order))


def test_chain_solvers_refuse_a_graph_without_a_chain():
    from remat.solvers.chain import NotAChain

    problem = random_joint(40, seed=3)
    if find_chain(problem) is None:
        with pytest.raises(NotAChain, match="chain of stages"):
            revolve(problem, None)
