"""A model that already checkpoints (``torch.utils.checkpoint`` per block): its own plan is
a candidate remat keeps where it fits and is cheaper, a fraction of the budget is of the
program as written where that peaks below store-all, and the report says what became of
the user's checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch.utils.checkpoint import checkpoint

import remat
from remat import memory
from remat.passes.extract import traced_in_backward


def new_gelu(x):
    """GPT-2's activation as transformers writes it: its backward squares ``x`` reading no
    gradient, an op the backward pass traces that reads a checkpointed region's value."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


class _Block(torch.nn.Module):
    def __init__(self, d: int = 128, activation=F.gelu):
        super().__init__()
        self.norm, self.up, self.down = (
            torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        )  # fmt: skip
        self.activation = activation

    def forward(self, x):
        return x + self.down(self.activation(self.up(self.norm(x))))


class _Checkpointed(torch.nn.Module):
    def __init__(self, blocks: int = 4, activation=F.gelu):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(activation=activation) for _ in range(blocks))
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x, y):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return F.cross_entropy(self.head(x), y)


@pytest.fixture(params=[F.gelu, new_gelu], ids=["gelu", "new_gelu"])
def model_and_peak(request):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Checkpointed(activation=request.param)
    x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))
    theirs = memory.peak(lambda: model(x, y).backward()).peak_bytes
    yield model, (x, y), theirs
    torch._dynamo.reset()


def _trained_peak(optimized, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    optimized(*inputs).backward()  # plans
    model.zero_grad(set_to_none=True)
    return memory.peak(lambda: optimized(*inputs).backward()).peak_bytes


@pytest.mark.parametrize("budget", ["theirs", 1.0])
def test_a_budget_at_the_users_own_peak_is_kept_and_never_refused(model_and_peak, budget):
    """At the peak of the user's own checkpointed program (bytes), or at 1.0 (a fraction of
    that program, not of storing everything): not refused, within it, with a plan no
    costlier than the user's own."""
    model, inputs, theirs = model_and_peak
    optimized = remat.optimize(model, budget=theirs if budget == "theirs" else budget)
    peak = _trained_peak(optimized, model, inputs)
    graph = optimized.remat.report().graphs[0]
    assert graph.yours is not None and graph.yours.peak < graph.store_all.peak
    assert peak <= theirs * 1.01, (peak, theirs)  # the prediction's grain: one row's bytes
    assert graph.plan.cost <= graph.yours.cost
    assert "your checkpointing" in optimized.remat.report().rows()[0]


def test_store_all_is_not_what_a_checkpointed_model_is_measured_against(model_and_peak):
    model, inputs, theirs = model_and_peak
    optimized = remat.optimize(model, budget=0.5)
    with pytest.raises(remat.InfeasibleBudget) as refusal:
        _trained_peak(optimized, model, inputs)
    # refused as it compiled (the graph is the whole step): half of the user's program,
    # which peaks below storing everything, not half of store-all
    r = refusal.value
    assert r.reference < r.store_all and r.limit == int(0.5 * r.reference)


def test_a_checkpointed_region_hands_over_only_what_the_forward_reads_outside_it(
    model_and_peak,
):
    """The user's plan keeps a region's value only where the forward pass reads it outside
    the region, as eager's checkpoint does: a tangent-free op of the backward pass
    (``new_gelu``'s square of its input) reads it after the region is recomputed, and kept
    each block's widest value before."""
    model, inputs, _ = model_and_peak
    optimized = remat.optimize(model, budget=1.0)
    _trained_peak(optimized, model, inputs)
    graph = optimized.remat.report().graphs[0]
    nodes, problem = graph.extracted.fx_nodes, graph.extracted.problem
    region = lambda n: n.meta.get("ac_graph_id")  # noqa: E731
    inside = [
        nodes[i]
        for i in graph.yours.saved
        if region(nodes[i]) is not None
        and problem.nodes[i].bytes
        and all(region(u) == region(nodes[i]) or traced_in_backward(u) for u in nodes[i].users)
    ]
    assert not inside, [n.name for n in inside]


class _Active:
    """State a layer sets around its work, as transformers' hub kernels set the kernels
    active inside each layer (``CompileableContextVar``: compiled, a global value set and
    reset, and a mark that compiled code set it, left set)."""

    kernel = None
    compiled = False


ACTIVE = _Active()


class _SettingBlock(_Block):
    def forward(self, x):
        before, ACTIVE.kernel = ACTIVE.kernel, "fused"
        if torch.compiler.is_compiling():
            ACTIVE.compiled = True
        try:
            return super().forward(x)
        finally:
            ACTIVE.kernel = before


def test_a_checkpointed_region_setting_state_outside_it_is_traced_whole():
    """torch.compile breaks the graph at each such region (dynamo would have to replay the
    effect in the backward), and inside a loop runs the whole forward eagerly; remat, which
    replays no Python code, traces them into one graph: the user's regions become its
    candidate, and a budget at the user's own peak is kept, with eager's gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Checkpointed()
    model.blocks = torch.nn.ModuleList(_SettingBlock() for _ in model.blocks)
    x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))
    counted = CompileCounter()
    torch.compile(model, backend=counted)(x, y)
    assert counted.frame_count != 1  # torch.compile: graph breaks, or the loop runs eagerly
    torch._dynamo.reset()
    ACTIVE.compiled = False
    theirs = memory.peak(lambda: model(x, y).backward()).peak_bytes
    expected = [p.grad.clone() for p in model.parameters()]

    optimized = remat.optimize(model, budget=theirs)
    peak = _trained_peak(optimized, model, (x, y))
    report = optimized.remat.report()
    assert len(report.graphs) == 1 and report.graphs[0].yours is not None
    assert peak <= theirs * 1.01, (peak, theirs)
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)
    assert ACTIVE.kernel is None and ACTIVE.compiled
    torch._dynamo.reset()
