"""Make a tensor whose run-time layout differs from its traced one read as traced.

The joint graph is traced with fake tensors, whose strides come from each op's fake
kernel. Where a real kernel lays its output out otherwise (torch 2.13's fake batch norm
keeps a non-contiguous input's layout, the CPU kernel returns a contiguous output), the
difference travels on through the ops that follow (a ``relu`` keeps its input's layout):
a ``view`` traced after it may not be a view of the real tensor (the programs then run
it as a reshape, which copies: ``rewrite.reshape_views``), and a kernel may copy the
input itself (a convolution does), copies the memory model did not see, which would
break the budget. So where the traced layout is contiguous its readers read a
contiguous ``clone``: the layout the tracer and the kernels' measurements assumed, and
an allocation the cost model counts.

One pass in graph order follows the real layouts that differ from the fake ones: views
replayed on the meta device, kernels run once on synthetic inputs laid out as at run
time (``run_kernel``: the planner passes ``costs.output_strides``), but only kernels
whose fake output is not contiguous (the mismatch seen: a fake kernel keeping a layout
the real one does not) or that read a tensor laid out otherwise than traced; running
every kernel would cost seconds on deep models (docs/architecture.md, "Modules").
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import fx

from ._torch_compat import op_schema
from .extract import is_tangent, tensor_bytes
from .sizes import hint

aten = torch.ops.aten

# node.meta key: the strides a tensor has at run time where they differ from its traced
# ones and its readers read it as it is (a kernel measured on synthetic inputs lays it
# out so: its scratch depends on the layouts it meets)
RUN_STRIDES = "remat_run_strides"

# A kernel's real output strides (None for an output that is no tensor) where its inputs
# are laid out as their fake values or as the mapping says; None where it cannot be run.
KernelStrides = Callable[
    [fx.Node, Mapping[fx.Node, tuple[int, ...]]], "list[tuple[int, ...] | None] | None"
]


def restore_traced_layouts(joint: fx.GraphModule, run_kernel: KernelStrides) -> int:
    """Where a tensor's run-time layout differs from its traced, contiguous one, its
    readers read a contiguous ``clone`` of it instead: a ``view`` the real layout cannot
    serve, and every kernel (whose measured memory assumed the traced layout; a
    convolution copies a non-contiguous input itself). ``run_kernel`` tells a kernel's
    real layouts (it runs the kernel: the cost model's job, so passed in). Returns how
    many copies were made."""
    graph = joint.graph
    real: dict[fx.Node, tuple[int, ...]] = {}  # strides where the real layout differs
    outputs: dict[fx.Node, list] = {}  # a multi-output kernel run: its outputs' strides
    copies: dict[fx.Node, fx.Node] = {}  # a tensor -> its contiguous copy
    for node in list(graph.nodes):
        fake = node.meta.get("val")
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            produced = outputs.get(node.args[0])
            strides = produced[node.args[1]] if produced is not None else None
        elif _is_plain_view(node):
            if node.args[0] not in real:
                continue
            strides = _replayed(node, real[node.args[0]])
            if strides is None and node.target is aten.view.default:
                _read_copy(graph, node, node.args[0], copies)
                continue
        else:
            for source in node.all_input_nodes:
                traced = source.meta["val"]
                if source in real and traced.is_contiguous() and not _dense(traced, real[source]):
                    _read_copy(graph, node, source, copies)
            if not (any(a in real for a in node.all_input_nodes) or _not_contiguous(fake)):
                continue
            produced = run_kernel(node, real)
            if produced is None:
                continue
            if not isinstance(fake, torch.Tensor):
                outputs[node] = produced
                continue
            strides = produced[0]
        if strides is not None and isinstance(fake, torch.Tensor) and strides != _strides(fake):
            real[node] = strides
            node.meta[RUN_STRIDES] = strides  # what measuring a reader's kernel lays it out as
    if copies:
        joint.recompile()
    return len(copies)


def _read_copy(graph: fx.Graph, reader: fx.Node, source: fx.Node, copies: dict) -> None:
    """``reader`` reads a contiguous ``clone`` of ``source`` (one per source, made
    before its first such reader)."""
    if source not in copies:
        with graph.inserting_before(reader):
            copy = graph.call_function(
                aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
            )
        copy.meta = {k: v for k, v in source.meta.items() if k != "tensor_meta"}  # stale
        copy.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
        copies[source] = copy
    reader.replace_input_with(source, copies[source])


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


def _not_contiguous(fake) -> bool:
    """A fake output (or one of several) laid out otherwise than contiguously, a
    dimension of size 1 with a stride of its own included: torch calls a (4, 8, 1) tensor
    of strides (8, 1, 8) contiguous, but a convolution reads it as channels-last and runs
    another kernel, of other scratch, than on strides (8, 1, 1)."""
    values = fake if isinstance(fake, (tuple, list)) else (fake,)
    return any(
        isinstance(v, torch.Tensor) and _strides(v) != _contiguous_strides(v) for v in values
    )


def _dense(fake: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` lay ``fake``'s elements out contiguously as torch reads it (a
    dimension of size 1 may have any stride): the same bytes, so a view taken of one is
    a view of the other and no copy is needed; only kernels' choices differ."""
    shape = [hint(n) for n in fake.shape]
    pairs = zip(shape, strides, _contiguous_strides(fake), strict=True)
    return all(size == 1 or stride == wanted for size, stride, wanted in pairs)


def _contiguous_strides(fake: torch.Tensor) -> tuple[int, ...]:
    """The strides a contiguous tensor of ``fake``'s shape has, size-1 dimensions too."""
    out, expected = [], 1
    for size in reversed([hint(n) for n in fake.shape]):
        out.append(expected)
        expected *= max(size, 1)
    return tuple(reversed(out))


def copied_into_grad(
    joint: fx.GraphModule, num_fwd_outputs: int, leaves: Sequence[bool]
) -> int:
    """Bytes of the largest gradient autograd copies into its leaf's ``.grad`` rather than
    taking it, read at the binding being read (``sizes.reading_at``): one laid out otherwise
    than its leaf (AccumulateGrad's layout contract), e.g. a transposed input's. The copy
    is live beside the backward's outputs once the backward returns. ``leaves``: per input
    of the joint graph's forward, whether it is a leaf needing a gradient; the gradients
    are the outputs after the forward's, in input order."""
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if not is_tangent(n)]
    (outputs,) = joint.graph.find_nodes(op="output")[0].args
    grads = outputs[num_fwd_outputs:]
    if not len(grads) == len(primals) == len(leaves):  # inputs AOTAutograd added: unknown
        return 0
    copied = [
        tensor_bytes(grad.meta.get("val"))
        for grad, primal, leaf in zip(grads, primals, leaves, strict=True)
        if leaf
        and isinstance(grad, fx.Node)
        and isinstance(grad.meta.get("val"), torch.Tensor)
        and not _obeys_layout(grad.meta["val"], primal.meta.get("val"))
    ]
    return max(copied, default=0)


def _obeys_layout(grad: torch.Tensor, leaf: object) -> bool:
    """AccumulateGrad's layout contract (torch/csrc/autograd/utils/grad_layout_contract.h):
    strided as its dense leaf (a dimension of size 1 has any stride but 0), or contiguous
    where the leaf is not dense."""
    if not isinstance(leaf, torch.Tensor):
        return True
    sizes, strides = [hint(n) for n in grad.shape], _strides(grad)
    if not _non_overlapping_and_dense(leaf):
        return _dense(grad, strides)
    pairs = zip(sizes, strides, _strides(leaf), strict=True)
    return all(stride != 0 if size == 1 else stride == theirs for size, stride, theirs in pairs)


def _non_overlapping_and_dense(fake: torch.Tensor) -> bool:
    """Contiguous in some order of its dimensions (torch's ``is_non_overlapping_and_dense``,
    read at the binding being read rather than guarded)."""
    sizes = [hint(n) for n in fake.shape]
    pairs = sorted((s, n) for s, n in zip(_strides(fake), sizes, strict=True) if n != 1)
    expected = 1
    for stride, size in pairs:
        if stride != expected:
            return False
        expected *= size
    return True


def _replayed(view: fx.Node, base_strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """``view``'s strides over a base laid out with ``base_strides`` (on the meta device),
    or None where the view cannot be taken of it."""
    base = view.args[0].meta["val"]
    shape = [hint(s) for s in base.shape]
    args = [_number(a) for a in view.args[1:]]
    try:
        meta = torch.empty_strided(shape, base_strides, dtype=base.dtype, device="meta")
        out = view.target(meta, *args, **view.kwargs)
    except (RuntimeError, ValueError):  # (on the meta device a failed view is a ValueError)
        return None
    return tuple(out.stride())


def _strides(fake: torch.Tensor) -> tuple[int, ...]:
    """A fake tensor's strides as numbers (``sizes.hint``)."""
    return tuple(hint(s) for s in fake.stride())


def _number(arg):
    """A view's argument with its sizes as numbers: a SymInt, or a node computing one,
    read by ``sizes.hint``; lists element by element."""
    if isinstance(arg, (list, tuple)):
        return type(arg)(_number(a) for a in arg)
    if isinstance(arg, fx.Node):
        arg = arg.meta.get("val")
    return hint(arg) if isinstance(arg, torch.SymInt) else arg
