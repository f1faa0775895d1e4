"""The built-in example models: the contract every tool and benchmark relies on."""

import sys
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.tools import examples
from remat.tools.examples import EXAMPLES, load

NAMES = sorted(EXAMPLES)
# Smaller than the defaults, for the tests that build several copies (2 CPU cores).
SMALL = {
    "mlp": dict(layers=4, width=64, batch=32),
    "cnn": dict(batch=4, image=16, width=8),
    "gpt": dict(layers=2, d_model=32, heads=2, seq=16, vocab=64),
    "unet": dict(batch=2, image=16, base=8),
    "hf-gpt2": dict(layers=2, d_model=32, heads=2, seq=16, vocab=64),
    "hf-gpt2-labels": dict(layers=2, d_model=32, heads=2, seq=16, vocab=64),
    "hf-llama": dict(layers=2, d_model=32, heads=2, seq=16, vocab=64),
}


def _step(model, inputs, seed=1234):
    """One training step with a fixed dropout RNG; returns (loss, {name: grad})."""
    torch.manual_seed(seed)
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_registry_names():
    assert NAMES == ["cnn", "gpt", "hf-gpt2", "hf-gpt2-labels", "hf-llama", "mlp", "unet"]
    for name in NAMES:
        assert EXAMPLES[name] is getattr(examples, name.replace("-", "_"))


@pytest.mark.parametrize("name", NAMES)
def test_training_step(name):
    model, inputs = EXAMPLES[name]()
    assert isinstance(model, nn.Module) and isinstance(inputs, tuple)
    assert model.training
    loss = model(*inputs)
    assert loss.shape == () and loss.dtype == torch.float32
    assert loss.requires_grad and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_in_seed_and_leaves_global_rng_alone(name):
    state = torch.get_rng_state()
    m1, in1 = EXAMPLES[name](seed=3, **SMALL[name])
    assert torch.equal(torch.get_rng_state(), state), "building an example moved the global RNG"
    m2, in2 = EXAMPLES[name](seed=3, **SMALL[name])
    m3, in3 = EXAMPLES[name](seed=4, **SMALL[name])
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert all(torch.equal(a, b) for a, b in zip(in1, in2, strict=True))
    assert not all(torch.equal(sd1[k], sd3[k]) for k in sd1 if sd1[k].is_floating_point())
    assert not all(torch.equal(a, b) for a, b in zip(in1, in3, strict=True))
    loss1, grads1 = _step(m1, in1)
    loss2, grads2 = _step(m2, in2)
    assert torch.equal(loss1, loss2)
    assert all(torch.equal(grads1[k], grads2[k]) for k in grads1)


@pytest.mark.parametrize("name", NAMES)
def test_blocks_can_be_wrapped_in_checkpoint(name):
    """The documented `blocks` contract: replacing each block by a checkpointed wrapper keeps
    the loss and the gradients (checkpoint replays the RNG, so dropout matches too)."""

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args, **kwargs):  # HF blocks also take masks, positions
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    model, inputs = EXAMPLES[name](**SMALL[name])
    assert isinstance(model.blocks, (nn.ModuleList, nn.Sequential)) and len(model.blocks) > 1
    ref_loss, ref_grads = _step(model, inputs)
    model.zero_grad(set_to_none=True)
    for i in range(len(model.blocks)):
        model.blocks[i] = Checkpointed(model.blocks[i])
    loss, grads = _step(model, inputs)
    torch.testing.assert_close(loss, ref_loss)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k.replace(".block.", ".")], rtol=1e-4, atol=1e-6)


def test_gpt_ties_lm_head_to_embedding():
    model, (idx, targets) = examples.gpt(layers=1)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # one Parameter
    assert idx.dtype == targets.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1]), "targets are idx shifted by one"


def test_gpt_attention_is_explicit():
    """No fused SDPA: the score matrix must be a node the solver can see and free."""
    model, inputs = examples.gpt(layers=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(*inputs)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::softmax" in ops or "aten::_softmax" in ops
    assert not any("scaled_dot_product" in op for op in ops)


def test_cnn_batchnorm_updates_running_stats():
    model, inputs = examples.cnn(dropout=0.2)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(bn.training for bn in bns)
    assert any(isinstance(m, nn.Dropout) and m.p == 0.2 for m in model.modules())
    before = [bn.running_mean.clone() for bn in bns]
    model(*inputs)
    assert all(not torch.equal(b, bn.running_mean) for b, bn in zip(before, bns, strict=True))
    assert all(bn.num_batches_tracked.item() == 1 for bn in bns)


def test_unet_is_a_dag_with_concat_skips():
    model, (x, target) = examples.unet(levels=2)
    assert x.shape == target.shape
    assert len(model.blocks) == 2 * 2 + 1
    with pytest.raises(ValueError, match="divisible"):
        examples.unet(image=36, levels=3)


def test_sizes_are_keyword_arguments():
    model, (x, y) = examples.mlp(layers=3, width=32, batch=8, activation="relu")
    assert len(model.blocks) == 3 and x.shape == (8, 32) and y.shape == (8,)
    model, (idx, _) = examples.gpt(layers=2, d_model=32, heads=2, seq=16, batch=2, vocab=64)
    assert len(model.blocks) == 2 and idx.shape == (2, 16)
    with pytest.raises(ValueError, match="activation"):
        examples.mlp(activation="tanh")


@pytest.mark.parametrize("name", NAMES)
def test_dtype_casts_floating_weights_and_inputs(name):
    model, inputs = EXAMPLES[name](dtype="bfloat16", **SMALL[name])
    reference, ref_inputs = EXAMPLES[name](**SMALL[name])
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref.to(torch.bfloat16))
    for x, ref in zip(inputs, ref_inputs, strict=True):  # token ids and labels stay integers
        assert x.dtype == (torch.bfloat16 if ref.is_floating_point() else ref.dtype)
    loss = model(*inputs)  # Hugging Face's models compute it in float32
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("dtype", ["int8", "bfloat", "nn", torch.int64])
def test_dtype_must_be_a_floating_one(dtype):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        examples.mlp(dtype=dtype)


def test_load_builtin_and_module_factory():
    model, inputs = load("mlp", layers=2, width=16, batch=4)
    assert len(model.blocks) == 2 and inputs[0].shape == (4, 16)
    model, inputs = load("remat.tools.examples:mlp", layers=3, width=8, batch=2)
    assert len(model.blocks) == 3
    assert model(*inputs).shape == ()


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("nope", "unknown model 'nope'"),
        ("remat.tools.examples:nope", "no attribute 'nope'"),
        ("remat_no_such_module_xyz:make", "cannot import module"),
        (":mlp", "bad model spec"),
        ("remat.tools.examples:", "bad model spec"),
        ("remat.tools.examples:EXAMPLES", "not callable"),
    ],
)
def test_load_rejects_bad_specs(spec, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        load(spec)
    msg = str(info.value)
    assert all(name in msg for name in NAMES), msg
    assert "module:factory" in msg


def test_load_checks_what_the_factory_returns(monkeypatch):
    fake = types.ModuleType("remat_fake_factories")
    fake.good = lambda: (nn.Linear(2, 1), (torch.zeros(1, 2),))
    fake.bad = lambda: (nn.Linear(2, 1), [torch.zeros(1, 2)])
    fake.nested = types.SimpleNamespace(make=fake.good)
    monkeypatch.setitem(sys.modules, "remat_fake_factories", fake)
    assert isinstance(load("remat_fake_factories:good")[0], nn.Linear)
    assert isinstance(load("remat_fake_factories:nested.make")[0], nn.Linear)
    with pytest.raises(TypeError, match=r"must return \(nn.Module, tuple"):
        load("remat_fake_factories:bad")
