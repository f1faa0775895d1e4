"""Input sizes that change every batch (docs/guide.md, "Sizes that vary"): dynamo traces
the graph once more with them symbolic, remat plans it at the largest sizes it has run
at and again, without a trace, when larger ones come; every step keeps the budget and
trains as eager does."""

from __future__ import annotations

import pytest
import torch

import remat
from remat import memory
from remat.solvers import store_all
from remat.tools import examples

# seq is the longest length the model takes (its causal mask): at exactly that length
# the mask slice is a no-op that dynamo guards on, one more trace; the lengths stay below
GPT = dict(layers=2, d_model=32, heads=2, seq=128, batch=2, vocab=64, dropout=0.0)
# more distinct lengths than dynamo's recompile limit (8): a trace per length would fail
LENGTHS = [40, 64, 24, 80, 33, 96, 57, 12, 88, 71, 96, 20]


def _batch(inputs, length: int, batch: int | None = None):
    return tuple(t[:batch, :length].contiguous() for t in inputs)


def _step(model, fn, batch) -> tuple[int, list[torch.Tensor]]:
    """One forward and backward of ``fn``: its measured peak and the gradients."""
    for p in model.parameters():
        p.grad = None
    peak = memory.peak(lambda: fn(*batch).backward()).peak_bytes
    return peak, [p.grad.clone() for p in model.parameters()]


def _same(grads, expected) -> bool:
    pairs = zip(grads, expected, strict=True)
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)


@pytest.mark.slow
def test_lengths_that_vary_are_traced_twice_and_every_step_keeps_an_absolute_budget():
    torch._dynamo.reset()
    model, inputs = examples.load("gpt", **GPT)
    budget = 1_000_000  # bytes: binding from about 75 tokens (at 96: store-all 1.30 MB)
    optimized = remat.optimize(model, budget=budget, cache=False)
    for length in LENGTHS[:2]:  # the static trace, then the symbolic one (outside a profiler)
        optimized(*_batch(inputs, length)).backward()
    rb = optimized.remat
    for length in LENGTHS:  # the first step at each larger length is planned inside it
        batch = _batch(inputs, length)
        peak, grads = _step(model, optimized, batch)
        eager_peak, expected = _step(model, model, batch)
        assert peak <= budget, (length, peak)
        assert _same(grads, expected), length
        assert length < 80 or peak < eager_peak, (length, peak, eager_peak)
    assert {g.name for g in rb.graphs} == {"graph0", "graph1"}  # twelve lengths, two traces
    symbolic = [g for g in rb.graphs if g.binding]
    assert {g.name for g in symbolic} == {"graph1"}
    assert [dict(g.binding)[symbolic[0].binding[0][0]] for g in symbolic] == [64, 80, 96]
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_fraction_is_of_the_store_all_peak_at_the_largest_sizes_planned_for():
    torch._dynamo.reset()
    model, inputs = examples.load("gpt", **GPT)
    optimized = remat.optimize(model, budget=0.7, cache=False, dynamic=True)
    for length in (48, 32, 96, 64):
        optimized(*_batch(inputs, length)).backward()
    report = optimized.remat.report()
    assert {g.name for g in report.graphs} == {"graph0"}  # one trace, symbolic from the first
    for step in report.steps:
        assert step.limit == int(0.7 * store_all(step.composed.problem).peak)
    latest = report.steps[-1]
    assert max(v for b in latest.bindings for v in b.values()) == 96
    peak, grads = _step(model, optimized, _batch(inputs, 80))
    assert peak <= latest.limit  # a shorter batch runs the plan made at 96
    assert _same(grads, _step(model, model, _batch(inputs, 80))[1])
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_smaller_last_batch_is_a_size_that_varies_too():
    torch._dynamo.reset()
    model, inputs = examples.load("gpt", **{**GPT, "batch": 4})
    budget = 2_000_000
    optimized = remat.optimize(model, budget=budget, cache=False)
    # (a batch of one would be traced apart: dynamo keeps sizes 0 and 1 static)
    for length, batch in ((64, 4), (40, 4), (64, 3), (72, 2), (64, 2)):
        optimized(*_batch(inputs, length, batch)).backward()
    for length, batch in ((72, 4), (50, 3), (30, 2)):
        peak, grads = _step(model, optimized, _batch(inputs, length, batch))
        assert peak <= budget, (length, batch, peak)
        assert _same(grads, _step(model, model, _batch(inputs, length, batch))[1])
    # traced at its first sizes, then with the length symbolic, then the batch size too
    assert {g.name for g in optimized.remat.graphs} <= {"graph0", "graph1", "graph2"}
    torch._dynamo.reset()


class _Halves(torch.nn.Module):
    """Two stacks of narrow layers with a graph break between: a step of two graphs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _deep_mlp()[0][:8], _deep_mlp()[0][8:16]

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).square().mean()


@pytest.mark.slow
def test_a_step_of_two_graphs_keeps_the_budget_at_the_first_step_of_a_larger_size():
    torch._dynamo.reset()
    model, rows = _Halves(), torch.randn(1024, 64)
    budget = 2_000_000  # bytes: binding from about 450 rows (eager at 1024: 5.24 MB)
    optimized = remat.optimize(model, budget=budget, cache=False)
    for n in (300, 400):  # the static traces, then the symbolic ones (outside a profiler)
        optimized(rows[:n]).backward()
    for n in (800, 600, 1024, 700):  # 800 and 1024: each graph planned again mid-step
        peak, grads = _step(model, optimized, (rows[:n],))
        assert peak <= budget, (n, peak)  # the first graph kept the second room
        assert _same(grads, _step(model, model, (rows[:n],))[1]), n
    torch._dynamo.reset()


@pytest.mark.slow
def test_under_inductor_sizes_vary_as_under_eager():
    """Under ``compiler="inductor"`` the programs inductor compiled for the symbolic trace
    serve every size, and a larger size is planned again within its step, without a
    trace, as under the eager compiler."""
    torch._dynamo.reset()
    model, rows = _deep_mlp()
    budget = 3_000_000  # bytes: binding from about 700 rows (eager at 1024: 4.46 MB)
    optimized = remat.optimize(model, budget=budget, cache=False, compiler="inductor")
    for n in (300, 400, 480, 512, 800, 600, 1024):  # static at 300, symbolic from 400
        _inductor_step_keeps(model, optimized, rows[:n], budget)
    # two traces; the symbolic one planned at its first size and at each larger one
    assert _planned_at(optimized) == [[], [400], [480], [512], [800], [1024]]
    assert {g.name for g in optimized.remat.graphs} == {"graph0", "graph1"}
    torch._dynamo.reset()


@pytest.mark.slow
def test_under_inductor_a_program_compiled_after_the_trace_may_run_op_by_op(monkeypatch, caplog):
    """Where inductor's compile of a program made after dynamo's trace guards its sizes,
    nothing would check those guards, so the program runs op by op (its views made
    reshapes, as under eager): here every such compile is taken to guard."""
    from remat.passes._torch_compat import CompileContext
    from remat.runtime import programs

    real = programs.inductor_program

    def guarded(gm, **kwargs):
        return real(gm, **kwargs) if CompileContext.current_compile_id() else None

    monkeypatch.setattr(programs, "inductor_program", guarded)
    torch._dynamo.reset()
    model, rows = _deep_mlp()
    budget = 3_000_000
    optimized = remat.optimize(model, budget=budget, cache=False, compiler="inductor")
    with caplog.at_level("INFO", logger="remat"):
        for n in (300, 400, 800, 1024):
            _inductor_step_keeps(model, optimized, rows[:n], budget)
    assert any("runs op by op" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()


@pytest.mark.slow
def test_under_inductor_a_declared_maximum_is_traced_and_planned_once():
    torch._dynamo.reset()
    model, rows = _deep_mlp()
    budget = 3_000_000
    optimized = remat.optimize(
        model, budget=budget, cache=False, compiler="inductor", max_sizes={"input": {0: 1024}}
    )
    for n in (300, 800, 1024, 500):
        _inductor_step_keeps(model, optimized, rows[:n], budget)
    assert _planned_at(optimized) == [[1024]]
    torch._dynamo.reset()


def _planned_at(optimized) -> list[list[int]]:
    """Per graph remat planned, the sizes its symbols were bound to."""
    return [sorted(dict(g.binding).values()) for g in optimized.remat.graphs]


def _deep_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """Eight narrow layers: activations outweigh the weights, so a budget binds."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 1)), torch.randn(1024, 64)


def _inductor_step_keeps(model, optimized, rows: torch.Tensor, budget: int) -> None:
    """A step at ``rows`` (the one that compiles or plans runs first, outside a profiler)
    keeps the budget with eager's gradients."""
    optimized(rows).sum().backward()
    peak, grads = _step(model, lambda x: optimized(x).sum(), (rows,))
    assert peak <= budget, (len(rows), peak)
    expected = _step(model, lambda x: model(x).sum(), (rows,))[1]
    pairs = zip(grads, expected, strict=True)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs), len(rows)
