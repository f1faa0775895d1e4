"""``remat.costs.device``: ``estimate_seconds``, the roofline, and the device specs it
reads (the CPU's, the CUDA table, a GPU it does not know)."""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
from sample_graphs import CPU, _calls, _fake_graph, aten

from remat.costs import (
    DeviceSpec,
    aliased_input,
    estimate_seconds,
)
from remat.passes.rng import APPLY_DROPOUT_MASK

# --------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------


def test_estimate_seconds_positive_for_ops_zero_for_views(graphs):
    for gm in graphs.values():
        for n in gm.graph.nodes:
            t = estimate_seconds(n, CPU)
            if n.op != "call_function" or n.target is operator.getitem:
                assert t == 0.0
            elif aliased_input(n) is not None or n.target in (aten.split.Tensor, aten.unbind.int):
                assert t == 0.0, n.format_node()
            else:
                assert t >= CPU.launch_overhead, n.format_node()


def test_estimate_seconds_is_a_roofline():
    def build(g, a, b, x):
        return (
            g.call_function(aten.mm.default, (a, b)),
            g.call_function(aten.relu.default, (x,)),
        )

    gm = _fake_graph(build, torch.randn(512, 512), torch.randn(512, 512), torch.randn(1 << 20))
    mm, relu = _calls(gm)
    spec = DeviceSpec("test", peak_flops=1e9, bandwidth=1e9, launch_overhead=1e-6)
    assert estimate_seconds(mm, spec) == pytest.approx(2 * 512**3 / 1e9 + 1e-6)  # compute bound
    assert estimate_seconds(relu, spec) == pytest.approx(8 * (1 << 20) / 1e9 + 1e-6)  # memory
    fast_mm = DeviceSpec("t", 1e9, 1e9, 1e-6, matmul_peaks=(("float32", 1e12),))
    assert estimate_seconds(mm, fast_mm) < estimate_seconds(mm, spec)
    assert estimate_seconds(relu, fast_mm) == estimate_seconds(relu, spec)  # not a matmul


def test_a_batched_matmul_runs_at_the_batched_rate_measured():
    """Attention's ``bmm`` passes the caches where a single matmul of its side stays in
    them: it runs at the single matmul's rate scaled as the measured batched one is."""

    def build(g, a, b, x, y):
        return (
            g.call_function(aten.mm.default, (a, b)),
            g.call_function(aten.bmm.default, (x, y)),
        )

    inputs = (torch.randn(512, 64), torch.randn(64, 512))
    gm = _fake_graph(build, *inputs, torch.randn(1, 512, 64), torch.randn(1, 64, 512))
    mm, bmm = _calls(gm)
    sides = (("float32", ((64, 8e10), (512, 1e11))),)
    spec = DeviceSpec("t", 1e12, 1e12, 0.0, matmul_sides=sides)
    assert estimate_seconds(bmm, spec) == pytest.approx(estimate_seconds(mm, spec))
    batched = dataclasses.replace(spec, batched_matmul=(("float32", 64, 6e10),))
    assert estimate_seconds(mm, batched) == estimate_seconds(mm, spec)  # not batched
    assert estimate_seconds(bmm, batched) == pytest.approx(estimate_seconds(mm, spec) * 8 / 6)


def test_an_op_that_runs_more_kernels_costs_them():
    """``_safe_softmax`` runs a mask's three kernels beside its softmax, CPU's
    ``native_dropout_backward`` a second multiply, ``tanh`` and remat's dropout replay
    run at their own measured rates, and ``pow`` by 3 is multiplied out."""

    def build(g, x, mask):
        return (
            g.call_function(aten._softmax.default, (x, -1, False)),
            g.call_function(aten._safe_softmax.default, (x, -1)),
            g.call_function(aten.native_dropout_backward.default, (x, mask, 1.25)),
            g.call_function(aten.tanh.default, (x,)),
            g.call_function(aten.exp.default, (x,)),
            g.call_function(APPLY_DROPOUT_MASK, (x, mask, 1.25)),
            g.call_function(aten.pow.Tensor_Scalar, (x, 3.0)),
            g.call_function(aten.pow.Tensor_Scalar, (x, 2.7)),
            g.call_function(aten.add.Tensor, (x, 1.0)),
        )

    x, mask = torch.randn(1 << 20), torch.ones(1 << 20, dtype=torch.bool)
    calls = _calls(_fake_graph(build, x, mask))
    softmax, safe, dropout_backward, tanh, exp, replay, cube, power, add = calls
    cpu = DeviceSpec("c", 1e12, 1e9, 0.0, transcendental_rate=1e12, cpu=True)
    gpu = dataclasses.replace(cpu, cpu=False)
    # isneginf (4 + 1 bytes an element), all (1), where (4 + 4): 14 bytes an element more
    assert estimate_seconds(safe, cpu) - estimate_seconds(softmax, cpu) == pytest.approx(
        14 * (1 << 20) / 1e9
    )
    assert estimate_seconds(dropout_backward, cpu) - estimate_seconds(
        dropout_backward, gpu
    ) == pytest.approx(8 * (1 << 20) / 1e9)  # read and write the output once more
    timed = dataclasses.replace(cpu, transcendental_rate=1e8, tanh_rate=1e7, replay_rate=1e6)
    timed = dataclasses.replace(timed, softmax_mask_rate=1e6)
    assert estimate_seconds(safe, timed) - estimate_seconds(softmax, timed) == pytest.approx(
        (1 << 20) / 1e6
    )
    assert estimate_seconds(tanh, timed) == pytest.approx((1 << 20) / 1e7)
    assert estimate_seconds(exp, timed) == pytest.approx((1 << 20) / 1e8)
    assert estimate_seconds(replay, timed) == pytest.approx((1 << 20) / 1e6)
    assert estimate_seconds(tanh, cpu) == estimate_seconds(exp, cpu)  # not measured: exp's
    assert estimate_seconds(cube, timed) == estimate_seconds(add, timed)  # x * x * x
    assert estimate_seconds(power, timed) == estimate_seconds(exp, timed)


# --------------------------------------------------------------------------------------
# Device specs
# --------------------------------------------------------------------------------------


def test_cpu_spec():
    spec = DeviceSpec.for_device(torch.device("cpu"))
    assert spec.peak_flops == pytest.approx(5e10 * torch.get_num_threads())
    assert spec.bandwidth == 2e10 and spec.launch_overhead == 5e-6
    assert spec.matmul_peak(torch.bfloat16) == spec.peak_flops


class _Props:
    def __init__(self, name, mem_gib):
        self.name, self.total_memory = name, mem_gib * 2**30


@pytest.mark.parametrize(
    "gpu, fp32, bf16, bw",
    [
        ("NVIDIA H100 80GB HBM3", 67e12, 989.5e12, 3.35e12),
        ("NVIDIA H100 PCIe", 51e12, 756.5e12, 2.0e12),
        ("NVIDIA H200", 67e12, 989.5e12, 4.8e12),
        ("NVIDIA A100-SXM4-80GB", 19.5e12, 312e12, 2.0e12),
        ("NVIDIA A100-SXM4-40GB", 19.5e12, 312e12, 1.555e12),
        ("Some Future GPU", 1e13, 5e13, 5e11),
    ],
)
def test_cuda_spec_table(monkeypatch, gpu, fp32, bf16, bw):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mem = 40 if "40GB" in gpu else 80
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(gpu, mem))
    spec = DeviceSpec.for_device("cuda")
    assert (spec.peak_flops, spec.bandwidth) == (fp32, bw)
    assert spec.matmul_peak(torch.bfloat16) == bf16
    assert gpu in spec.name
    # fp32 matmuls use TF32 tensor cores only when torch is allowed to.
    assert spec.matmul_peak(torch.float32) == fp32
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert DeviceSpec.for_device("cuda:0").matmul_peak(torch.float32) >= fp32


def test_cuda_spec_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = DeviceSpec.for_device("cuda")
    assert spec.peak_flops > 0 and spec.bandwidth > 0 and "unknown" in spec.name
