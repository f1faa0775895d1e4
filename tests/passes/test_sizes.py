"""Sizes of graphs traced with symbolic shapes (``passes/sizes.py``), and a problem grown
to larger sizes without measuring again (``Extracted.grown``)."""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition

from remat.costs import CostModel
from remat.passes.extract import extract
from remat.passes.sizes import Sizes, covers, hint, larger, no_guards, reading_at
from remat.solvers import store_all


class _Block(torch.nn.Module):
    """A small transformer block: its bytes grow as the sequence (attention as its square)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = F.softmax(q @ k.transpose(1, 2), dim=-1)
        return self.out(att @ v).square().mean()


def _symbolic_joint(seq: int = 24) -> tuple[torch.fx.GraphModule, int]:
    captured = {}

    def partition(joint, joint_inputs, **kw):
        captured["joint"], captured["n"] = joint, kw["num_fwd_outputs"]
        return default_partition(joint, joint_inputs, **kw)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition,
    )
    torch._dynamo.reset()
    x = torch.randn(2, seq, 16)
    torch._dynamo.mark_dynamic(x, 1)
    torch.compile(_Block(), backend=backend)(x).backward()
    return captured["joint"], captured["n"]


def _symbol(joint) -> sympy.Symbol:
    (symbol,) = {s for s, _, _ in Sizes.of(joint).where}
    return symbol


def test_sizes_name_the_symbols_where_inputs_carry_them_and_read_them_off_real_inputs():
    joint, _ = _symbolic_joint(seq=24)
    sizes = Sizes.of(joint)
    assert sizes and len(sizes.where) == 1
    symbol = _symbol(joint)
    assert sizes.hints() == {symbol: 24}
    primals = [p for p in joint.graph.find_nodes(op="placeholder")]
    args = [
        torch.empty([40 if isinstance(s, torch.SymInt) else s for s in p.meta["val"].shape])
        if isinstance(p.meta["val"], torch.Tensor)
        else 40
        for p in primals
    ]
    assert sizes.read(args) == {symbol: 40}
    assert not Sizes.of(_static_graph())


def _static_graph() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    graph.output(x)
    return torch.fx.GraphModule({}, graph)


def test_hint_reads_a_size_at_the_binding_and_never_guards():
    joint, _ = _symbolic_joint(seq=24)
    symbol = _symbol(joint)
    env = next(
        s.node.shape_env
        for p in joint.graph.find_nodes(op="placeholder")
        if isinstance(p.meta["val"], torch.Tensor)
        for s in p.meta["val"].shape
        if isinstance(s, torch.SymInt)
    )
    x = next(
        p.meta["val"]
        for p in joint.graph.find_nodes(op="placeholder")
        if isinstance(p.meta["val"], torch.Tensor) and p.meta["val"].dim() == 3
    )
    guards = len(env.guards)
    assert hint(x.numel()) == 2 * 24 * 16
    with reading_at({symbol: 100}):
        assert hint(x.numel()) == 2 * 100 * 16
        assert hint(x.shape[1] * x.shape[1]) == 100 * 100
    assert hint(x.shape[1]) == 24  # outside the block: the hint again
    with no_guards(joint):
        assert bool(x.shape[1] == 24)  # a comparison is read at the hint...
    assert len(env.guards) == guards  # ...and adds no guard that would specialise the graph


def test_covers_and_larger():
    s, t = sympy.symbols("s t", positive=True, integer=True)
    assert covers({s: 10, t: 4}, {s: 10, t: 3})
    assert not covers({s: 10, t: 4}, {s: 11, t: 3})
    assert covers({}, {})
    assert larger({s: 10, t: 4}, {s: 11, t: 3}) == {s: 11, t: 4}


def test_a_grown_problem_is_the_problem_extracted_at_the_larger_sizes():
    """Growing a problem scales what was measured instead of measuring again: a tensor's
    own bytes exactly (attention's square too), and every plan's peak with them."""
    joint, n = _symbolic_joint(seq=24)
    symbol = _symbol(joint)
    facts = {}

    def extracted_at(seq: int):
        binding = {symbol: seq}
        with no_guards(joint), reading_at(binding):
            facts[seq] = CostModel.for_graph("roofline", joint, torch.device("cpu"), "eager")
            return extract(joint, n, facts[seq])

    small, big = extracted_at(24), extracted_at(96)
    grown = small.grown({symbol: 24}, {symbol: 96})
    assert [node.bytes for node in grown.problem.nodes] == [
        node.bytes for node in big.problem.nodes
    ]
    assert grown.problem.resident_bytes == big.problem.resident_bytes
    pairs = zip(big.problem.nodes, small.problem.nodes, strict=True)
    assert any(b.bytes > 4 * s.bytes > 0 for b, s in pairs)  # attention: 16x the bytes
    assert store_all(grown.problem).peak == store_all(big.problem).peak
