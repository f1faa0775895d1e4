"""Tests for remat.costs, grounded in real AOTAutograd joint graphs and real tensors."""

from __future__ import annotations

import logging
import operator
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import remat.costs.flags as cost_flags
import remat.costs.measured as cost_measured
from remat import costs
from remat.costs import (
    DeviceSpec,
    aliased_input,
    allocated_bytes,
    bytes_moved,
    estimate_seconds,
    flops,
    has_side_effects,
    is_random,
    kernel_memory,
    output_bytes,
    profile_seconds,
)
from remat.costs.graph import is_view

aten = torch.ops.aten
CPU = DeviceSpec.for_device("cpu")


# --------------------------------------------------------------------------------------
# Sample graphs (traced once per file)
# --------------------------------------------------------------------------------------


def _joint(model: torch.nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    captured = {}

    def partition(joint_gm, joint_inputs, **kw):
        captured["gm"] = joint_gm
        return default_partition(joint_gm, joint_inputs, **kw)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition,
    )
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(*inputs)
    out.sum().backward()
    return captured["gm"]


class _Block(torch.nn.Module):
    """Transformer block with explicit attention (bmm, softmax, dropout)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.ln = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.o = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.1)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.h, -1).transpose(1, 2)
        k = k.reshape(b, t, self.h, -1).transpose(1, 2)
        v = v.view(b, t, self.h, -1).permute(0, 2, 1, 3)
        a = self.drop(((q @ k.transpose(-2, -1)) / (d // self.h) ** 0.5).softmax(-1))
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff(x)


class _ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1)


class _Views(torch.nn.Module):
    """split/unbind/view/reshape/transpose/expand/slice/select chain."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 48)

    def forward(self, x):
        a, b, c = self.lin(x).split(16, dim=1)
        d, e = a.view(-1, 2, 8).unbind(1)
        y = (a * b + c).t().reshape(-1)
        return (
            y.sum()
            + (d * e).sum()
            + x.expand(2, -1, -1).sum()
            + x[1:, ::2].sum()
            + x.unsqueeze(0).squeeze(0).select(1, 0).sum()
        )


class _SDPA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.lin(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.fixture(scope="module")
def graphs() -> dict[str, fx.GraphModule]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 8),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "mlp": _joint(mlp, torch.randn(32, 64)),
            "block": _joint(_Block(), torch.randn(2, 8, 32)),
            "conv": _joint(_ConvBN(), torch.randn(2, 3, 8, 8)),
            "views": _joint(_Views(), torch.randn(4, 16, requires_grad=True)),
            "sdpa": _joint(_SDPA(), torch.randn(2, 8, 16)),
        }


def _calls(gm: fx.GraphModule, target=None) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and (target is None or n.target == target)
    ]


def _all_calls(graphs) -> list[fx.Node]:
    return [n for gm in graphs.values() for n in _calls(gm)]


def _fake_graph(build, *examples: torch.Tensor) -> fx.GraphModule:
    """Hand-built aten graph with FakeTensor metadata, for ops AOT does not emit."""
    g = fx.Graph()
    ins = [g.placeholder(f"x{i}") for i in range(len(examples))]
    g.output(build(g, *ins))
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(e) for e in examples])
    return gm


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _sp(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------


def test_output_bytes_of_known_shapes(graphs):
    gm = graphs["mlp"]
    (addmm, _) = _calls(gm, aten.addmm.default)
    assert output_bytes(addmm) == 32 * 64 * 4
    (ln,) = _calls(gm, aten.native_layer_norm.default)
    assert output_bytes(ln) == 32 * 64 * 4 + 2 * 32 * 1 * 4  # out, mean, rstd
    (drop,) = _calls(gm, aten.native_dropout.default)
    assert output_bytes(drop) == 32 * 64 * 4 + 32 * 64 * 1  # out + bool mask
    mask = next(u for u in drop.users if u.args[1] == 1)
    assert output_bytes(mask) == 32 * 64
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert output_bytes(placeholders[0]) == 64 * 64 * 4 and allocated_bytes(placeholders[0]) == 0
    assert output_bytes(gm.graph.output_node()) == 0
    # Backward op with output_mask holes (None entries) counts only real tensors.
    (lnb,) = _calls(graphs["block"], aten.native_layer_norm_backward.default)
    assert lnb.meta["val"][0] is None and output_bytes(lnb) == 2 * 32 * 4


def test_symint_and_none_values_have_no_bytes():
    gm = _fake_graph(lambda g, x: g.call_function(aten.sym_size.int, (x, 0)), torch.randn(3, 5))
    (n,) = _calls(gm)
    assert output_bytes(n) == 0 and allocated_bytes(n) == 0
    assert estimate_seconds(n, CPU) == 0.0


_VIEW_OPS = {
    aten.t.default,
    aten.view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.detach.default,
    aten._unsafe_view.default,
}


def test_views_allocate_nothing_and_report_their_base(graphs):
    seen = set()
    for n in _all_calls(graphs):
        if n.target in _VIEW_OPS:
            seen.add(n.target)
            assert aliased_input(n) is n.args[0], n.format_node()
            assert allocated_bytes(n) == 0
            assert output_bytes(n) > 0
    assert seen == _VIEW_OPS  # every listed view op occurs in the sample graphs
    # A view of a parameter names the placeholder.
    t = _calls(graphs["mlp"], aten.t.default)[0]
    assert aliased_input(t).op == "placeholder"


def test_fresh_ops_are_not_aliases(graphs):
    for target in (aten.addmm.default, aten.clone.default, aten.gelu.default, aten.cat.default):
        for n in _calls(graphs["block"], target):
            assert aliased_input(n) is None
            assert allocated_bytes(n) == output_bytes(n) > 0


def test_getitem_of_fresh_multi_output_is_its_own_tensor(graphs):
    for target in (aten.native_layer_norm.default, aten.native_dropout.default):
        (op,) = _calls(graphs["mlp"], target)
        items = [u for u in op.users if u.target is operator.getitem]
        assert items
        for item in items:
            assert aliased_input(item) is None  # not an alias of the tuple node
            assert allocated_bytes(item) == 0  # the op allocated it...
            assert output_bytes(item) > 0  # ...and the getitem owns this much of it
        # The op carries the allocation of all its outputs, once.
        assert allocated_bytes(op) == output_bytes(op) == sum(map(output_bytes, items))


def test_getitem_of_split_and_unbind_aliases_the_input(graphs):
    for target in (aten.split.Tensor, aten.unbind.int):
        for op in _calls(graphs["views"], target) + _calls(graphs["block"], target):
            assert allocated_bytes(op) == 0
            assert aliased_input(op) is op.args[0]
            for item in op.users:
                assert aliased_input(item) is op.args[0]
                assert allocated_bytes(item) == 0
                assert estimate_seconds(item, CPU) == 0.0


def test_runtime_storage_facts():
    """The facts the alias model rests on, on real CPU tensors."""
    x = torch.randn(4, 6)
    # _unsafe_view has no alias annotation in its schema, yet shares storage.
    assert aten._unsafe_view.default._schema.returns[0].alias_info is None
    assert _sp(aten._unsafe_view.default(x, [24])) == _sp(x)
    # reshape is annotated Tensor(a) but copies a non-viewable input.
    assert _sp(aten.reshape.default(x, [24])) == _sp(x)
    assert _sp(aten.reshape.default(x.t(), [24])) != _sp(x)
    # AOT decomposes that copy into clone + _unsafe_view: the clone allocates.
    c = aten.clone.default(x.t(), memory_format=torch.contiguous_format)
    assert _sp(c) != _sp(x) and _sp(aten._unsafe_view.default(c, [24])) == _sp(c)
    # split outputs share the input; native_layer_norm/native_dropout outputs are fresh.
    assert all(_sp(p) == _sp(x) for p in aten.split.Tensor(x, 2))
    assert all(_sp(p) == _sp(x) for p in aten.unbind.int(x, 0))
    outs = aten.native_layer_norm.default(x, [6], None, None, 1e-5)
    assert len({_sp(o) for o in outs} | {_sp(x)}) == 4
    outs = aten.native_dropout.default(x, 0.5, True)
    assert len({_sp(o) for o in outs} | {_sp(x)}) == 3
    # In-place and out= results are the mutated tensor itself.
    y = torch.randn(6)
    assert _sp(aten.add_.Tensor(y, 1)) == _sp(y)
    out = torch.empty(4, 6)
    assert _sp(aten.add.out(x, x, out=out)) == _sp(out)


class _StorageRecorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        v = super().run_node(n)
        self.values[n] = v
        return v


def _real_inputs(gm: fx.GraphModule) -> list:
    vals = []
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta["val"]
        if v.is_floating_point():
            vals.append(torch.randn(v.shape, dtype=v.dtype))
        else:
            vals.append(torch.zeros(v.shape, dtype=v.dtype))
    return vals


@pytest.mark.parametrize("name", ["mlp", "block", "conv", "views", "sdpa"])
def test_alias_model_matches_runtime_storage(graphs, name):
    """Run the joint graph on real tensors: every alias claim holds on real storage."""
    gm = graphs[name]
    rec = _StorageRecorder(gm)
    with torch.no_grad():
        rec.run(*_real_inputs(gm))
    for n in _calls(gm):
        out = rec.values[n]
        if not isinstance(out, torch.Tensor) or out.numel() == 0:
            continue
        base = aliased_input(n)
        if base is not None:
            assert _sp(out) == _sp(rec.values[base]), n.format_node()
            continue
        # Fresh: shares storage with no tensor input (nor with a getitem parent's inputs).
        src = n.args[0] if n.target is operator.getitem else n
        for inp in src.all_input_nodes:
            v = rec.values.get(inp, None)
            if isinstance(v, torch.Tensor) and v.numel():
                assert _sp(out) != _sp(v), n.format_node()
        if n.target is not operator.getitem:
            assert allocated_bytes(n) == output_bytes(n) > 0


def test_views_are_found_from_schema_not_a_list():
    def build(g, x):
        return (
            g.call_function(aten.alias.default, (x,)),
            g.call_function(aten.as_strided.default, (x, [2, 2], [1, 2])),
            g.call_function(aten.diagonal.default, (x,)),
            g.call_function(aten.unfold.default, (x, 1, 2, 1)),
            g.call_function(aten.view.dtype, (x, torch.int32)),
            g.call_function(aten._reshape_alias.default, (x, [16], [1])),
            g.call_function(aten.chunk.default, (x, 2)),
            g.call_function(aten.split_with_sizes.default, (x, [1, 3])),
        )

    gm = _fake_graph(build, torch.randn(4, 4))
    (x,) = gm.graph.find_nodes(op="placeholder")
    for n in _calls(gm):
        assert aliased_input(n) is x and allocated_bytes(n) == 0, n.format_node()
        assert estimate_seconds(n, CPU) == 0.0


def test_reshape_contiguous_and_inplace_follow_runtime():
    def build(g, x, y):
        t = g.call_function(aten.t.default, (x,))
        return (
            g.call_function(aten.reshape.default, (x, [24])),
            g.call_function(aten.reshape.default, (t, [24])),
            g.call_function(aten.contiguous.default, (x,)),
            g.call_function(aten.contiguous.default, (t,)),
            g.call_function(aten.add_.Tensor, (y, 1)),
            g.call_function(aten.add.out, (y, y), {"out": y}),
        )

    gm = _fake_graph(build, torch.randn(4, 6), torch.randn(6))
    x, y = gm.graph.find_nodes(op="placeholder")
    view_reshape, copy_reshape = _calls(gm, aten.reshape.default)
    assert aliased_input(view_reshape) is x and allocated_bytes(view_reshape) == 0
    assert aliased_input(copy_reshape) is None and allocated_bytes(copy_reshape) == 96
    view_contig, copy_contig = _calls(gm, aten.contiguous.default)
    assert aliased_input(view_contig) is x and aliased_input(copy_contig) is None
    # In-place results alias the mutated input (no allocation) but are real work.
    for n in _calls(gm, aten.add_.Tensor) + _calls(gm, aten.add.out):
        assert aliased_input(n) is y and allocated_bytes(n) == 0
        assert bytes_moved(n) > 0 and estimate_seconds(n, CPU) > CPU.launch_overhead
        assert has_side_effects(n)


# --------------------------------------------------------------------------------------
# Flops and time
# --------------------------------------------------------------------------------------


def _shape(n):
    return tuple(n.meta["val"].shape)


def test_matmul_flops_are_2mnk(graphs):
    checked = 0
    for n in _all_calls(graphs):
        if n.target == aten.mm.default:
            (m, k), (_, p) = _shape(n.args[0]), _shape(n.args[1])
        elif n.target == aten.addmm.default:
            (m, k), (_, p) = _shape(n.args[1]), _shape(n.args[2])
        elif n.target == aten.bmm.default:
            (b, m, k), (_, _, p) = _shape(n.args[0]), _shape(n.args[1])
            assert flops(n) == 2 * b * m * k * p
            checked += 1
            continue
        else:
            continue
        assert flops(n) == 2 * m * k * p, n.format_node()
        checked += 1
    assert checked >= 20


def test_vector_matmul_flops():
    def build(g, m, v, b3, c):
        bt = g.call_function(aten.transpose.int, (b3, 1, 2))
        return (
            g.call_function(aten.mv.default, (m, v)),
            g.call_function(aten.dot.default, (v, v)),
            g.call_function(
                aten.addmv.default, (g.call_function(aten.select.int, (c, 0, 0)), m, v)
            ),
            g.call_function(aten.addbmm.default, (c, b3, bt)),
        )

    examples = torch.randn(6, 5), torch.randn(5), torch.randn(3, 6, 5), torch.randn(6, 6)
    gm = _fake_graph(build, *examples)
    got = {n.target: flops(n) for n in _calls(gm)}
    assert got[aten.mv.default] == got[aten.addmv.default] == 2 * 6 * 5
    assert got[aten.dot.default] == 2 * 5
    assert got[aten.addbmm.default] == 2 * 3 * 6 * 5 * 6


def test_conv_and_attention_flops_use_torch_formulas(graphs):
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    (conv,) = _calls(graphs["conv"], aten.convolution.default)
    out, w = conv.meta["val"], conv.args[1].meta["val"]
    assert flops(conv) == 2 * out.numel() * w[0].numel()  # 2 * outputs * Cin*kh*kw
    (conv_bw,) = _calls(graphs["conv"], aten.convolution_backward.default)
    assert flops(conv_bw) > 0

    gm = graphs["sdpa"]
    (fwd,) = _calls(gm, aten._scaled_dot_product_flash_attention_for_cpu.default)
    (bwd,) = _calls(gm, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    q, k, v = (a.meta["val"].shape for a in fwd.args[:3])
    assert flops(fwd) == sdpa_flop_count(q, k, v) > 0
    assert flops(bwd) == sdpa_backward_flop_count(q, q, k, v) > 0


def test_pointwise_and_reduction_estimates(graphs):
    (relu,) = _calls(graphs["conv"], aten.relu.default)
    assert flops(relu) == relu.meta["val"].numel()  # one per output element
    for s in _calls(graphs["mlp"], aten.sum.dim_IntList):
        assert flops(s) == s.args[0].meta["val"].numel()  # one per input element
    (add,) = _calls(graphs["conv"], aten.add.Tensor)  # num_batches_tracked + 1
    assert flops(add) == 1
    # Views, getitems and placeholders do no arithmetic.
    for n in _calls(graphs["block"], aten.view.default) + _calls(graphs["block"], operator.getitem):
        assert flops(n) == 0 and bytes_moved(n) == 0


def test_bytes_moved_reads_inputs_and_writes_outputs(graphs):
    (gelu,) = _calls(graphs["mlp"], aten.gelu.default)
    assert bytes_moved(gelu) == 2 * 32 * 64 * 4
    (mask_bw,) = _calls(graphs["mlp"], aten.native_dropout_backward.default)
    assert bytes_moved(mask_bw) == 32 * 64 * (4 + 1 + 4)  # grad + bool mask + out

    def build(g, w, idx, x):
        e = g.call_function(aten.expand.default, (x, [8, 16]))
        return (
            g.call_function(aten.embedding.default, (w, idx)),
            g.call_function(aten.clone.default, (e,)),
        )

    gm = _fake_graph(
        build, torch.randn(1000, 16), torch.zeros(4, dtype=torch.long), torch.randn(1, 16)
    )
    (emb,) = _calls(gm, aten.embedding.default)
    # Only the gathered rows are read, not the whole 64 kB table.
    assert bytes_moved(emb) == 4 * 16 * 4 + 4 * 8 + 4 * 16 * 4
    assert flops(emb) == 4 * 16
    (clone,) = _calls(gm, aten.clone.default)
    assert bytes_moved(clone) == 16 * 4 + 8 * 16 * 4  # a broadcast input is read once


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


# --------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------


def test_random_ops_detected(graphs):
    for name in ("mlp", "block", "conv"):
        assert all(is_random(n) for n in _calls(graphs[name], aten.native_dropout.default))
        assert not any(is_random(n) for n in _calls(graphs[name], aten.relu.default))
    randoms = [n.target for g in graphs.values() for n in _calls(g) if is_random(n)]
    assert set(randoms) == {aten.native_dropout.default}
    # CPU flash attention carries the seeded tag, but with dropout_p == 0 it draws nothing.
    (sdpa,) = _calls(graphs["sdpa"], aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert torch.Tag.nondeterministic_seeded in sdpa.target.tags and not is_random(sdpa)

    def build(g, x, q):
        return (
            g.call_function(aten.rand_like.default, (x,)),
            g.call_function(aten.bernoulli.p, (x, 0.5)),
            g.call_function(aten.randint.low, (0, 10, [4])),
            g.call_function(
                aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.5)
            ),
            g.call_function(aten.relu.default, (x,)),
        )

    gm = _fake_graph(build, torch.randn(4), torch.randn(1, 2, 4, 8))
    assert [is_random(n) for n in _calls(gm)] == [True, True, True, True, False]


def test_side_effects(graphs):
    def build(g, x, y, b, idx):
        return (
            g.call_function(aten.copy_.default, (x, y)),
            g.call_function(aten.index_put_.default, (x, [idx], y)),
            g.call_function(aten.native_batch_norm.default, (x, None, None, b, b, True, 0.1, 1e-5)),
            g.call_function(
                aten.native_batch_norm.default, (x, None, None, b, b, False, 0.1, 1e-5)
            ),
            g.call_function(aten._assert_async.msg, (g.call_function(aten.any.default, (x,)), "m")),
            g.call_function(aten.relu.default, (x,)),
        )

    gm = _fake_graph(
        build,
        torch.randn(4, 3),
        torch.randn(4, 3),
        torch.zeros(3),
        torch.zeros(4, dtype=torch.long),
    )
    got = {n.name: has_side_effects(n) for n in _calls(gm)}
    assert got == {
        "copy__default": True,
        "index_put__default": True,
        "native_batch_norm_default": True,  # updates running stats, schema says nothing
        "native_batch_norm_default_1": False,  # eval: no update
        "any_default": False,
        "_assert_async_msg": False,  # checks may be re-run
        "relu_default": False,
    }
    # The functionalised joint graph has no side effects: BN returns new stats instead.
    for gm in graphs.values():
        assert not any(has_side_effects(n) for n in gm.graph.nodes), gm
    # Random is reported separately, not as a side effect.
    (drop,) = _calls(graphs["mlp"], aten.native_dropout.default)
    assert is_random(drop) and not has_side_effects(drop)


def test_collectives_are_side_effects_and_never_profiled(monkeypatch):
    gm = _fake_graph(lambda g, x: g.call_function(aten.relu.default, (x,)), torch.randn(4))
    (n,) = _calls(gm)
    monkeypatch.setattr(cost_flags, "_COLLECTIVE_NAMESPACES", frozenset({"aten"}))
    assert has_side_effects(n)
    res = profile_seconds(gm, "cpu")
    assert "collective" in res.fallbacks[n.name] and res[n.name] == estimate_seconds(n, CPU)


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


# --------------------------------------------------------------------------------------
# Profiling
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
# Kernel memory (measured)
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


# --------------------------------------------------------------------------------------
# Cost-model registry
# --------------------------------------------------------------------------------------


def test_cost_model_names_are_checked_against_one_registry():
    from remat.errors import InvalidOption
    from remat.tools import bench, cli

    COST_MODELS = costs.COST_MODELS
    assert cli.COST_MODELS is bench.COST_MODELS is COST_MODELS == ("roofline", "profile")
    assert all(costs.check_cost_model(name) == name for name in COST_MODELS)
    with pytest.raises(InvalidOption, match="'guess'; choose one of roofline, profile"):
        costs.check_cost_model("guess")
    with pytest.raises(ValueError):  # what callers caught before InvalidOption existed
        costs.CostModel.for_graph("guess", fx.GraphModule({}, fx.Graph()), torch.device("cpu"))


def test_cost_model_for_graph_times_kernels_only_when_profiling():
    gm = _fake_graph(lambda g, x: g.call_function(aten.relu.default, (x,)), torch.randn(64))
    (relu,) = _calls(gm)
    cpu = torch.device("cpu")
    roofline = costs.CostModel.for_graph("roofline", gm, cpu)
    assert roofline.measured == {} and roofline.spec == CPU
    assert roofline.seconds(relu) == estimate_seconds(relu, CPU)
    profiled = costs.CostModel.for_graph("profile", gm, cpu)
    assert profiled.seconds(relu) == profiled.measured[relu.name] > 0
    assert profiled.allocated_bytes(relu) == 64 * 4 and profiled.recomputable(relu)
