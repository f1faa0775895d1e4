"""remat.nn: reversible stacks rebuild, differentiate and replay dropout as the ordinary
network does, hold memory flat in depth, and are planned exactly under remat.optimize."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn

import remat
from remat import memory
from remat.nn import Coupling, ReversibleSequential

WIDTH = 16  # each half is 8 wide


def branch(d: int = WIDTH // 2, p: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(p))


def stack(depth: int, p: float = 0.0, seed: int = 0) -> ReversibleSequential:
    torch.manual_seed(seed)
    return ReversibleSequential(*(Coupling(branch(p=p), branch(p=p)) for _ in range(depth)))


def ordinary(rev: ReversibleSequential) -> nn.Module:
    """The same couplings run by autograd, storing their activations: the twin network."""
    return nn.Sequential(*rev.blocks)


def step(model: nn.Module, x: torch.Tensor, seed: int = 1, loss=lambda y: y.square().mean()):
    """Loss and gradients (input's, then the parameters') of one step with a fixed seed."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    loss = loss(model(x))
    loss.backward()
    return loss.detach(), [x.grad, *(p.grad for p in model.parameters())]


def test_inverse_reconstructs_the_input():
    rev = stack(8).eval()
    x = torch.randn(32, WIDTH)
    y = rev(x)
    for block in reversed(rev.blocks):
        y = block.inverse(y)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-5)


def test_gradients_equal_the_ordinary_networks():
    """float32, depth 8: the rebuilt inputs differ from the stored ones by rounding only,
    so the gradients agree to 1e-5 relative (measured for deeper stacks and bfloat16:
    benchmarks/reversible.py)."""
    rev = stack(8)
    x = torch.randn(32, WIDTH)
    loss, grads = step(rev, x)
    ref_loss, ref_grads = step(ordinary(rev), x)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_dropout_masks_are_the_forwards():
    """The backward replays each block's masks: gradients equal the ordinary network's
    under the same seed, and the generator ends where the ordinary network leaves it."""
    rev = stack(4, p=0.5)
    x = torch.randn(32, WIDTH)
    loss, grads = step(rev, x)
    after = torch.get_rng_state()
    ref_loss, ref_grads = step(ordinary(rev), x)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(after, torch.get_rng_state())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    _, other = step(ordinary(rev), x, seed=2)  # other masks give other gradients
    assert not torch.allclose(other[0], ref_grads[0], rtol=1e-3, atol=1e-4)


class BFloat16(nn.Module):
    """``model`` under CPU autocast to bfloat16; the backward runs outside it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x).float()


def test_the_rebuild_runs_under_the_forwards_autocast():
    """The rebuild computes f and g in bfloat16 as the forward did, so the gradients are
    the ordinary network's (rebuilt in float32 they were 0.5% off)."""
    rev = stack(8)
    x = torch.randn(64, WIDTH)
    _, grads = step(BFloat16(rev), x)
    _, ref_grads = step(BFloat16(ordinary(rev)), x)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


class FunctionalDropout(nn.Module):
    """Dropout no module announces: the stack cannot tell it draws."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH // 2, WIDTH // 2)

    def forward(self, h):
        return nn.functional.dropout(self.lin(h), 0.5, training=True)


def test_a_block_that_draws_unannounced_is_refused_or_replayed_when_told():
    x = torch.randn(8, WIDTH)
    torch.manual_seed(0)
    silent = ReversibleSequential(Coupling(FunctionalDropout(), FunctionalDropout()))
    with pytest.raises(RuntimeError, match="preserve_rng_state=True"):
        silent(x)
    told = ReversibleSequential(
        Coupling(FunctionalDropout(), FunctionalDropout(), preserve_rng_state=True)
    )
    _, grads = step(told, x)
    _, ref_grads = step(ordinary(told), x)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def peak_activations(model: nn.Module, x: torch.Tensor) -> int:
    """Measured peak of a step (forward and backward) less the parameters' gradients,
    which every network holds at its end and which grow with depth by construction."""
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()  # warm up
    model.zero_grad(set_to_none=True)
    peak = memory.peak(lambda: model(x).square().mean().backward()).peak_bytes
    return peak - sum(p.numel() * p.element_size() for p in model.parameters())


def slope(depths, peaks) -> float:
    return float(np.polyfit(np.log(depths), np.log(peaks), 1)[0])


def test_measured_peak_does_not_grow_with_depth():
    """log-log slope of the peak over depths 2-16: about 0 for the reversible stack, about
    1 for its ordinary twin (the control that shows the fit can see growth)."""
    depths = [2, 4, 8, 16]
    x = torch.randn(512, WIDTH)
    rev = [peak_activations(stack(d), x) for d in depths]
    twin = [peak_activations(ordinary(stack(d)), x) for d in depths]
    assert abs(slope(depths, rev)) < 0.2, rev
    assert slope(depths, twin) > 0.5, twin


def test_under_torch_compile_gradients_are_eagers():
    rev = stack(4, p=0.2)
    x = torch.randn(32, WIDTH)
    loss, grads = step(rev, x)
    compiled = torch.compile(rev, backend="aot_eager", dynamic=False)
    c_loss, c_grads = step(compiled, x)
    assert torch.equal(loss, c_loss)
    for g, c in zip(grads, c_grads, strict=True):
        assert torch.equal(g, c)


class Mixed(nn.Module):
    """Ordinary layers around a reversible stack, and the loss: the plan mixes both."""

    def __init__(self, depth: int, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.rev = stack(depth, p=p)
        wide = 16 * WIDTH  # activations a tighter budget recomputes
        self.out = nn.Sequential(
            nn.Linear(WIDTH, wide), nn.GELU(), nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, 1)
        )

    def forward(self, x):
        return self.out(torch.relu(self.rev(self.inp(x)))).square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1.0, 0.85])
def test_under_optimize_predicted_peak_is_measured(budget):
    """One forward and one backward node stand for the stack in the planned graph; the
    step trains on eager's gradients and peaks where the plan says, to the byte."""
    model = Mixed(depth=4, p=0.1)
    reference = copy.deepcopy(model)
    x = torch.randn(256, WIDTH)
    optimized = remat.optimize(model, budget=budget)
    run = functools.partial(step, x=x, loss=lambda loss: loss)
    run(optimized)  # compile, plan the step
    loss, grads = run(optimized)
    ref_loss, ref_grads = run(reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)

    measured = memory.peak(lambda: run(optimized)).peak_bytes
    report = optimized.remat.report()
    ops = [n.op for n in report.graphs[0].extracted.problem.nodes]
    assert ops.count("reversible_forward.default") == 1, ops
    assert ops.count("reversible_backward.default") == 1, ops
    assert report.predicted_peak == measured
    assert measured <= report.graphs[0].limit
    if budget < 1:  # the ordinary layers are recomputed around the stack
        assert report.steps[0].plan.recomputed


def test_from_residual_pairs_branches_over_two_full_streams():
    torch.manual_seed(0)
    branches = [branch(WIDTH) for _ in range(4)]
    rev = ReversibleSequential.from_residual(branches)
    assert len(rev.blocks) == 2 and rev.blocks[1].f is branches[2]
    x = torch.randn(8, WIDTH)
    streams = ordinary(rev)(torch.cat([x, x], -1))
    torch.testing.assert_close(rev(x), sum(streams.chunk(2, -1)) / 2)
    for b in branches:  # branches that output zero: the identity, as the residual stack
        nn.init.zeros_(b[0].weight)
        nn.init.zeros_(b[0].bias)
    torch.testing.assert_close(rev(x), x)
    with pytest.raises(ValueError, match="even number"):
        ReversibleSequential.from_residual(branches[:3])


def test_a_copy_is_a_stack_of_its_own():
    rev = stack(2)
    twin = copy.deepcopy(rev)
    x = torch.randn(4, WIDTH)
    torch.testing.assert_close(twin(x), rev(x))
    with torch.no_grad():
        for p in twin.parameters():
            p.neg_()
    assert not torch.allclose(twin(x), rev(x))
    _, grads = step(twin, x)
    _, ref_grads = step(ordinary(twin), x)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="odd"):
        stack(2)(torch.randn(4, WIDTH + 1))
    with pytest.raises(ValueError, match=r"must keep its input's shape \(4, 8\)"):
        ReversibleSequential(Coupling(nn.Linear(8, 6), branch()))(torch.randn(4, WIDTH))
    with pytest.raises(ValueError, match="must keep its input's shape"):
        Coupling(branch(), nn.Linear(8, 2))(torch.randn(4, WIDTH))
    with pytest.raises(TypeError, match="Coupling blocks"):
        ReversibleSequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="one dim"):
        ReversibleSequential(Coupling(branch(), branch(), dim=0), Coupling(branch(), branch()))


def test_coupling_splits_along_the_dim_it_is_given():
    torch.manual_seed(0)
    block = Coupling(nn.Linear(5, 5), nn.Linear(5, 5), dim=0)
    x = torch.randn(6, 5)
    x1, x2 = x[:3], x[3:]
    y1 = x1 + block.f(x2)
    torch.testing.assert_close(block(x), torch.cat([y1, x2 + block.g(y1)]))
    torch.testing.assert_close(block.inverse(block(x)), x, rtol=0, atol=1e-6)


class Doubled(nn.Module):
    def forward(self, h):
        return 2 * h


class Halved(nn.Module):  # the same repr as Doubled's but for the name; other code
    def forward(self, h):
        return h / 2


def test_the_ops_key_tells_stacks_apart_by_modules_and_code():
    """The ops' stack argument is part of the traced graph, so of the plan cache's key
    (remat.cache): it fingerprints the modules and their forward code, never equal for two
    stacks whose kernels differ, equal (but for the handle) for equal ones."""

    def fingerprint(*branches):
        return ReversibleSequential(Coupling(*branches))._key.split(":")[1]

    assert fingerprint(branch(), branch()) == fingerprint(branch(), branch())
    assert fingerprint(branch(), branch()) != fingerprint(branch(p=0.5), branch())
    Halved.__name__ = Halved.__qualname__ = "Doubled"  # now only the code differs
    try:
        assert fingerprint(Doubled(), Doubled()) != fingerprint(Halved(), Doubled())
    finally:
        Halved.__name__ = Halved.__qualname__ = "Halved"
