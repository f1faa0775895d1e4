"""Patterns users bring, each trained under remat beside eager: same outputs, same
gradients, within the budget; and what happens where remat cannot compile a model."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import remat
from remat.errors import EagerFallback


def _flat(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def trains_as_eager(model: nn.Module, inputs: tuple, budget=0.5, steps: int = 2, grad=None):
    """Train ``model`` under remat and a deep copy eagerly, ``steps`` SGD steps from the
    same seeds; outputs and gradients must be equal. ``grad`` seeds a non-scalar output's
    backward. A budget below remat's floor is refused, and the floor it names then fits.
    Returns the optimized module."""
    original = copy.deepcopy(model)
    try:
        return _trains_as_eager(model, inputs, budget, steps, grad)
    except remat.InfeasibleBudget as refusal:
        torch.compiler.reset()
        model.load_state_dict(original.state_dict())
        return _trains_as_eager(model, inputs, f"{refusal.minimum}B", steps, grad)


def _trains_as_eager(model: nn.Module, inputs: tuple, budget, steps: int, grad):
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=budget)
    runs = ((optimized, model), (reference, reference))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for _, m in runs]
    for step in range(steps):
        results = []
        for (run, params), opt in zip(runs, opts, strict=True):
            torch.manual_seed(step)
            opt.zero_grad(set_to_none=True)
            out = run(*inputs)
            first = _flat(out)[0]
            first.backward(grad) if grad is not None else first.backward()
            results.append(
                ([t.detach().clone() for t in _flat(out)],
                 [None if p.grad is None else p.grad.clone() for p in params.parameters()])
            )  # fmt: skip
            opt.step()
        (outs, grads), (ref_outs, ref_grads) = results
        for a, b in zip(outs, ref_outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, ref_grads, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    report = optimized.remat.report()
    assert report.predicted_peak <= max(s.limit for s in report.steps)
    return optimized


class InPlace(nn.Module):
    """In-place ops on activations (``relu_``, ``mul_``, ``add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.a(x)
        h.relu_()  # addmm's backward does not need its output
        g = h * 3.0
        g.add_(1.0)  # nor does a product by a number
        return self.b(g).square().mean()


class NonScalar(nn.Module):
    """Returns a tensor, not a loss: trained with ``out.backward(grad)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.a(x).tanh())


class IntegerAndBool(nn.Module):
    """Integer ids (an embedding, an index) and a boolean mask as inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(50, 16), nn.Linear(16, 16)

    def forward(self, ids, picks, mask):
        h = torch.nn.functional.gelu(self.lin(self.emb(ids)))
        h = h.masked_fill(mask.unsqueeze(-1), 0.0)
        return h.index_select(1, picks).square().mean()


class Frozen(nn.Module):
    """A frozen first layer (``requires_grad_(False)``): no gradient for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)
        self.a.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x).relu()).square().mean()


class Aliasing(nn.Module):
    """Outputs that alias the input and each other, beside the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x).relu()
        return h.square().mean(), x.view(-1), h, h[0], h.t()


class Checkpointed(nn.Module):
    """A block the user already wrapped in ``torch.utils.checkpoint``."""

    def __init__(self, context_fn=None) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 4)
        self.context_fn = context_fn

    def forward(self, x):
        kwargs = {"context_fn": self.context_fn} if self.context_fn else {}
        h = checkpoint(self.block, x, use_reentrant=False, **kwargs)
        return self.head(h.relu()).square().mean()


class ChannelNorm(nn.Module):
    """BatchNorm over a sequence's channels (transposed in and back), then a linear layer:
    traced, the linear's ``view`` met a layout the CPU batch norm does not return."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.BatchNorm1d(16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.head(h).relu().square().mean()


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective-activation-checkpointing policy: keep matmul outputs, recompute others."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


X = torch.randn(8, 16)


@pytest.mark.parametrize(
    ("make", "inputs", "grad"),
    [
        (InPlace, (X,), None),
        (NonScalar, (X,), torch.full((8, 8), 0.5)),
        (
            IntegerAndBool,
            (torch.randint(0, 50, (4, 6)), torch.tensor([0, 2, 5]), torch.rand(4, 6) > 0.5),
            None,
        ),
        (Frozen, (X,), None),
        (Aliasing, (X,), None),
        (Checkpointed, (X,), None),
        (ChannelNorm, (torch.randn(4, 6, 16),), None),
        (functools.partial(
            Checkpointed, functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        ), (X,), None),
    ],
    ids=["in-place", "backward(grad)", "int-and-bool", "frozen", "aliasing", "checkpoint",
         "channel-norm", "sac-policy"],
)  # fmt: skip
def test_pattern_trains_as_eager(make, inputs, grad):
    torch.manual_seed(0)
    trains_as_eager(make(), inputs, grad=grad)


def test_no_grad_calls_between_steps():
    """Evaluation calls under ``torch.no_grad()`` (an inference graph, nothing planned)
    between training steps leave the training steps as they were."""
    torch.manual_seed(0)
    model = InPlace()
    optimized = trains_as_eager(model, (X,), steps=1)
    with torch.no_grad():
        assert torch.equal(optimized(X), InPlace.forward(model, X))
    before = optimized.remat.report().predicted_peak
    model.zero_grad(set_to_none=True)
    optimized(X).backward()
    assert optimized.remat.report().predicted_peak == before


def test_lstm_is_refused_before_anything_runs():
    """dynamo runs an LSTM eagerly (it skips the forward, or from torch 2.15 breaks the
    graph at the LSTM): remat refuses it at the first call, before anything runs, naming
    the LSTM. (Run eagerly beside remat's programs, its kernel's scratch, which remat cannot
    count there, made the step peak at 56,320 B against 32,648 B predicted.)"""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 8, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0].square().mean()

    optimized = remat.optimize(Recurrent(), budget=0.5)
    with pytest.raises(remat.RecurrentModules, match="LSTM rnn"):
        optimized(torch.randn(2, 5, 8))
    assert optimized.remat.steps.forwards_run == 0


def test_a_model_remat_cannot_compile_runs_eagerly_with_one_warning(monkeypatch):
    import remat.planner

    def broken(*args, **kwargs):
        raise AssertionError("a bug in remat")

    monkeypatch.setattr(remat.planner, "extract", broken)
    torch.manual_seed(0)
    model = InPlace()
    optimized = remat.optimize(model, budget=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = optimized(X), optimized(X)
    fallbacks = [w for w in caught if w.category is EagerFallback]
    assert len(fallbacks) == 1 and "AssertionError: a bug in remat" in str(fallbacks[0].message)
    assert torch.equal(first, InPlace.forward(model, X)) and torch.equal(first, second)
    torch.compiler.reset()
    strict = remat.optimize(model, budget=0.5, on_failure="raise")
    with pytest.raises(Exception, match="a bug in remat"):
        strict(X)
    with pytest.raises(remat.InvalidOption, match="on_failure"):
        remat.optimize(model, budget=0.5, on_failure="ignore")
