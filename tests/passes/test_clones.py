"""Identity clones: dropped where nothing can tell, kept where a copy is observable."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import remat
from remat import costs
from remat.passes.clones import drop_identity_clones
from remat.tools import examples

aten = torch.ops.aten


def _step(x, w):
    y = torch.mm(x, w)
    same = aten.clone.default(y)  # dropped: users see the same tensor
    flat = same.view(-1)  # a view of the clone: re-derived as a view of y
    relaid = aten.clone.default(y.t(), memory_format=torch.contiguous_format)  # a real copy
    weight = aten.clone.default(w)  # of a placeholder: a later copy_ could write w
    returned = aten.clone.default(y * 2)  # a graph output: the caller may write to it
    loss = flat.sum() + relaid.view(-1)[:3].sum() + weight.sum()
    return loss, returned


def _clones(gm):
    return gm.graph.find_nodes(op="call_function", target=aten.clone.default)


def test_only_unobservable_clones_are_dropped():
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    gm = make_fx(_step, tracing_mode="fake")(x, w)
    expected = _step(x, w)
    assert len(_clones(gm)) == 4
    assert drop_identity_clones(gm) == 1
    sources = {
        n.args[0].op if n.args[0].op == "placeholder" else n.args[0].target for n in _clones(gm)
    }
    assert sources == {aten.t.default, aten.mul.Tensor, "placeholder"}  # relaid, returned, weight
    for e, g in zip(expected, gm(x, w), strict=True):
        assert torch.equal(e, g)


def test_views_of_a_dropped_clone_alias_its_input():
    gm = make_fx(_step, tracing_mode="fake")(torch.randn(4, 3), torch.randn(3, 5))
    drop_identity_clones(gm)
    flat = next(
        n
        for n in gm.graph.find_nodes(op="call_function", target=aten.view.default)
        if n.args[0].target is aten.mm.default
    )
    assert costs.aliased_input(flat) is flat.args[0]  # the cost model sees a view of y
    assert costs.allocated_bytes(flat) == 0


def test_nothing_to_drop_leaves_the_graph_alone():
    gm = make_fx(lambda x: (x.sin() * 2,), tracing_mode="fake")(torch.randn(3))
    code = gm.code
    assert drop_identity_clones(gm) == 0 and gm.code == code


@pytest.mark.slow
def test_dropout_zero_costs_no_extra_copy():
    """dropout(p=0) decomposes to clone; eager returns its input. With the copies dropped,
    remat's store-all step measures eager's peak and computes eager's gradients."""
    model, inputs = examples.gpt(layers=1, d_model=32, heads=2, seq=64, batch=2, dropout=0.0)
    reference = copy.deepcopy(model)
    eager = remat.memory.peak(lambda: reference(*inputs).backward()).peak_bytes
    compiled = remat.optimize(copy.deepcopy(model), budget=1.0)
    compiled(*inputs).backward()  # compiles
    compiled.zero_grad(set_to_none=True)
    measured = remat.memory.peak(lambda: compiled(*inputs).backward()).peak_bytes
    assert measured <= eager + 1024
    grads = [p.grad for p in compiled.parameters()]
    for g, r in zip(grads, (p.grad for p in reference.parameters()), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
