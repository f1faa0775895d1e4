"""The step-time cost model (inductor's fusion, what a saved storage costs) and torch's
own partition as a candidate plan, on real joint graphs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat import costs
from remat.candidates import TORCH_CANDIDATE
from remat.errors import InvalidOption
from remat.passes.min_cut import torch_saved
from remat.planner import Planner
from remat.solvers import SOLVERS, Budget, InfeasibleBudget, evaluate, saved_bytes, store_all
from remat.solvers.cpsat import GAP_LIMIT

aten = torch.ops.aten
CPU = torch.device("cpu")


class GeluMLP(nn.Module):
    """Wide pointwise chains between matmuls: what torch's min-cut recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 256), nn.Linear(256, 32)

    def forward(self, x):
        h = self.up(x)
        h = 0.5 * h * (1 + torch.tanh(0.79788456 * (h + 0.044715 * h.pow(3))))
        return F.mse_loss(self.down(h), x)


@pytest.fixture(scope="module")
def joint():
    """(joint graph, num_fwd_outputs) of GeluMLP's step, traced once."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    captured = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured["joint"] = copy.deepcopy(joint)
        captured["n"] = num_fwd_outputs
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GeluMLP()
    backend = aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition)
    torch.compile(model, backend=backend, dynamic=False)(torch.randn(64, 32)).backward()
    torch._dynamo.reset()
    return captured["joint"], captured["n"]


def plan_of(joint, budget, compiler):
    graph, n = joint
    planner = Planner(Budget.parse(budget), compiler=compiler)
    return planner.plan(copy.deepcopy(graph), n).record


def test_inductor_runs_a_pointwise_op_inside_its_reader_and_a_matmul_alone(joint):
    graph, _ = joint
    eager = costs.CostModel.for_graph("roofline", graph, CPU, "eager")
    inductor = costs.CostModel.for_graph("roofline", graph, CPU, "inductor")
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    tanh = next(n for n in calls if n.target is aten.tanh.default)
    mm = next(n for n in calls if n.target in (aten.addmm.default, aten.mm.default))
    assert inductor.fused(tanh)  # read by pointwise ops only
    assert inductor.seconds(tanh) == costs.fused_seconds(tanh, inductor.spec)
    assert inductor.seconds(tanh) < eager.seconds(tanh) / 10
    assert not inductor.fused(mm) and inductor.seconds(mm) == eager.seconds(mm) > 0
    # the GELU's last multiply feeds the down projection: written out, fused or not
    gelu_out = next(u for u in mm.users if u.target is aten.mul.Tensor)
    while any(u.target is aten.mul.Tensor for u in gelu_out.users):
        gelu_out = next(u for u in gelu_out.users if u.target is aten.mul.Tensor)
    assert not inductor.fused(gelu_out)
    assert inductor.save_seconds(tanh, 1 << 20) == 2 * eager.save_seconds(tanh, 1 << 20) > 0
    assert inductor.save_seconds(mm, 1 << 20) == eager.save_seconds(mm, 1 << 20)
    with pytest.raises(InvalidOption, match="compiler must be one of"):
        costs.CostModel.for_graph("roofline", graph, CPU, "tvm")


def test_save_costs_sit_on_storage_owners_only(joint):
    problem = plan_of(joint, 1.0, "eager").extracted.problem
    for node in problem.nodes:
        if node.alias_of is not None or problem.outputs_of[problem.nodes.index(node)]:
            assert node.save_cost == 0, node.name
        elif node.phase == "fwd" and node.bytes:
            assert node.save_cost > 0, node.name


def test_under_inductor_budget_1_keeps_less_than_everything_when_that_is_faster(joint):
    graph = plan_of(joint, 1.0, "inductor")
    problem, plan = graph.extracted.problem, graph.plan
    full = store_all(problem)
    assert plan.cost < full.cost
    # the pointwise chain is rebuilt inside its readers, not kept
    assert graph.saved_bytes < saved_bytes(problem, full)
    assert graph.step_seconds < sum(n.cost for n in problem.nodes) + full.cost


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("budget", [1.0, 0.9])
def test_remat_is_never_costlier_than_torchs_partition_where_it_fits(joint, compiler, budget):
    graph = plan_of(joint, budget, compiler)
    saved = torch_saved(joint[0], joint[1], graph.extracted)
    assert saved is not None and saved
    theirs = evaluate(graph.extracted.problem, saved, solver="torch")
    if theirs.peak <= graph.limit:  # taken where cheaper, unless proven within the limit
        assert graph.plan.cost <= theirs.cost / (1 - GAP_LIMIT) + 1e-12
    else:  # at 0.9 torch's partition peaks over the limit: never taken, remat's plan fits
        assert graph.plan.solver != TORCH_CANDIDATE and graph.plan.peak <= graph.limit


def _store_all_bytes(joint) -> int:
    """The store-all peak in bytes: a budget store-all fits, where a fraction is of torch's
    partition where that peaks lower (``test_a_fraction_is_of_torchs_partition_...``). The
    plan made meanwhile is forgotten, not offered to the test's own."""
    from remat import candidates

    graph, n = joint
    planner = Planner(Budget.parse(1.0), solver="store-all", compiler="inductor")
    peak = planner.plan(copy.deepcopy(graph), n).record.plan.peak
    candidates.forget_made()
    return peak


def test_torchs_partition_is_taken_where_the_solver_does_worse(joint, monkeypatch):
    budget = _store_all_bytes(joint)
    monkeypatch.setitem(SOLVERS, "auto", SOLVERS["store-all"])  # a solver that saves all
    graph = plan_of(joint, budget, "inductor")
    assert graph.plan.solver == TORCH_CANDIDATE
    assert graph.plan.cost < store_all(graph.extracted.problem).cost


def test_a_fraction_is_of_torchs_partition_where_that_peaks_below_store_all(joint):
    """Budget 1.0 is at most what torch's own partition holds: the limit is its peak where
    that is below the store-all peak, and the plan fits it at no more cost."""
    graph = plan_of(joint, 1.0, "eager")
    full = store_all(graph.extracted.problem)
    assert graph.theirs is not None and graph.theirs.peak < full.peak
    assert graph.limit == graph.theirs.peak
    assert graph.plan.peak <= graph.limit and graph.plan.cost <= graph.theirs.cost
    try:
        limit = plan_of(joint, 0.9, "eager").limit
    except InfeasibleBudget as refusal:  # below what remat reaches: the refusal's limit
        limit = refusal.limit
    assert limit == int(0.9 * graph.theirs.peak)


def test_a_restart_reads_torchs_partition_from_the_plan_cache(joint, tmp_path, monkeypatch):
    """torch's partition is computed once per graph, not again in each process."""
    from remat import cache, candidates

    graph, n = joint
    calls = []

    def counted(*args):
        calls.append(1)
        return torch_saved(*args)

    budget = _store_all_bytes(joint)
    monkeypatch.setattr(candidates, "torch_saved", counted)
    monkeypatch.setitem(SOLVERS, "auto", SOLVERS["store-all"])  # never proven within 1%
    plans = []
    for _ in range(2):  # two processes sharing one folder
        candidates.forget_made()
        run = Planner(Budget.parse(budget), compiler="inductor", cache=cache.PlanCache(tmp_path))
        plans.append(run.plan(copy.deepcopy(graph), n).record.plan)
    assert len(calls) == 1 and run.cache.counts["candidates hit"] == 1
    assert plans[0].solver == plans[1].solver == TORCH_CANDIDATE
    assert plans[0].saved == plans[1].saved
    # a damaged entry is partitioned again, never trusted
    (entry,) = tmp_path.glob("candidates-*.json")
    entry.write_text('{"format": 1, "key": "x"}')
    run = Planner(Budget.parse(budget), compiler="inductor", cache=cache.PlanCache(tmp_path))
    again = run.plan(copy.deepcopy(graph), n).record.plan
    assert len(calls) == 2 and again.saved == plans[0].saved


def test_a_larger_budget_is_never_planned_slower_than_a_smaller_one(joint, monkeypatch):
    """A plan made under a smaller budget is a candidate under a larger one: a solver that
    answers the larger budget worse (here: with the lowest-peak plan) is overruled."""
    from remat.solvers.solve import min_peak_plan

    smaller = plan_of(joint, 0.85, "eager")

    def lowest(problem, limit, **_):
        return dataclasses.replace(min_peak_plan(problem), limit=limit)

    monkeypatch.setitem(SOLVERS, "auto", lowest)
    larger = plan_of(joint, 0.95, "eager")
    assert larger.limit > smaller.limit
    assert larger.plan.cost <= smaller.plan.cost + 1e-12
    assert larger.plan.cost < min_peak_plan(larger.extracted.problem).cost
