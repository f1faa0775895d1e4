"""A model that already checkpoints (``torch.utils.checkpoint`` per block): its own plan is
a candidate remat keeps where it fits and is cheaper, a fraction of the budget is of the
program as written where that peaks below store-all, and the report says what became of
the user's checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import remat
from remat import memory


class _Block(torch.nn.Module):
    def __init__(self, d: int = 128):
        super().__init__()
        self.norm, self.up, self.down = (
            torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        )  # fmt: skip

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Checkpointed(torch.nn.Module):
    def __init__(self, blocks: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(blocks))
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x, y):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return F.cross_entropy(self.head(x), y)


@pytest.fixture
def model_and_peak():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Checkpointed()
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
