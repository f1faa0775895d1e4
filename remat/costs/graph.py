"""Pure graph facts: what each node of a joint graph allocates, aliases, moves and computes.

Read off the node, its op schema and its fake metadata; no global state, nothing runs.
The memory model the planner and the simulator rely on (why: docs/cost-model.md,
"Memory model"):

* ``output_bytes(n)``: bytes of the tensors ``n``'s value refers to (``numel * itemsize``,
  summed over tuple outputs; aliases are not deduplicated).
* ``aliased_input(n)``: the input node whose storage ``n``'s output shares at runtime, or
  None when ``n`` returns fresh memory. Follow it repeatedly to reach the storage owner.
* ``allocated_bytes(n)``: bytes that come into existence when ``n`` runs. A multi-output
  op carries all its fresh outputs' bytes; each ``getitem`` of it allocates 0 but is not
  an alias: it owns its storage, which can outlive its siblings'. Outputs nobody reads
  die right after the op.

``bytes_moved(n)`` and ``flops(n)`` are the two terms of the roofline (``remat.costs.device``).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from remat.passes._torch_compat import (
    HigherOrderOperator,
    OpOverload,
    op_schema,
    storage_of,
    tree_map,
)

from ._fx import (
    arg_value,
    distinct_bytes,
    hint,
    input_nodes,
    meta_val,
    nbytes,
    same_storage,
    tensors_of,
)

log = logging.getLogger(__name__)

aten = torch.ops.aten

__all__ = [
    "aliased_input",
    "allocated_bytes",
    "bytes_moved",
    "flop_formula",
    "flops",
    "is_kernel",
    "is_pointwise",
    "is_view",
    "output_bytes",
]


# --------------------------------------------------------------------------------------
# Aliasing and bytes
# --------------------------------------------------------------------------------------

# Ops whose schema has no alias annotation but whose kernel returns its input's storage.
# _unsafe_view: verified with data_ptr (tests): it is `view` minus autograd view tracking,
# which is why AOT emits it after `clone` when decomposing a non-viewable reshape. Only
# consulted when the node has no fake metadata; otherwise fake storages decide.
_RUNTIME_ALIAS_OPS = frozenset({"aten::_unsafe_view"})


def _schema_alias_arg(node: fx.Node, ret_index: int | None) -> tuple[Any, bool] | None:
    """(argument value, is_write) that return ``ret_index`` aliases per the schema.

    ``ret_index=None`` asks about any return (single-output ops). A ``Tensor(a)[]`` return
    (split, unbind, chunk) has its alias set on the list elements, so its before_set is
    empty; it then aliases the one annotated argument.
    """
    schema = op_schema(node.target)
    if schema is None:
        return None
    rets = list(schema.returns)
    if len(rets) == 1:
        ret_index = 0
    if ret_index is None or ret_index >= len(rets):
        return None
    info = rets[ret_index].alias_info
    if info is None:
        return None
    annotated = [a for a in schema.arguments if a.alias_info is not None]
    for arg in annotated:
        if info.before_set and info.before_set & arg.alias_info.before_set:
            return arg_value(node, schema, arg.name), info.is_write
    if not info.before_set and len(annotated) == 1:
        return arg_value(node, schema, annotated[0].name), info.is_write
    return None


def _alias_of(node: fx.Node, op_node: fx.Node, ret_index: int | None) -> fx.Node | None:
    """Input of ``op_node`` that ``node`` (its output, or a getitem of it) shares storage with.

    Fake tensors record storage sharing exactly as the kernels do at runtime, so they are
    the arbiter when present: they veto schema aliases that copy at runtime (reshape or
    contiguous of a non-viewable input) and find unannotated aliases (_unsafe_view).
    """
    out_storage = storage_of(meta_val(node))
    claim = _schema_alias_arg(op_node, ret_index)
    if claim is not None and isinstance(claim[0], fx.Node):
        base = claim[0]
        base_storage = storage_of(meta_val(base))
        if out_storage is None or base_storage is None or same_storage(out_storage, base_storage):
            return base
        return None
    if out_storage is not None:
        for inp in input_nodes(op_node):
            if same_storage(storage_of(meta_val(inp)), out_storage):
                return inp
        return None
    schema = op_schema(op_node.target)
    if schema is not None and schema.name in _RUNTIME_ALIAS_OPS and op_node.args:
        first = op_node.args[0]
        return first if isinstance(first, fx.Node) else None
    return None


def aliased_input(node: fx.Node) -> fx.Node | None:
    """Input node whose storage ``node``'s output shares at runtime, else None.

    Views (schema ``Tensor(a)`` returns: view, t, transpose, permute, expand, slice,
    select, split/unbind/chunk outputs, detach, alias, ...) alias their base; so do
    ``_unsafe_view`` (no annotation, but shares storage) and in-place/out= ops, whose
    result *is* the mutated tensor (``Tensor(a!)``): none of them allocate. A getitem of a
    multi-output op aliases that op's input only when the op returns views (split), never
    the tuple node itself: outputs of native_layer_norm/native_dropout are fresh tensors.
    """
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent, index = node.args[0], node.args[1]
        if not isinstance(parent, fx.Node) or parent.op != "call_function":
            return None
        return _alias_of(node, parent, index if isinstance(index, int) else None)
    if not isinstance(node.target, OpOverload):
        return None
    if isinstance(meta_val(node), (list, tuple)):
        # split/unbind/chunk: the list is views of the input; other multi-output ops are
        # decided per getitem.
        if not is_view(node):
            return None
        claim = _schema_alias_arg(node, 0)
        return claim[0] if claim is not None and isinstance(claim[0], fx.Node) else None
    return _alias_of(node, node, None)


def is_view(node: fx.Node) -> bool:
    """A free op: it only builds new tensor metadata over an input's storage.

    In-place ops alias their input too but do work, so they are not views.
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    schema = op_schema(node.target)
    if schema is None or schema.is_mutable:
        return False
    if isinstance(meta_val(node), (list, tuple)):
        # split/unbind/chunk: every tensor output is a view of the (single) input.
        rets = schema.returns
        return bool(rets) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in rets
        )
    return aliased_input(node) is not None


def output_bytes(node: fx.Node) -> int:
    """Bytes of the tensors ``node`` returns (numel * itemsize, summed over tuple outputs).

    0 for SymInts, None and other non-tensor values. A view reports the size it spans,
    not the size of its base's storage.
    """
    return sum(nbytes(t) for t in tensors_of(meta_val(node)))


def allocated_bytes(node: fx.Node) -> int:
    """Bytes newly allocated when ``node`` runs.

    0 for placeholders/get_attr (resident before the step), aliases, getitems (the
    multi-output op they index allocated them) and view multi-output ops (split);
    otherwise the bytes of the fresh outputs.
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    val = meta_val(node)
    if isinstance(val, (list, tuple)):
        if is_view(node):
            return 0
        total = 0
        for i, t in enumerate(val):
            if isinstance(t, torch.Tensor):
                claim = _schema_alias_arg(node, i)
                if claim is None or not isinstance(claim[0], fx.Node):
                    total += nbytes(t)
        return total
    if aliased_input(node) is not None:
        return 0
    return output_bytes(node)


# Ops that read only the rows an index selects: reading the whole source would overcharge
# an embedding lookup by the size of the vocabulary.
_GATHER_OPS = frozenset(
    {"aten::embedding", "aten::index_select", "aten::gather", "aten::index", "aten::take"}
)


def bytes_moved(node: fx.Node) -> int:
    """Bytes read (distinct elements of tensor inputs) plus bytes written (outputs).

    Views, getitems and non-op nodes move nothing. Gather-like ops read at most as many
    source bytes as they write. An in-place op with no tensor return writes its mutated
    arguments.
    """
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0
    if not is_kernel(node):
        return 0
    written = output_bytes(node)
    schema = op_schema(node.target)
    reads = 0
    gather = schema is not None and schema.name in _GATHER_OPS
    for i, inp in enumerate(input_nodes(node)):
        for t in tensors_of(meta_val(inp)):
            b = distinct_bytes(t)
            reads += min(b, written) if gather and i == 0 else b
    if written == 0 and schema is not None and schema.is_mutable:
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += sum(
                    nbytes(t) for t in tensors_of(meta_val(arg_value(node, schema, arg.name)))
                )
    return reads + written


# --------------------------------------------------------------------------------------
# Flops
# --------------------------------------------------------------------------------------


def _mv_flops(a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a)


def _addmv_flops(c, a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a)


def _dot_flops(a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a)


def _addbmm_flops(c, a, b, *args, out_shape=None, **kw) -> int:
    return 2 * math.prod(a) * b[-1]


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    """Formulas torch's flop_registry lacks: CPU flash attention, mv/dot/addmv/addbmm."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    extra: dict[Any, Callable[..., int]] = {
        aten.mv: shape_wrapper(_mv_flops),
        aten.addmv: shape_wrapper(_addmv_flops),
        aten.dot: shape_wrapper(_dot_flops),
        aten.addbmm: shape_wrapper(_addbmm_flops),
    }
    # The CPU kernels take (q, k, v, ...) / (grad_out, q, k, v, ...) first, like the flash
    # ops whose formulas only read those leading shapes.
    for cpu_name, flash in (
        ("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            aten._scaled_dot_product_flash_attention_backward,
        ),
    ):
        packet = getattr(aten, cpu_name, None)
        if packet is not None and flash in flop_registry:
            extra[packet] = flop_registry[flash]
    return extra


@functools.cache
def flop_formula(target: Any) -> Callable[..., int] | None:
    from torch.utils.flop_counter import flop_registry

    key = target.overloadpacket if isinstance(target, OpOverload) else target
    try:
        f = flop_registry.get(key)
    except TypeError:  # unhashable target
        return None
    return f if f is not None else _extra_formulas().get(key)


def is_pointwise(node: fx.Node) -> bool:
    """An elementwise op (torch's ``pointwise`` tag): a fusing compiler runs it inside the
    kernel of what reads it."""
    target = node.target
    return isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags


def is_kernel(node: fx.Node) -> bool:
    """Whether ``node`` launches real work.

    Not a kernel: python callables (SymInt arithmetic), ``aten::sym_*`` metadata queries,
    and ops that neither touch a tensor nor mutate anything (``_assert_scalar``).
    """
    target = node.target
    if not isinstance(target, (OpOverload, HigherOrderOperator)):
        return False
    if tensors_of(meta_val(node)):
        return True
    schema = op_schema(target)
    if schema is not None:
        if schema.is_mutable:
            return True
        if schema.name.startswith("aten::sym_"):
            return False
    return any(tensors_of(meta_val(i)) for i in input_nodes(node))


def _matmul_flops(node: fx.Node) -> float | None:
    """torch's formula for ``node``; None when there is none or it cannot be applied."""
    formula = flop_formula(node.target)
    if formula is None:
        return None
    args, kwargs = tree_map(
        lambda a: meta_val(a) if isinstance(a, fx.Node) else a, (node.args, node.kwargs)
    )
    try:
        return float(hint(formula(*args, **kwargs, out_val=meta_val(node))))
    except Exception as e:  # a cost model must not abort planning: use the estimate
        log.debug("flop formula for %s failed (%s); using element count", node.name, e)
        return None


def flops(node: fx.Node) -> float:
    """Floating-point operations of ``node``.

    Matmul, conv and attention ops (forward and backward) use torch's flop_registry
    formulas on the fake shapes. Every other kernel is charged one flop per element of the
    larger of its output and its largest input: that is one per output element for
    pointwise ops and one per input element for reductions (tagged or not, e.g. the
    parameter-gradient sums of native_layer_norm_backward). Gather-like ops charge only
    their output. Views, getitems and placeholders: 0.
    """
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0.0
    if not is_kernel(node):
        return 0.0
    exact = _matmul_flops(node)
    if exact is not None:
        return exact
    out = sum(hint(t.numel()) for t in tensors_of(meta_val(node)))
    schema = op_schema(node.target)
    if schema is not None and schema.name in _GATHER_OPS:
        return float(out)
    largest_in = max(
        (hint(t.numel()) for i in input_nodes(node) for t in tensors_of(meta_val(i))), default=0
    )
    return float(max(out, largest_in))
