"""``remat.costs.measured``: kernel time (``profile_seconds``) and kernel memory
(``kernel_memory``: output storage and scratch) measured on the device, and the
estimate an op falls back to where it cannot run on synthetic inputs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
from sample_graphs import CPU, _all_calls, _calls, _fake_graph, aten
from torch._subclasses.fake_tensor import FakeTensorMode

import remat.costs.flags as cost_flags
import remat.costs.measured as cost_measured
from remat import costs
from remat.costs import (
    DeviceSpec,
    estimate_seconds,
    kernel_memory,
    output_bytes,
    profile_seconds,
)
from remat.costs.graph import is_view

# --------------------------------------------------------------------------------------
# Kernel time
# --------------------------------------------------------------------------------------


def test_profile_seconds_measures_every_op(graphs):
    gm = graphs["conv"]
    rng = torch.get_rng_state()
    res = profile_seconds(gm, "cpu", repeat=3)
    assert torch.equal(torch.get_rng_state(), rng)  # profiling dropout drew nothing visible
    assert res.fallbacks == {} and res.note == "all ops measured"
    assert set(res) == {n.name for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        if estimate_seconds(n, CPU) > 0:
            assert res[n.name] > 0, n.name
        else:
            assert res[n.name] == 0.0, n.name


def test_profiled_masks_are_runs_not_noise():
    """A random bool input would time branchy kernels (masked_fill, where) at their
    worst; real masks there are causal or padding masks, so runs stand in for them."""
    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(8, 256, dtype=torch.bool)
    mask = cost_measured._materialise(fake, torch.device("cpu")).flatten()
    assert torch.equal(mask, cost_measured._materialise(fake, torch.device("cpu")).flatten())
    assert int(mask.sum()) == mask.numel() // 2
    flips = int((mask[1:] != mask[:-1]).sum())
    assert flips == mask.numel() // 64 - 1


def test_profile_seconds_times_each_distinct_op_once(monkeypatch):
    """Equal ops (every layer of a transformer) share one measurement; an op that differs
    in shape, stride or dtype gets its own."""

    def build(g, a, b, c):
        same = [g.call_function(aten.relu.default, (x,)) for x in (a, b)]
        other = g.call_function(aten.relu.default, (c,))
        transposed = g.call_function(aten.relu.default, (g.call_function(aten.t.default, (a,)),))
        return (*same, other, transposed)

    timed = []

    def fake_time(fn, device, repeat, warmup):
        timed.append(fn)
        return 0.25 * len(timed)

    monkeypatch.setattr(cost_measured, "_time_op", fake_time)
    gm = _fake_graph(build, torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 5))
    a, b, c, t = _calls(gm, aten.relu.default)
    res = profile_seconds(gm, "cpu")
    assert len(timed) == 3  # a and b alike; c another shape; t another stride
    assert res[a.name] == res[b.name] == 0.25
    assert {res[c.name], res[t.name]} == {0.5, 0.75}


@torch.library.custom_op("remat_costs_test::boom", mutates_args=())
def _boom(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("cannot run on synthetic data")


@_boom.register_fake
def _(x):
    return torch.empty_like(x)


def test_profile_seconds_falls_back_and_reports(caplog):
    def build(g, x):
        r = g.call_function(aten.relu.default, (x,))
        return (r, g.call_function(torch.ops.remat_costs_test.boom.default, (r,)))

    gm = _fake_graph(build, torch.randn(64))
    relu, boom = _calls(gm)
    # A node whose input lost its metadata cannot be materialised either.
    with gm.graph.inserting_after(boom):
        blind = gm.graph.call_function(aten.neg.default, (boom,))
    blind.meta["val"] = boom.meta["val"]
    del boom.meta["val"]
    with caplog.at_level(logging.WARNING, logger="remat.costs"):
        res = profile_seconds(gm, "cpu", repeat=2, warmup=0)
    assert res[relu.name] > 0 and relu.name not in res.fallbacks
    assert "cannot run on synthetic data" in res.fallbacks[boom.name]
    assert "no tensor metadata" in res.fallbacks[blind.name]
    assert res[blind.name] == estimate_seconds(blind, CPU) > 0
    assert "2 ops fell back" in res.note and "2 ops fell back" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_seconds_on_cuda(graphs):
    gm = graphs["block"]  # traced on CPU: profiled wholesale on the GPU
    res = profile_seconds(gm, "cuda", repeat=3)
    assert res.fallbacks == {}
    assert all(res[n.name] > 0 for n in gm.graph.nodes if estimate_seconds(n, CPU) > 0)
    spec = DeviceSpec.for_device("cuda")
    assert spec.peak_flops > 0 and spec.bandwidth > 0


# --------------------------------------------------------------------------------------
# Kernel memory
# --------------------------------------------------------------------------------------


def _scratch(node: fx.Node, cache: dict) -> int:
    measured = kernel_memory(node, "cpu", cache)
    return 0 if measured is None else measured.scratch


def test_scratch_is_measured_for_every_kernel(graphs):
    """Scratch is measured, not looked up in a list: the CPU flash attention backward
    keeps a buffer the size of its query (unlisted, it put a measured peak 24% over the
    prediction); a convolution's backward unfolds its input; views allocate nothing and
    matmuls nothing beyond their outputs."""
    cache = {}
    sdpa = _calls(graphs["sdpa"])
    (attn,) = [n for n in sdpa if "flash_attention_for_cpu_backward" in str(n.target)]
    query = attn.args[1].meta["val"]
    assert _scratch(attn, cache) >= query.numel() * query.element_size()
    (conv,) = _calls(graphs["conv"], aten.convolution_backward.default)
    assert _scratch(conv, cache) > 0
    assert all(_scratch(n, cache) == 0 for n in _calls(graphs["mlp"], aten.mm.default))
    for n in _all_calls(graphs):
        measured = kernel_memory(n, "cpu", cache)
        assert measured is None or (measured.scratch >= 0 and measured.storage >= 0)
        assert measured is None or not is_view(n), n.name


def test_output_storage_can_exceed_the_output():
    """CPU ``mse_loss`` returns its scalar in the input-sized buffer it reduced (torch
    2.13), which lives as long as the loss: the planner charges the measured storage."""
    x = torch.randn(8, 64)
    gm = _fake_graph(lambda g, a, b: g.call_function(aten.mse_loss.default, (a, b)), x, x)
    (mse,) = _calls(gm)
    measured = kernel_memory(mse, "cpu")
    assert output_bytes(mse) == 4
    assert measured.storage == x.numel() * x.element_size()
    (relu,) = _calls(_fake_graph(lambda g, a: g.call_function(aten.relu.default, (a,)), x))
    assert kernel_memory(relu, "cpu") == costs.KernelMemory(storage=output_bytes(relu), scratch=0)


def test_kernel_memory_inside_a_users_profiler_measures_storage_only():
    """Inside a user's profiler session scratch cannot be measured on CPU (sessions do not
    nest): the storage still is, scratch is 0, and the user's trace keeps recording."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(8, 64)
    gm = _fake_graph(lambda g, a, b: g.call_function(aten.mse_loss.default, (a, b)), x, x)
    (mse,) = _calls(gm)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert not costs.scratch_measurable("cpu")
        measured = kernel_memory(mse, "cpu")
        torch.ones(8).sum()
    assert measured == costs.KernelMemory(storage=x.numel() * x.element_size(), scratch=0)
    assert any(e.key == "aten::sum" for e in prof.key_averages())
    assert costs.scratch_measurable("cpu") and costs.scratch_measurable("cuda")


def test_kernel_memory_of_an_op_that_cannot_run_is_unknown_and_reported(caplog, monkeypatch):
    gm = _fake_graph(
        lambda g, x: g.call_function(torch.ops.remat_costs_test.boom.default, (x,)),
        torch.randn(64),
    )
    (boom,) = _calls(gm)
    with caplog.at_level(logging.WARNING, logger="remat.costs"):
        assert kernel_memory(boom, "cpu") is None
    assert "cannot run on synthetic data" in caplog.text and boom.name in caplog.text
    # Collectives are never run (not even to fail): no warning either.
    monkeypatch.setattr(cost_flags, "_COLLECTIVE_NAMESPACES", frozenset({"remat_costs_test"}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat.costs"):
        assert kernel_memory(boom, "cpu") is None
    assert caplog.text == ""


def test_fused_rnn_backward_is_never_run_on_synthetic_inputs(caplog):
    """mkldnn_rnn_layer_backward reads the workspace its forward kernel wrote (offsets and
    sizes in oneDNN's layout): on synthetic inputs it crashed the process (an nn.LSTM
    under allow_rnn). Its memory is the nominal one, its time the estimate, with a note."""
    from torch.fx.experimental.proxy_tensor import make_fx

    lstm = torch.nn.LSTM(8, 16, batch_first=True)
    names = [n for n, _ in lstm.named_parameters()]

    def step(x, *params):
        out, _ = torch.func.functional_call(lstm, dict(zip(names, params, strict=True)), (x,))
        return torch.autograd.grad(out.sum(), params)

    params = [p.detach().requires_grad_() for p in lstm.parameters()]
    gm = make_fx(step, tracing_mode="fake")(torch.randn(2, 5, 8), *params)
    backward = [
        n for n in gm.graph.nodes if n.target == torch.ops.aten.mkldnn_rnn_layer_backward.default
    ]
    assert backward, "the CPU LSTM's backward kernel changed: this test no longer covers it"
    with caplog.at_level(logging.WARNING, logger="remat.costs"):
        measured = {n.name: costs.kernel_memory(n, "cpu") for n in gm.graph.nodes}
    assert measured[backward[0].name] is None
    assert "reads a buffer its forward kernel wrote" in caplog.text
    forward = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mkldnn_rnn_layer.default)
    assert measured[forward.name] is not None  # the forward kernel is measured as usual
    timed = profile_seconds(gm, "cpu", repeat=1, warmup=0)
    assert backward[0].name in timed.fallbacks
    assert forward.name not in timed.fallbacks
