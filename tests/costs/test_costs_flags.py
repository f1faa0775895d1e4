"""``remat.costs.flags``: random ops and side effects, what may never be recomputed as
traced (collectives among them)."""

from __future__ import annotations

import torch
from sample_graphs import CPU, _calls, _fake_graph, aten

import remat.costs.flags as cost_flags
from remat.costs import (
    estimate_seconds,
    has_side_effects,
    is_random,
    profile_seconds,
)


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
