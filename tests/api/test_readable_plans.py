"""A plan as a user reads it: each saved or recomputed value named by module path and op
(``PlanReport.values``), the report as numbers (``PlanReport.to_dict``) and the step's
memory over time (``PlanReport.timeline``), on Hugging Face GPT-2 built from a config."""

from __future__ import annotations

import json

import pytest
import torch
from torch import fx

import remat
from remat.values import module_paths, recomputed


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers", reason="the 'transformers' extra is not installed")
    from remat.tools.hf_models import hf_gpt2

    model, inputs = hf_gpt2(layers=2, d_model=32, heads=2, seq=16, vocab=64)
    report = remat.plan(model, inputs, budget=0.7, cache=False)
    return report


def test_recomputed_values_are_named_by_module_path_and_op(gpt2):
    values = gpt2.values()
    again = [v for v in values if v.kind == "recomputed"]
    saved = [v for v in values if v.kind == "saved"]
    step = gpt2.steps[0]
    # what the step's joint plan saves and runs again, every value listed once
    assert len(saved) == len(step.plan.saved) and len(again) == len(recomputed(step.plan))
    assert again and saved
    modules = {v.module for v in again}
    assert any("transformer.h.0.mlp" in m for m in modules), modules
    assert any("transformer.h.1." in m for m in modules), modules
    assert all(m.startswith("lm") for m in modules)  # the wrapper's attribute, not L['self']
    assert all("." not in v.op.partition("[")[0] for v in values)  # gelu, not gelu.default
    mlp = next(v for v in again if ".mlp." in v.module)
    assert str(mlp).startswith(f"{mlp.module}: {mlp.op} (recomputed, ")


def test_backward_nodes_take_their_forward_module(gpt2):
    """A layer norm's backward is named by the forward's module (``fwd_nn_module_stack``)."""
    fx_nodes = gpt2.graphs[0].extracted.fx_nodes
    paths = module_paths(fx_nodes[0].graph.nodes)
    backward = [n for n in fx_nodes if "native_layer_norm_backward" in str(n.target)]
    assert backward
    assert {paths[n].rpartition(".")[2] for n in backward} <= {"ln_1", "ln_2", "ln_f"}


def test_module_paths_read_dynamo_sources_and_fall_back():
    """Paths as dynamo writes them (a method's ``L['self']``, a function's global, items),
    a node without a stack by its ``seq_nr``, else by its reader; none: ""."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    a.meta.update(nn_module_stack={"k": ("L['self'].blocks[0]._modules['act']", None)}, seq_nr=7)
    b = graph.call_function(torch.neg, (a,))
    b.meta.update(seq_nr=7)  # a backward node of the same forward op, no stack of its own
    c = graph.call_function(torch.sin, (x,))  # inserted by a pass: no metadata
    d = graph.call_function(torch.add, (c, b))
    d.meta.update(fwd_nn_module_stack={"k": ("G['net'].head", None), "j": ("G['net']", None)})
    e = graph.call_function(torch.cos, (x,))
    paths = module_paths(graph.nodes)
    assert paths[a] == paths[b] == "blocks.0.act"
    assert paths[d] == "net" and paths[c] == "net"  # the innermost entry is the last
    assert paths[e] == ""


def test_to_dict_is_numbers(gpt2):
    data = json.loads(json.dumps(gpt2.to_dict()))  # JSON as it is
    assert set(data) == {
        "predicted_peak_bytes",
        "first_step_peak_bytes",
        "store_all_peak_bytes",
        "graphs",
        "steps",
    }
    assert data["predicted_peak_bytes"] == gpt2.predicted_peak == gpt2.steps[0].plan.peak
    assert data["store_all_peak_bytes"] == gpt2.store_all_peak
    (graph,) = data["graphs"]
    (step,) = data["steps"]
    ints = ("nodes", "limit_bytes", "predicted_peak_bytes", "store_all_peak_bytes",
            "saved_values", "saved_bytes", "recomputed_values", "recomputed_bytes")  # fmt: skip
    floats = ("recompute_seconds", "save_seconds", "recompute_overhead", "step_seconds",
              "plan_seconds", "solve_seconds")  # fmt: skip
    assert all(type(graph[k]) is int for k in ints), graph
    assert all(type(graph[k]) is float for k in floats), graph
    g = gpt2.graphs[0]
    assert graph["predicted_peak_bytes"] == g.plan.peak and graph["limit_bytes"] == g.limit
    assert graph["saved_bytes"] == g.saved_bytes and graph["name"] == "graph0"
    assert graph["solver"] == g.plan.solver and graph["gap"] == g.plan.gap
    assert step["graphs"] == ["graph0"]
    assert step["predicted_peak_bytes"] == gpt2.steps[0].plan.peak
    assert step["limit_bytes"] == gpt2.steps[0].limit
    value_keys = {"graph", "name", "module", "op", "bytes", "kind"}
    for values in (graph["values"], step["values"]):
        assert values and all(set(v) == value_keys and type(v["bytes"]) is int for v in values)
    assert {v["kind"] for v in step["values"]} == {"saved", "recomputed"}
    assert [v["name"] for v in step["values"]] == [v.name for v in gpt2.values()]


def test_timeline_peaks_are_the_plans(gpt2):
    timeline = gpt2.timeline()
    step = gpt2.steps[0]
    assert max(timeline.predicted) == timeline.predicted_peak == gpt2.predicted_peak
    assert max(timeline.store_all) == gpt2.store_all_peak == step.store_all_peak
    assert timeline.limit == step.limit and timeline.predicted_peak <= timeline.limit
    # recomputation runs more ops; the backward starts after the forward's
    assert len(timeline.predicted) > len(timeline.store_all)
    assert 0 < timeline.predicted_backward < len(timeline.predicted)
    data = timeline.to_dict()
    assert data["predicted"]["bytes"] == list(timeline.predicted)
    assert data["store_all"]["peak_bytes"] == gpt2.store_all_peak


def test_values_before_a_step_ended_are_each_graphs():
    """Under ``optimize``, before the first backward, no step is planned yet: the values
    are those of each graph's own plan."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    step = remat.optimize(lambda x: net(x).tanh().sum(), budget=1.0, cache=False)
    step(torch.randn(256, 64))
    report = step.remat.report()
    assert not report.steps
    values = report.values()
    assert values and {v.graph for v in values} == {"graph0"}
    assert len(values) == len(report.graphs[0].plan.saved) + len(recomputed(report.graphs[0].plan))
    modules = {v.module for v in values}
    assert "net.1" in modules and modules <= {"net.0", "net.1", "net.2", ""}, modules
