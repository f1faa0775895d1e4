"""Small readers over fx nodes and their fake metadata, shared by the cost modules.

A node's ``meta["val"]`` holds a FakeTensor, a tuple/list of them (possibly with None), a
SymInt, or None; sizes may be SymInts, read as numbers by ``passes.sizes.hint``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat.passes._torch_compat import tree_flatten
from remat.passes.sizes import hint


def tensors_of(val: Any) -> list[torch.Tensor]:
    """The tensors in a node value (a tensor, or a tuple/list possibly holding None)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def nbytes(t: torch.Tensor) -> int:
    return hint(t.numel()) * t.element_size()


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel really reads from ``t``: broadcast (stride-0) dims count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        size = hint(size)
        if size == 0:
            return 0
        if hint(stride) != 0:
            n *= size
    return n * t.element_size()


def meta_val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def same_storage(a: StorageWeakRef | None, b: StorageWeakRef | None) -> bool:
    return a is not None and b is not None and a.cdata == b.cdata


def arg_value(node: fx.Node, schema: torch.FunctionSchema, name: str) -> Any:
    """Value passed for schema argument ``name`` (positional, keyword or default)."""
    for i, arg in enumerate(schema.arguments):
        if arg.name != name:
            continue
        if not arg.kwarg_only and i < len(node.args):
            return node.args[i]
        if name in node.kwargs:
            return node.kwargs[name]
        return arg.default_value if arg.has_default_value() else None
    return None


def input_nodes(node: fx.Node) -> Iterator[fx.Node]:
    """Distinct fx.Node inputs, in argument order."""
    seen: set[fx.Node] = set()
    for a in tree_flatten((node.args, node.kwargs))[0]:
        if isinstance(a, fx.Node) and a not in seen:
            seen.add(a)
            yield a


def compute_dtypes(gm: fx.GraphModule) -> set[torch.dtype]:
    """The floating dtypes ``gm``'s inputs hold: what its matmuls compute in."""
    found = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            found.add(val.dtype)
    return found or {torch.float32}
