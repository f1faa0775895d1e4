"""``remat.costs.graph``: the bytes a node's output holds and allocates, the input it
aliases, its flops and the bytes it moves, each checked against torch: real storages at
run time, torch's own flop formulas."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from sample_graphs import CPU, _all_calls, _calls, _fake_graph, _sp, aten

from remat.costs import (
    aliased_input,
    allocated_bytes,
    bytes_moved,
    estimate_seconds,
    flops,
    has_side_effects,
    output_bytes,
)

# --------------------------------------------------------------------------------------
# Bytes and aliasing
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
# Flops and bytes moved
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
