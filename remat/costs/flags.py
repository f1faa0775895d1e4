"""Flags that decide whether a node may be recomputed: randomness and side effects.

A random op draws from the global RNG, so a recompute differs; a node with side effects
must run exactly once. Collectives, asserts and ops that read an opaque buffer are
classified here too, for the measuring code that must not run them alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from remat.passes._torch_compat import (
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    is_python_random,
    is_torch_assert,
    op_schema,
)
from remat.passes.rng import DROPOUT_MASK

from ._fx import arg_value, hint, meta_val, tensors_of

__all__ = [
    "has_side_effects",
    "is_collective",
    "is_random",
    "random_numbers",
    "reads_opaque_buffer",
]


def random_numbers(node: fx.Node) -> int:
    """Random numbers ``node`` draws: one per output element of a random op or of a
    dropout mask (``remat::dropout_mask``, which is not random to the planner: it replays)."""
    if not (is_random(node) or node.target is DROPOUT_MASK):
        return 0
    return sum(hint(t.numel()) for t in tensors_of(meta_val(node)))


_HOP_RANDOM = frozenset({"run_and_save_rng_state"})


def is_random(node: fx.Node) -> bool:
    """Whether running ``node`` draws from the global RNG, so a recompute differs.

    Detected by ``torch.Tag.nondeterministic_seeded`` (native_dropout, bernoulli, rand*,
    randint, randperm, normal, uniform, ...). Attention kernels carry the tag for their
    dropout; with ``dropout_p == 0`` they draw nothing and are not random. Functionalised
    RNG (``rngprims.philox_rand``, ``run_with_rng_state``) takes its seed as an input and
    replays exactly, so it is not random; ``run_and_save_rng_state`` draws fresh state.
    """
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, HigherOrderOperator):
        return target.name() in _HOP_RANDOM
    if isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded not in target.tags:
            return False
        schema = op_schema(target)
        if any(a.name == "dropout_p" for a in schema.arguments):
            p = arg_value(node, schema, "dropout_p")
            return not (isinstance(p, (int, float)) and p == 0)
        return True
    # Python-level torch.rand & co. (torch IR graphs, not aten joint graphs).
    return is_python_random(target)


_ASSERT_OPS = frozenset(
    {
        "aten::_assert_async",
        "aten::_assert_scalar",
        "aten::_assert_tensor_metadata",
        "aten::_functional_assert_async",
        "aten::_functional_assert_scalar",
        "aten::sym_constrain_range",
        "aten::sym_constrain_range_for_size",
        "aten::_functional_sym_constrain_range",
        "aten::_functional_sym_constrain_range_for_size",
    }
)
_COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "symm_mem"}
)


def _is_assert(target: Any) -> bool:
    schema = op_schema(target)
    if schema is not None:
        return schema.name in _ASSERT_OPS
    return is_torch_assert(target)


def is_collective(target: Any) -> bool:
    if isinstance(target, (OpOverload, OpOverloadPacket)):
        return target.namespace in _COLLECTIVE_NAMESPACES
    return (getattr(target, "__module__", None) or "").startswith("torch.distributed")


# Backward kernels of fused RNNs: they read a buffer their forward kernel wrote in the
# library's own layout (offsets, sizes), which synthetic inputs cannot fake (one crashed
# the process: docs/cost-model.md, "Ops that never run alone"). Never run alone: their
# memory is the outputs' nominal bytes, their time the roofline estimate.
_OPAQUE_BUFFER_OPS = frozenset(
    {"aten::mkldnn_rnn_layer_backward", "aten::_cudnn_rnn_backward", "aten::miopen_rnn_backward"}
)


def reads_opaque_buffer(target: Any) -> bool:
    schema = op_schema(target)
    return schema is not None and schema.name in _OPAQUE_BUFFER_OPS


# Ops that update running stats in place although their schema declares no mutation
# (non-functionalised graphs only; AOT's joint graph uses the *_functional variants),
# with the argument that turns the update on.
_RUNNING_STATS_OPS = {
    "aten::native_batch_norm": "training",
    "aten::cudnn_batch_norm": "training",
    "aten::miopen_batch_norm": "training",
    "aten::_batch_norm_impl_index": "training",
    "aten::batch_norm": "training",
    "aten::instance_norm": "use_input_stats",
}


def _mutates_running_stats(node: fx.Node) -> bool:
    schema = op_schema(node.target)
    flag = _RUNNING_STATS_OPS.get(schema.name) if schema is not None else None
    if flag is None:
        return False
    return (
        arg_value(node, schema, flag) is True
        and arg_value(node, schema, "running_mean") is not None
    )


def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` must run exactly once (so it may never be recomputed).

    True for mutating ops (schema ``is_mutable``, and batch-norm variants that update
    running stats without declaring it), collectives, and whatever fx's ``is_impure``
    reports (effectful ops, profiler ranges, grad-mode switches). Randomness is reported
    by ``is_random`` instead. Asserts (``_assert_async``, ``_assert_scalar``,
    ``sym_constrain_range``...) are not side effects: re-running a check is harmless.
    """
    if node.op != "call_function":
        return node.op == "call_module" and node.is_impure()
    target = node.target
    if _is_assert(target):
        return False
    if is_collective(target):
        return True
    schema = op_schema(target)
    if schema is not None and schema.is_mutable:
        return True
    if _mutates_running_stats(node):
        return True
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # older fx without impure_random
        return node.is_impure() and not is_random(node)
