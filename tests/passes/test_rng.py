"""Dropout replay: the rewritten graph draws eager's masks, recomputes reproduce them."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat import costs
from remat.passes.rng import dropout_scale, replay_dropouts, restore_in_backward

aten = torch.ops.aten


def _two_dropouts(x):
    a = aten.native_dropout.default(x.sin(), 0.3, True)
    b = aten.native_dropout.default(a[0] * 2, 0.5, True)
    return a[0], a[1], b[0], b[1]


def _traced():
    return make_fx(_two_dropouts, tracing_mode="fake")(torch.randn(64, 64))


def test_forward_draws_eagers_masks_and_advances_the_generator_alike():
    x = torch.randn(64, 64)
    gm = _traced()
    assert replay_dropouts(gm) == 2
    assert not gm.graph.find_nodes(op="call_function", target=aten.native_dropout.default)
    torch.manual_seed(3)
    expected, after_eager = _two_dropouts(x), torch.get_rng_state()
    torch.manual_seed(3)
    got, after = gm(x), torch.get_rng_state()
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    assert torch.equal(after, after_eager)


BITS = {torch.float64: torch.int64, torch.float32: torch.int32}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.25, 0.77])
def test_replay_gives_eagers_bits_in_every_float_dtype(dtype, p):
    """Under autocast dropout runs in bfloat16: there the scale must be rounded as
    ``native_dropout`` rounds it (a non-contiguous input, infinities, NaN, signed zeros)."""
    x = torch.randn(48, 64).t().to(dtype)
    x[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0])
    torch.manual_seed(11)
    out, mask = aten.native_dropout.default(x, p, True)
    torch.manual_seed(11)
    state = torch.ops.remat.rng_state(x)
    got_mask = torch.ops.remat.dropout_mask(state, x, p, False)
    got = torch.ops.remat.apply_dropout_mask(x, got_mask, dropout_scale(p, x))
    assert torch.equal(got_mask, mask)
    bits = BITS.get(dtype, torch.int16)
    assert torch.equal(got.view(bits), out.view(bits))  # bits: NaN and signed zeros too


def test_restored_replay_reproduces_the_mask_and_leaves_the_stream_alone():
    x = torch.randn(1000)
    torch.manual_seed(7)
    state = torch.ops.remat.rng_state(x)
    mask = torch.ops.remat.dropout_mask(state, x, 0.4, False)
    stream = torch.get_rng_state()
    again = torch.ops.remat.dropout_mask(state, x, 0.4, True)
    assert torch.equal(again, mask)
    assert torch.equal(torch.get_rng_state(), stream)
    assert 0 < int(mask.sum()) < mask.numel()  # p = 0.4 drew a real mask


def test_state_is_random_and_the_replay_is_recomputable():
    gm = _traced()
    replay_dropouts(gm)
    states = gm.graph.find_nodes(op="call_function", target=torch.ops.remat.rng_state.default)
    replays = [
        n
        for target in (torch.ops.remat.dropout_mask, torch.ops.remat.apply_dropout_mask)
        for n in gm.graph.find_nodes(op="call_function", target=target.default)
    ]
    assert len(states) == 2 and len(replays) == 4
    assert all(costs.is_random(n) and not costs.has_side_effects(n) for n in states)
    assert not any(costs.is_random(n) or costs.has_side_effects(n) for n in replays)
    # The state is a small CPU byte tensor; the replay costs time like a pointwise op.
    assert all(
        n.meta["val"].dtype == torch.uint8 and n.meta["val"].numel() < 10_000 for n in states
    )
    assert all(
        costs.estimate_seconds(n, costs.DeviceSpec.for_device(torch.device("cpu"))) > 0
        for n in replays
    )


def test_restore_in_backward_flips_only_the_copies_it_is_given():
    gm = _traced()
    replay_dropouts(gm)
    target = torch.ops.remat.dropout_mask.default
    assert all(n.args[3] is False for n in gm.graph.find_nodes(op="call_function", target=target))
    assert restore_in_backward(gm) == 2
    assert all(n.args[3] is True for n in gm.graph.find_nodes(op="call_function", target=target))


def test_graphs_without_replayable_dropout_are_untouched():
    for fn in (
        lambda x: x.relu() * 2,
        lambda x: aten.native_dropout.default(x, 0.5, False),  # eval mode: no draw
        lambda x: aten.native_dropout.default(x, 0.0, True),
    ):
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(4))
        code = gm.code
        assert replay_dropouts(gm) == 0
        assert gm.code == code


def test_drawing_a_mask_costs_more_than_applying_it_on_cpu():
    """CPU random numbers are slow (~8 ns each): the roofline charges them, so the solver
    prefers saving a 1-byte mask and re-applying it over replaying the draw."""
    gm = make_fx(lambda x: aten.native_dropout.default(x, 0.1, True), tracing_mode="fake")(
        torch.randn(4, 4, 512, 512)
    )
    replay_dropouts(gm)
    (mask,) = gm.graph.find_nodes(op="call_function", target=torch.ops.remat.dropout_mask.default)
    (apply,) = gm.graph.find_nodes(
        op="call_function", target=torch.ops.remat.apply_dropout_mask.default
    )
    cpu = costs.DeviceSpec.for_device("cpu")
    assert costs.random_numbers(mask) == 4 * 4 * 512 * 512
    assert costs.random_numbers(apply) == 0
    assert costs.estimate_seconds(mask, cpu) > 2 * costs.estimate_seconds(apply, cpu)
    gpu = costs.DeviceSpec("gpu", peak_flops=1e13, bandwidth=1e12, launch_overhead=5e-6)
    assert costs.estimate_seconds(mask, gpu) < costs.estimate_seconds(apply, gpu)
