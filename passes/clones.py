"""Drop copies that change nothing: ``clone`` of a tensor the graph never mutates.

Decompositions leave such copies in the joint graph. ``dropout`` with ``p=0`` (the
default of nanoGPT, of many HF configs, and of any model in ``eval``-free training
with dropout switched off) decomposes to ``input.clone()``, while eager returns its
input: a compiled step then holds two copies of every attention matrix, and the
planner would have to pay to save or recompute a tensor eager never had.

A clone is dropped (its users read its input instead) only when nothing could tell:

- its output has its input's shape, strides, offset, dtype and device, so every
  user sees the same tensor metadata (``clone(memory_format=contiguous)`` of a
  transpose is a real relayout and stays);
- its input's storage belongs to an intermediate of the graph: not a placeholder
  (parameters, buffers and inputs may be written by a ``copy_`` later in the
  graph, or by the caller between forward and backward);
- neither the clone nor any tensor sharing its input's storage is a graph output
  (the caller may write to an output in place);
- no user writes to it (functional graphs have no such users; checked anyway).

Views of a dropped clone had fake tensors sharing the clone's storage; they are
re-derived from the input, so the cost model sees them alias the right storage.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx

from ._torch_compat import storage_of

aten = torch.ops.aten


def drop_identity_clones(joint: fx.GraphModule) -> int:
    """Remove every droppable ``aten.clone`` of ``joint`` in place; returns how many."""
    graph = joint.graph
    observable = _observable_storages(graph)
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.clone.default)):
        source = node.args[0]
        if not _droppable(node, source, observable):
            continue
        views = _sharing_storage(node)
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        _rederive(views)
        count += 1
    if count:
        graph.lint()
        joint.recompile()
    return count


def _droppable(node: fx.Node, source, observable: set) -> bool:
    out, src = node.meta.get("val"), getattr(source, "meta", {}).get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)):
        return False
    same_layout = (
        out.shape == src.shape
        and out.stride() == src.stride()
        and out.storage_offset() == src.storage_offset()
        and out.dtype == src.dtype
        and out.device == src.device
    )
    if not same_layout:
        return False
    storage = storage_of(src)
    if storage is None or storage in observable or storage_of(out) in observable:
        return False
    return not any(_writes(user, node) for user in node.users)


def _observable_storages(graph: fx.Graph) -> set:
    """Storages someone outside the graph holds: placeholders' (parameters, buffers,
    inputs) and outputs' (forward outputs and gradients alike)."""
    held: list[fx.Node] = list(graph.find_nodes(op="placeholder"))
    fx.node.map_arg(graph.output_node().args, held.append)
    return {s for n in held for t in _tensors(_val(n)) if (s := storage_of(t)) is not None}


def _sharing_storage(node: fx.Node) -> list[fx.Node]:
    """Nodes after ``node`` whose fake value lives in ``node``'s storage (its views), in
    graph order."""
    storage = storage_of(_val(node))
    found, seen, frontier = [], {node}, list(node.users)
    while frontier:
        user = frontier.pop()
        if user in seen:
            continue
        seen.add(user)
        if any(storage_of(t) == storage for t in _tensors(_val(user))):
            found.append(user)
            frontier.extend(user.users)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _rederive(views: list[fx.Node]) -> None:
    """Run each view again on its (new) inputs' fake values: fresh fake tensors that
    share the right storage."""
    for view in views:
        if view.target is operator.getitem:
            parent, index = view.args
            view.meta["val"] = parent.meta["val"][index]
            continue
        args, kwargs = fx.node.map_arg((view.args, view.kwargs), _val)
        modes = (t.fake_mode for t in _tensors((args, kwargs)) if hasattr(t, "fake_mode"))
        with next(modes, None) or contextlib.nullcontext():
            view.meta["val"] = view.target(*args, **kwargs)


def _writes(user: fx.Node, node: fx.Node) -> bool:
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return user.op == "call_function" and user.target is not operator.getitem
    for i, arg in enumerate(schema.arguments):
        value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
        if value is node and arg.alias_info is not None and arg.alias_info.is_write:
            return True
    return False


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
