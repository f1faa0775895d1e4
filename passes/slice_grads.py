"""Add a slice's gradient into the gradient summed so far, not a zero tensor holding it.

The backward of a slice of ``x`` (``x[:, :, i]``, ``x[..., a:b]``) is a zero tensor of
``x``'s size holding the slice's gradient (``select_backward``, ``slice_backward``). Where
a loop reads many slices of one tensor (a scan over a sequence written in PyTorch, as
transformers' reference Mamba is), the joint graph sums those tensors one ``add`` at a
time, three of ``x``'s size live at each (the sum so far, the zero tensor, the new sum),
where eager autograd adds into its buffer in place and holds two. So
``add(summed, select_backward(g, ...))`` becomes
``select_scatter(summed, select(summed, ...) + g, ...)``: one new tensor of ``x``'s size
per add, as eager holds, and no zero tensor to fill and read.

Only where nothing else reads the zero tensor and the sum is of the same shape, dtype and
strides as its operand (no broadcast, no type promotion, the same layout for its readers).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

# a slice's backward -> the slice and its scatter, each taking the backward's arguments
# after ``input_sizes``: (dim, index) or (dim, start, end, step)
_SLICES = {
    aten.select_backward.default: (aten.select.int, aten.select_scatter.default),
    aten.slice_backward.default: (aten.slice.Tensor, aten.slice_scatter.default),
}


def scatter_slice_gradients(joint: fx.GraphModule) -> int:
    """Rewrite every such ``add`` of ``joint`` in place; returns how many."""
    graph = joint.graph
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        if len(node.args) != 2 or node.kwargs:  # ``alpha`` scales the gradient
            continue
        for summed, grad in (node.args, node.args[::-1]):
            if _scatterable(node, summed, grad) and _rewrite(graph, node, summed, grad):
                count += 1
                break
    if count:
        graph.lint()
        joint.recompile()
    return count


def _scatterable(node: fx.Node, summed, grad) -> bool:
    if not (isinstance(summed, fx.Node) and isinstance(grad, fx.Node)):
        return False
    if grad.target not in _SLICES or len(grad.users) != 1:
        return False
    vals = [n.meta.get("val") for n in (node, summed, grad)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    out, before, zeros = vals
    same = (out.shape == before.shape == zeros.shape) and (out.dtype == before.dtype == zeros.dtype)
    return same and out.stride() == before.stride()


def _rewrite(graph: fx.Graph, node: fx.Node, summed: fx.Node, grad: fx.Node) -> bool:
    """``node`` as the scatter of ``summed``'s slice plus ``grad``'s gradient; False, and
    the graph unchanged, where the scatter would be laid out otherwise than ``node``."""
    take, scatter = _SLICES[grad.target]
    g, _sizes, *where = grad.args
    vals = [_val(a) for a in where]
    part_val = take(summed.meta["val"], *vals)
    added_val = part_val + g.meta["val"]
    new_val = scatter(summed.meta["val"], added_val, *vals)
    if new_val.stride() != node.meta["val"].stride():
        return False
    meta = {k: v for k, v in node.meta.items() if k != "val"}
    with graph.inserting_before(node):
        part = graph.call_function(take, (summed, *where))
        added = graph.call_function(aten.add.Tensor, (part, g))
        new = graph.call_function(scatter, (summed, added, *where))
    for n, val in ((part, part_val), (added, added_val), (new, new_val)):
        n.meta.update(meta)
        n.meta["val"] = val
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    graph.erase_node(grad)  # the zero tensor: the add was its one reader
    return True


def _val(arg):
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg
