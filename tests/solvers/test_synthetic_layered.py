"""``synthetic.layered``: a valid, deterministic transformer joint graph that the
heuristics plan correctly (every schedule checked by the oracle)."""

from __future__ import annotations

import oracle
import pytest
from synthetic import layered

from remat.solvers import greedy, solve, store_all


def test_is_a_transformer_shaped_joint_graph():
    problem = layered(3)  # Problem validates inputs, phases, views and multi-output parts
    nodes = problem.nodes
    assert [n.name for n in nodes if n.phase == "bwd" and not n.inputs] == ["tangent"]
    assert [nodes[i].name for i in problem.outputs] == ["loss"]
    assert all(nodes[i].phase == "bwd" for i in problem.grads)
    # 4 matmul weights + 2 layer norms per layer, and the embedding
    assert len(problem.grads) == 6 * 3 + 1
    views = [n for n in nodes if n.alias_of is not None]
    assert len(views) == 3 * 3 and all(n.bytes == 0 and n.op == "view" for n in views)
    fixed = {n.name for n in nodes if not n.recomputable}
    assert fixed == {f"L{k}.dropout{s}" for k in range(3) for s in ("", ".drop", ".mask")}
    # the attention scores are the largest activations, the matmuls the costliest nodes
    biggest = max(n.bytes for n in nodes)
    assert {"L0.scores", "L0.softmax", "L0.dropout.drop"} <= {
        n.name for n in nodes if n.bytes == biggest
    }
    costliest = max(range(len(nodes)), key=lambda i: nodes[i].cost)
    assert nodes[costliest].op in ("mm", "bmm") or "_bw" in nodes[costliest].name


def test_node_count_is_linear_in_layers():
    sizes = {k: len(layered(k)) for k in (1, 2, 5, 12)}
    assert all(sizes[k] == 44 * k + 5 for k in sizes)
    assert len(layered(12).forward_nodes) == 22 * 12 + 2


def test_deterministic_per_seed():
    assert layered(4, seed=7) == layered(4, seed=7)
    a, b = layered(4, seed=0), layered(4, seed=1)
    assert a != b
    # the seed jitters costs only: structure and bytes are the same
    strip = [(n.name, n.phase, n.bytes, n.inputs, n.alias_of, n.output_of) for n in a.nodes]
    assert strip == [(n.name, n.phase, n.bytes, n.inputs, n.alias_of, n.output_of) for n in b.nodes]
    ratios = [x.cost / y.cost for x, y in zip(a.nodes, b.nodes, strict=True) if y.cost]
    assert all(0.9 / 1.1 <= r <= 1.1 / 0.9 for r in ratios)


def check(problem, plan):
    assert plan.peak == plan.timeline.peak
    mem = oracle.check(problem, plan.schedule, plan.timeline)
    assert not mem.reallocated, mem.reallocated


@pytest.mark.parametrize("layers", [1, 6])
def test_heuristic_plans_are_valid(layers):
    problem = layered(layers, width=64, seq=64)
    full = store_all(problem)
    check(problem, full)
    lowest = greedy(problem)
    check(problem, lowest)
    assert lowest.peak < full.peak


def test_half_of_store_all_is_feasible():
    problem = layered(6)
    full = store_all(problem)
    budget = full.peak // 2
    plan = solve(problem, budget, solver="greedy")
    check(problem, plan)
    assert plan.peak <= budget and plan.recompute_cost > 0 and plan.recomputed
