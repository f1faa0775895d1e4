"""Make explicit the copies a traced ``view`` turns into at run time.

The joint graph is traced with fake tensors, whose strides come from each op's fake
kernel. Where a real kernel lays its output out otherwise (torch 2.13's fake batch norm
keeps a non-contiguous input's layout, the CPU kernel returns a contiguous output), a
``view`` traced after it may not be a view of the real tensor: the programs then run it
as a reshape, which copies (``rewrite.reshape_views``), and a copy the memory model did
not see would break the budget. So where that happens the view is rewritten as the
tracer would have written it had it known the real layout: a contiguous ``clone`` and
an ``_unsafe_view`` of it, an allocation the cost model counts.

Only kernels whose fake output is not contiguous are run (once, on synthetic inputs):
the mismatch seen is a fake kernel keeping a layout the real one does not, and running
every kernel would cost seconds on deep models (docs/architecture.md, "Modules").
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ._torch_compat import op_schema, real_tensors, tree_map

aten = torch.ops.aten


def copy_unviewable_views(joint: fx.GraphModule) -> int:
    """Rewrite each ``aten.view`` that the real layout of its base cannot serve as a view
    into ``_unsafe_view(clone(x))``. Returns how many were rewritten."""
    graph, real_strides, rewritten = joint.graph, {}, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.view.default:
            continue
        chain, base = _views_down_to_base(node.args[0])
        fake = base.meta.get("val")
        if not _runs_as_kernel(base) or not isinstance(fake, torch.Tensor):
            continue
        if fake.is_contiguous():
            continue
        if base not in real_strides:
            real_strides[base] = _real_output_strides(base)
        strides = real_strides[base]
        if strides is None or strides == fake.stride():
            continue
        if _viewable(fake, strides, chain, node.args[1]):
            continue
        with graph.inserting_before(node):
            source = node.args[0]
            copy = graph.call_function(
                aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
            )
            copy.meta = {k: v for k, v in source.meta.items() if k != "tensor_meta"}  # stale
            copy.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
        node.target = aten._unsafe_view.default
        node.args = (copy, *node.args[1:])
        rewritten += 1
    if rewritten:
        joint.recompile()
    return rewritten


def _views_down_to_base(node: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """The view ops that make ``node`` from the tensor they view, in the order they apply,
    and that tensor."""
    chain = []
    while node.op == "call_function" and _is_plain_view(node):
        chain.append(node)
        node = node.args[0]
    return list(reversed(chain)), node


def _is_plain_view(node: fx.Node) -> bool:
    """A view op whose first argument is its base and whose result depends only on its
    base's layout and its own arguments (transpose, permute, view, expand, slice, ...)."""
    schema = op_schema(node.target)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    alias = schema.returns[0].alias_info
    first = schema.arguments[0].alias_info
    return (
        alias is not None
        and not alias.is_write
        and first is not None
        and alias.before_set == first.before_set
        and isinstance(node.args[0], fx.Node)
    )


def _runs_as_kernel(node: fx.Node) -> bool:
    """An op's output, or one output of a multi-output op."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node.op == "call_function" and op_schema(node.target) is not None


def _real_output_strides(node: fx.Node) -> tuple[int, ...] | None:
    """The strides the real kernel gives ``node`` (an op's output, or a getitem of a
    multi-output op's) on zero-filled inputs laid out as the fake ones; None where it
    cannot run on them."""
    index = None
    if node.target is operator.getitem:
        node, index = node.args
    devices = {
        v.device for a in node.all_input_nodes if isinstance(v := a.meta.get("val"), torch.Tensor)
    }
    cuda = [d for d in devices if d.type == "cuda"]  # a random op keeps the step's generator

    def make(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return torch.empty_strided(
                    v.shape, v.stride(), dtype=v.dtype, device=v.device
                ).zero_()
            return v
        return a

    try:
        with real_tensors(), torch.no_grad(), torch.random.fork_rng(devices=cuda):
            args, kwargs = tree_map(make, (node.args, node.kwargs))
            out = node.target(*args, **kwargs)
    except Exception:  # an op synthetic inputs cannot drive: left as traced
        return None
    if index is not None:
        out = out[index]
    return tuple(out.stride()) if isinstance(out, torch.Tensor) else None


def _viewable(fake: torch.Tensor, strides: tuple[int, ...], chain: list, shape) -> bool:
    """Whether ``view(shape)`` after ``chain`` works on a tensor laid out with ``strides``."""
    t = torch.empty_strided(fake.shape, strides, dtype=fake.dtype, device="meta")
    try:
        for view in chain:
            t = view.target(t, *view.args[1:], **view.kwargs)
        t.view(shape)
    except (RuntimeError, ValueError):  # (on the meta device a failed view is a ValueError)
        return False
    return True
