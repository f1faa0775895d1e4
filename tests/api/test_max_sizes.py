"""A declared maximum (``optimize(..., max_sizes=...)``, docs/guide.md "A declared
maximum"): the declared dimensions are symbolic from the first call, so the model is traced
once and planned once, at the maxima; every step up to them keeps the budget and trains
as eager does; a call above a maximum and a declaration that does not fit are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat import memory
from remat.solvers import store_all
from remat.tools import examples

WIDTH = 64
ROWS = [96, 40, 160, 24, 200]  # rows per batch; the maximum (256) arrives last


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


def _step(params, run) -> tuple[int, list[torch.Tensor]]:
    """One forward and backward (``run``): its measured peak and the gradients."""
    for p in params:
        p.grad = None
    peak = memory.peak(run).peak_bytes
    return peak, [p.grad.clone() for p in params]


def _same(grads, expected) -> bool:
    pairs = zip(grads, expected, strict=True)
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)


def _data(rows: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))


def test_a_fraction_is_of_the_store_all_peak_at_the_declared_maximum():
    torch.compiler.reset()
    net = _net()

    def loss(x):
        return net(x).square().mean()

    step = remat.optimize(loss, budget=0.6, cache=False, max_sizes={"x": (256, None)})
    step(_data(ROWS[0])).backward()  # traced and planned here, outside a profiler
    rb = step.remat
    limit = rb.report().steps[0].limit
    for rows in [*ROWS, 256]:
        x = _data(rows)
        peak, grads = _step(list(net.parameters()), lambda x=x: step(x).backward())
        expected = _step(list(net.parameters()), lambda x=x: loss(x).backward())[1]
        assert peak <= limit, (rows, peak, limit)
        assert _same(grads, expected), rows
    assert rb.compiles == 1  # one trace for every size
    [graph] = rb.graphs  # planned once, at the maximum, though 96 rows came first
    assert [v for _, v in graph.binding] == [256]
    first = rb.report().steps[0]
    assert first.limit == int(0.6 * store_all(first.composed.problem).peak)
    # a step larger than any measured is recorded and its plan checked, not solved again
    assert all(s.programs == first.programs for s in rb.report().steps)
    with pytest.raises(remat.SizeAboveMaximum, match="x has size 300 at dimension 0.*256"):
        step(_data(300))
    step(_data(64)).backward()  # refused before anything ran: the model still trains
    assert rb.compiles == 1
    torch.compiler.reset()


def test_memory_of_code_outside_the_graph_is_measured_at_the_larger_sizes():
    torch.compiler.reset()
    net = _net()
    params = list(net.parameters())
    budget = 400_000  # bytes: binding at 256 rows, where the outside square holds 64 KiB
    forward = remat.optimize(net, budget=budget, cache=False, max_sizes={"input": {0: 256}})

    def outside_loss(model, x):
        return lambda: (model(x) ** 2).mean().backward()

    forward(_data(ROWS[0])).sum().backward()  # traced and planned outside a profiler
    for rows in [*ROWS, 256]:
        x = _data(rows)
        peak, grads = _step(params, outside_loss(forward, x))
        assert peak <= budget, (rows, peak)
        assert _same(grads, _step(params, outside_loss(net, x))[1]), rows
    report = forward.remat.report()
    assert forward.remat.compiles == 1 and len(report.graphs) == 1
    assert [v for b in report.steps[-1].bindings for v in b.values()] == [256]
    torch.compiler.reset()


def test_plan_and_a_backend_given_marked_sizes_plan_at_the_maximum():
    torch.compiler.reset()
    net = _net()
    report = remat.plan(
        net, (_data(40),), budget=0.8, cache=False, max_sizes={"input": (256, None)}
    )
    assert [[v for _, v in g.binding] for g in report.graphs] == [[256]]
    torch.compiler.reset()
    rb = remat.backend(budget=0.8, cache=False)  # torch.compile's path: the user marks sizes
    compiled = torch.compile(net, backend=rb)
    x = _data(40)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=256)
    compiled(x).sum().backward()
    assert [[v for _, v in g.binding] for g in rb.graphs] == [[256]]
    torch.compiler.reset()


@pytest.mark.slow
def test_a_model_declared_at_its_longest_length_plans_once_and_keeps_an_absolute_budget():
    torch.compiler.reset()
    gpt = dict(layers=2, d_model=32, heads=2, seq=128, batch=2, vocab=64, dropout=0.0)
    model, inputs = examples.load("gpt", **gpt)
    budget = 1_000_000  # bytes: binding from about 75 tokens (at 120: store-all 1.73 MB)
    # positional arguments by their names in GPT.forward(idx, targets); both forms
    max_sizes = {"idx": (None, 120), "targets": {1: 120}}
    optimized = remat.optimize(model, budget=budget, cache=False, max_sizes=max_sizes)

    def batch(length):
        return tuple(t[:, :length].contiguous() for t in inputs)

    optimized(*batch(40)).backward()  # the one trace, outside a profiler
    params = list(model.parameters())
    for length in [64, 24, 80, 33, 96, 57, 12, 120]:  # the maximum last
        args = batch(length)
        peak, grads = _step(params, lambda a=args: optimized(*a).backward())
        expected = _step(params, lambda a=args: model(*a).backward())[1]
        assert peak <= budget, (length, peak)
        assert _same(grads, expected), length
    rb = optimized.remat
    assert rb.compiles == 1
    [graph] = rb.graphs
    assert [v for _, v in graph.binding] == [120]
    steps = rb.report().steps
    assert all(s.programs == steps[0].programs for s in steps)
    torch.compiler.reset()


def _loss(x):
    return x.square().mean()


@pytest.mark.parametrize(
    ("max_sizes", "match"),
    [
        (["x"], "maps argument names"),
        ({0: (8, None)}, "keyed by argument name"),
        ({"y": (8, None)}, r"'y', which _loss\(x\) does not take: name one of its arguments \(x\)"),
        ({"x": (8, "64")}, "a maximum is an int of at least 2"),
        ({"x": (8, 1)}, "a maximum is an int of at least 2"),
        ({"x": {1.5: 8}}, "dimensions are ints"),
        ({"x": (None, None)}, "declares no maximum"),
        ({"x": "8"}, "must be a maximum shape"),
    ],
)
def test_a_declaration_that_cannot_be_read_is_refused_when_optimizing(max_sizes, match):
    with pytest.raises(remat.InvalidOption, match=match):
        remat.optimize(_loss, budget=0.5, cache=False, max_sizes=max_sizes)


@pytest.mark.parametrize(
    ("max_sizes", "error", "match"),
    [
        ({"x": {2: 8}}, remat.InvalidOption, r"dimension 2, but _loss got a 2-dimensional x"),
        ({"x": (8, None, 8)}, remat.InvalidOption, "shape of 3 dimensions"),
        ({"x": (4, None)}, remat.SizeAboveMaximum, "x has size 8 at dimension 0, above its"),
    ],
)
def test_a_declaration_that_does_not_fit_the_call_is_refused_before_it_runs(
    max_sizes, error, match
):
    torch.compiler.reset()
    step = remat.optimize(_loss, budget=0.5, cache=False, max_sizes=max_sizes)
    with pytest.raises(error, match=match):
        step(torch.randn(8, 4, requires_grad=True))
    assert not step.remat.compiles  # nothing traced


def test_a_maximum_the_model_does_not_take_is_refused_with_the_guard_that_limits_it():
    torch.compiler.reset()
    table = nn.Parameter(torch.ones(64, 4))  # rows for at most 64 positions

    def positions(x):
        return (x * table[: x.shape[0]]).square().mean()

    step = remat.optimize(positions, budget=1.0, cache=False, max_sizes={"x": (100, None)})
    with pytest.raises(remat.InvalidOption, match=r"does not take every size.*<= 64"):
        step(torch.randn(40, 4))
    torch.compiler.reset()


def test_a_batch_of_one_is_traced_apart_and_larger_ones_keep_the_declared_trace():
    torch.compiler.reset()
    step = remat.optimize(_loss, budget=1.0, cache=False, max_sizes={"x": (100, None)})
    for rows in (40, 1, 70):
        step(torch.randn(rows, 4, requires_grad=True)).backward()
    assert [[v for _, v in g.binding] for g in step.remat.graphs] == [[100], []]
    torch.compiler.reset()


def test_a_declared_maximum_needs_symbolic_sizes():
    with pytest.raises(remat.InvalidOption, match="dynamic=False forbids"):
        remat.optimize(_loss, budget=0.5, max_sizes={"x": (8, None)}, dynamic=False)
