"""``remat.costs.CostModel`` and the ``COST_MODELS`` registry: one list of names for every
caller; a graph's seconds from the roofline, or measured where asked."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from sample_graphs import CPU, _calls, _fake_graph, aten

from remat import costs
from remat.costs import (
    estimate_seconds,
)


def test_cost_model_names_are_checked_against_one_registry():
    from remat.errors import InvalidOption
    from remat.tools import bench, cli

    COST_MODELS = costs.COST_MODELS
    assert cli.COST_MODELS is bench.COST_MODELS is COST_MODELS == ("roofline", "profile")
    assert all(costs.check_cost_model(name) == name for name in COST_MODELS)
    with pytest.raises(InvalidOption, match="'guess'; choose one of roofline, profile"):
        costs.check_cost_model("guess")
    with pytest.raises(ValueError):  # what callers caught before InvalidOption existed
        costs.CostModel.for_graph("guess", fx.GraphModule({}, fx.Graph()), torch.device("cpu"))


def test_cost_model_for_graph_times_kernels_only_when_profiling():
    gm = _fake_graph(lambda g, x: g.call_function(aten.relu.default, (x,)), torch.randn(64))
    (relu,) = _calls(gm)
    cpu = torch.device("cpu")
    roofline = costs.CostModel.for_graph("roofline", gm, cpu)
    assert roofline.measured == {} and roofline.spec == CPU
    assert roofline.seconds(relu) == estimate_seconds(relu, CPU)
    profiled = costs.CostModel.for_graph("profile", gm, cpu)
    assert profiled.seconds(relu) == profiled.measured[relu.name] > 0
    assert profiled.allocated_bytes(relu) == 64 * 4 and profiled.recomputable(relu)
