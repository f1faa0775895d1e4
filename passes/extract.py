"""Joint fx graph -> ``solvers.Problem``: the only place that reads torch graphs for planning.

Node facts (bytes, aliasing, time, whether recomputing is allowed) come from a
cost model passed in, so this pass stays a pure graph walk.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from remat.solvers import Node, Problem

from ._torch_compat import backward_holds_tangents, mutated_inputs
from .sizes import Binding, hint, reading_at

# the tags torch's checkpointing leaves on the nodes it recomputes
RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


class NodeFacts(Protocol):
    """What the planner needs to know about one fx node (see ``remat.costs.CostModel``)."""

    def allocated_bytes(self, node: fx.Node) -> int: ...
    def aliased_input(self, node: fx.Node) -> fx.Node | None: ...
    def seconds(self, node: fx.Node) -> float: ...
    def recomputable(self, node: fx.Node) -> bool: ...
    def workspace(self, node: fx.Node) -> int: ...
    def save_seconds(self, node: fx.Node, nbytes: int) -> float: ...


@dataclass(frozen=True)
class Extracted:
    """A Problem and the fx nodes its indices stand for."""

    problem: Problem
    fx_nodes: tuple[fx.Node, ...]

    def grown(self, planned: Binding, binding: Binding) -> Extracted:
        """This problem, read at ``planned``, read at the larger sizes ``binding`` without
        measuring a kernel again: each node's bytes and save cost grow as its value's
        elements do (exact for a tensor's own bytes), its time and scratch as the largest
        of its value's and its inputs' (the measured part of a kernel is taken to grow
        with its tensors: docs/guide.md, "Sizes that vary")."""
        growth = _growth(self.fx_nodes, planned, binding)
        nodes = []
        for node, n in zip(self.problem.nodes, self.fx_nodes, strict=True):
            own = growth[n]
            most = max([own, *(growth[i] for i in n.all_input_nodes if i in growth)])
            nodes.append(
                dataclasses.replace(
                    node,
                    bytes=math.ceil(node.bytes * own),
                    workspace=math.ceil(node.workspace * most),
                    cost=node.cost * most,
                    save_cost=node.save_cost * own,
                )
            )
        graph_nodes = self.fx_nodes[0].graph.nodes if self.fx_nodes else ()
        with reading_at(binding):
            resident = _resident_bytes(graph_nodes)
        problem = dataclasses.replace(self.problem, nodes=tuple(nodes), resident_bytes=resident)
        return Extracted(problem, self.fx_nodes)


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def is_root_tangent(node: fx.Node) -> bool:
    """A used tangent of one element: the gradient of a scalar loss, the backward's root
    (autograd holds it until the backward returns)."""
    val = node.meta.get("val")
    return (
        is_tangent(node)
        and bool(node.users)
        and isinstance(val, torch.Tensor)
        and hint(val.numel()) == 1
    )


def user_recomputes(extracted: Extracted) -> frozenset[int]:
    """The values the user's own checkpointing recomputes (``torch.utils.checkpoint``, a
    selective-checkpointing policy): traced, their nodes carry a recompute tag. A region's
    outputs, which the forward pass reads outside it (a later region, an untagged op), are
    kept as eager autograd keeps them (torch's partitioner saves them too)."""
    return frozenset(
        i for i, n in enumerate(extracted.fx_nodes) if _recomputed(n) and not _region_output(n)
    )


def _recomputed(node: fx.Node) -> bool:
    return node.meta.get("recompute") in RECOMPUTE


def _region_output(node: fx.Node) -> bool:
    """Whether the forward pass reads ``node`` outside its checkpointed region. A reader
    the backward pass traced does not count, though it may read no tangent (gelu's
    backward squares its input): eager runs it after the region is recomputed."""
    region = node.meta.get("ac_graph_id")
    return any(
        not traced_in_backward(u) and (not _recomputed(u) or u.meta.get("ac_graph_id") != region)
        for u in node.users
    )


def traced_in_backward(node: fx.Node) -> bool:
    """Whether AOT autograd traced ``node`` in the backward pass (its ``partitioner_tag``,
    torch 2.11 to 2.15), where a node's phase (``"fwd"``: it reads no tangent) cannot
    tell."""
    return node.meta.get("partitioner_tag") in ("is_backward", "must_be_in_backward")


def is_resident(node: fx.Node) -> bool:
    """Parameters, buffers, user inputs, RNG seeds and constants: allocated before the step."""
    return node.op == "get_attr" or (node.op == "placeholder" and not is_tangent(node))


def is_multi_output(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def is_symbolic(node: fx.Node) -> bool:
    """A SymInt/SymFloat/SymBool value: tiny, and torch saves it outside the tensor list."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def must_be_in_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "must_be_in_backward"


def problem_nodes(joint: fx.GraphModule) -> tuple[fx.Node, ...]:
    """The fx nodes a problem of ``joint`` has, in its order: all but the resident ones
    and the output."""
    return tuple(n for n in joint.graph.nodes if n.op != "output" and not is_resident(n))


def extract(
    joint: fx.GraphModule, num_fwd_outputs: int, facts: NodeFacts, name: str = ""
) -> Extracted:
    """Build the Problem of ``joint`` (the graph AOTAutograd hands a partitioner)."""
    graph_nodes = list(joint.graph.nodes)
    output = graph_nodes[-1]
    flat_outputs = list(output.args[0])
    fwd_outs, bwd_outs = flat_outputs[:num_fwd_outputs], flat_outputs[num_fwd_outputs:]

    backward: set[fx.Node] = set()
    for n in graph_nodes:
        if is_tangent(n) or must_be_in_backward(n) or any(i in backward for i in n.all_input_nodes):
            backward.add(n)

    # Recomputing a reader of an input the runtime overwrites after the forward
    # would read the new value: such readers run once, in the forward.
    mutated = mutated_inputs(joint)
    index: dict[fx.Node, int] = {}
    kept: list[fx.Node] = []
    nodes: list[Node] = []
    for n in problem_nodes(joint):
        inputs = tuple(sorted({index[i] for i in n.all_input_nodes if i in index}))
        base = facts.aliased_input(n)
        producer = n.args[0] if n.target is operator.getitem else None
        if base is not None and producer is not None and base not in n.all_input_nodes:
            base = producer  # a getitem of split/unbind: a view through its op
        alias_of = index.get(base) if base is not None else None
        output_of = (
            index.get(producer) if producer is not None and is_multi_output(producer) else None
        )
        recomputable = (
            facts.recomputable(n)
            and not is_symbolic(n)
            and not any(i in mutated for i in n.all_input_nodes)
        )
        if output_of is not None:
            recomputable = recomputable and nodes[output_of].recomputable
        nbytes = 0 if base is not None else _own_bytes(n, facts)
        # a storage a plan may keep for the backward (a multi-output op is never saved:
        # its getitems own its parts)
        owns = None if base is not None or is_multi_output(n) else nbytes
        index[n] = len(nodes)
        kept.append(n)
        nodes.append(
            Node(
                name=n.name,
                phase="bwd" if n in backward else "fwd",
                bytes=nbytes,
                cost=facts.seconds(n),
                inputs=inputs,
                recomputable=recomputable,
                alias_of=alias_of,
                output_of=output_of,
                op=_op_name(n),
                workspace=facts.workspace(n),
                save_cost=0.0 if owns is None else facts.save_seconds(n, owns),
            )
        )

    outputs = tuple(index[o] for o in fwd_outs if isinstance(o, fx.Node) and o in index)
    grads = tuple(index[g] for g in bwd_outs if isinstance(g, fx.Node) and g in index)
    # Autograd allocates the tangents before the backward. The root's (the ones of a scalar
    # loss) it holds until the backward returns: to the simulator a value kept to the end,
    # like a gradient. Larger ones (zeros for an output that gets no gradient, e.g. logits
    # returned beside the loss) reach the program only, which frees them after their last
    # use: measured, holding one to the end over-predicted the peak by its size. Where the
    # backward holds every tangent until it returns (``backward_holds_tangents``), all are
    # kept to the end.
    held_tangent = is_tangent if backward_holds_tangents() else is_root_tangent
    held = (index[n] for n in kept if held_tangent(n))
    grads += tuple(t for t in held if t not in grads)
    resident = _resident_bytes(graph_nodes)
    problem = Problem(
        tuple(nodes), outputs=outputs, grads=grads, resident_bytes=resident, name=name
    )
    return Extracted(problem, tuple(kept))


def _own_bytes(node: fx.Node, facts: NodeFacts) -> int:
    """Bytes a node's value holds (a tangent's too: autograd allocates it, e.g. the ones
    of a scalar loss); a multi-output op's outputs are counted on their
    getitems (the simulator allocates them when the op runs), except outputs no
    getitem reads (still written by the kernel, then dropped)."""
    if is_tangent(node):
        return _strided_bytes(node.meta.get("val"))
    if node.target is operator.getitem:
        return tensor_bytes(node.meta.get("val"))
    if not is_multi_output(node):
        return facts.allocated_bytes(node)
    vals = node.meta["val"]
    read = {u.args[1] for u in node.users if u.target is operator.getitem}
    return sum(tensor_bytes(v) for k, v in enumerate(vals) if k not in read)


def _strided_bytes(val: object) -> int:
    """Bytes of the storage a tangent lives in: AOTAutograd gives each tangent its
    forward output's strides (``empty_strided`` and a copy when the incoming gradient's
    differ), so a tangent of a split's slice spans its base's row stride (124 bytes, not
    112, for a 4x7 slice of a 4x8 matrix)."""
    if not isinstance(val, torch.Tensor) or hint(val.numel()) == 0:
        return 0
    extents = zip(val.shape, val.stride(), strict=True)
    span = 1 + sum((hint(size) - 1) * abs(hint(stride)) for size, stride in extents)
    return max(span, hint(val.numel())) * val.element_size()


def _resident_bytes(graph_nodes) -> int:
    return sum(tensor_bytes(n.meta.get("val")) for n in graph_nodes if is_resident(n))


def _growth(fx_nodes, planned: Binding, binding: Binding) -> dict[fx.Node, float]:
    """Per node of the graph (the problem's and the resident ones), how many times more
    elements its value has at ``binding`` than at ``planned``: 1 for a value of static
    sizes, or none."""
    graph_nodes = fx_nodes[0].graph.nodes if fx_nodes else ()
    read: dict = {}

    def elements(count: torch.SymInt, at: Binding) -> int:
        key = (count.node.expr, id(at))
        if key not in read:
            with reading_at(at):
                read[key] = hint(count)
        return read[key]

    growth = {}
    for n in graph_nodes:
        val = n.meta.get("val")
        counts = [t.numel() for t in _tensors(val)]
        symbolic = [c for c in counts if isinstance(c, torch.SymInt)]
        before = sum(elements(c, planned) for c in symbolic)
        after = sum(elements(c, binding) for c in symbolic)
        fixed = sum(c for c in counts if not isinstance(c, torch.SymInt))
        growth[n] = (after + fixed) / (before + fixed) if before + fixed else 1.0
    return growth


def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def tensor_bytes(val: object) -> int:
    """A value's bytes at the binding being read (``sizes.reading_at``); 0 for no tensor."""
    if isinstance(val, torch.Tensor):
        return hint(val.numel()) * val.element_size()
    return 0


def _op_name(node: fx.Node) -> str:
    target = node.target
    if node.op == "placeholder":
        return "placeholder"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))
