"""Budget 1.0 is at most the program as given: the module's eager step, run under fake
tensors before the first training call (``remat.as_given``), caps what a fraction is of
where the compiled program would store more than eager holds."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import remat
from remat import memory
from remat.as_given import eager_phases

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class TwoPaths(torch.nn.Module):
    """Runs its blocks two ways, as transformers' Mamba scans (a parallel scan when dynamo
    traces it, a loop eagerly): compiled, plainly; eagerly, each block checkpointed
    (``torch.utils.checkpoint``), which dynamo never sees. Equal values and gradients,
    far less memory eagerly."""

    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, 2 * width),
                torch.nn.GELU(),
                torch.nn.Linear(2 * width, width),
            )  # fmt: skip
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if torch.compiler.is_compiling():
                x = x + block(x)
            else:
                x = x + checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


def _step(fn, model, x) -> None:
    model.zero_grad(set_to_none=True)
    fn(x).backward()


def test_the_eager_step_under_fake_tensors_is_the_measured_one():
    """Its peak is what the eager step measures, less the scratch kernels allocate inside
    themselves (5,056 B of 6.3 MB here), which the planner adds from the graph's kernels
    as it measured them."""
    torch.manual_seed(0)
    model, x = TwoPaths(depth=3), torch.randn(512, 256)
    _step(model, model, x)
    measured = memory.peak(lambda: _step(model, model, x)).peak_bytes
    phases = eager_phases(model, (x,), {})
    assert 0.999 * measured <= max(phases.forward, phases.backward) <= measured


class Caching(torch.nn.Linear):
    """Counts its calls and keeps what it computed, as rotary tables and RNNs' flat
    weights are kept."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        self.last = super().forward(x)
        self.seen = [*getattr(self, "seen", []), self.last.shape]
        return self.last


def test_the_eager_step_under_fake_tensors_leaves_no_trace():
    """No gradient, the random state, the buffers and the modules' attributes as they
    were."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        Caching(128, 512), torch.nn.Dropout(0.1), torch.nn.BatchNorm1d(512),
        torch.nn.GRU(512, 64),
    )  # fmt: skip
    x = torch.randn(256, 128)
    net[0](x)
    state, running = torch.get_rng_state(), net[2].running_mean.clone()
    attributes = [dict(m.__dict__) for m in net.modules()]
    flat = list(net[3]._flat_weights)
    phases = eager_phases(net, (x,), {})  # it returns its outputs, not a loss
    assert phases is not None and phases.backward > phases.held > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(net[2].running_mean, running)
    assert all(p.grad is None for p in net.parameters())
    assert [dict(m.__dict__) for m in net.modules()] == attributes
    assert net[0].calls == 1 and len(net[0].seen) == 1
    assert all(a is b for a, b in zip(net[3]._flat_weights, flat, strict=True))


def test_budget_one_is_at_most_the_eager_step_where_compiled_code_holds_more(tmp_path):
    """Without the eager step's figures, 1.0 planned the compiled program storing
    everything: far above what the module held eagerly. With them, the first step (plans
    from the cache an identical run filled) and the next measure at most eager's peak,
    with eager's gradients."""
    torch.manual_seed(0)
    model, x = TwoPaths(), torch.randn(512, 256)
    _step(model, model, x)
    expected = [p.grad.clone() for p in model.parameters()]
    eager = memory.peak(lambda: _step(model, model, x)).peak_bytes
    _step(remat.optimize(model, budget=1.0, cache=tmp_path), model, x)  # fills the cache
    torch._dynamo.reset()
    optimized = remat.optimize(model, budget=1.0, cache=tmp_path)
    first = memory.peak(lambda: _step(optimized, model, x)).peak_bytes
    second = memory.peak(lambda: _step(optimized, model, x)).peak_bytes
    assert first <= eager, (first, eager)
    assert second <= eager, (second, eager)
    report = optimized.remat.report()
    graph = report.graphs[0]
    assert graph.store_all.peak > 1.5 * eager  # what 1.0 planned before
    assert abs(graph.eager_peak - eager) <= 0.01 * eager  # the eager step, as measured
    assert report.to_dict()["graphs"][0]["eager_step_peak_bytes"] == graph.eager_peak
    assert "eager step" in str(report)
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want)


def test_a_module_that_cannot_run_under_fake_tensors_is_planned_without(caplog):
    """Code whose sizes depend on data (``nonzero``) cannot run under fake tensors: the
    log says so and a fraction is of the compiled programs, as before."""

    class Selecting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = self.lin(x)
            if not torch.compiler.is_compiling():
                h = h[h.sum(-1).nonzero().squeeze(-1)]
            return h.square().mean()

    assert eager_phases(Selecting(), (torch.randn(32, 64),), {}) is None
    model = Selecting()
    with caplog.at_level(logging.INFO, logger="remat"):
        optimized = remat.optimize(model, budget=1.0, cache=False)
        _step(optimized, model, torch.randn(32, 64))
    assert "could not run under fake tensors" in caplog.text
    assert optimized.remat.report().graphs[0].as_given is None


def test_the_eager_step_runs_only_for_a_fraction():
    """A budget in bytes does not depend on it, so the module is not run twice."""
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            if not torch.compiler.is_compiling():
                calls.append(1)
            return F.gelu(self.lin(x)).sum()

    model, x = Counting(), torch.randn(32, 64)
    _step(remat.optimize(model, budget="1MiB", cache=False), model, x)
    assert calls == []
    torch._dynamo.reset()
    _step(remat.optimize(model, budget=1.0, cache=False), model, x)
    assert calls == [1]
