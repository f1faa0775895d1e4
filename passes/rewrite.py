"""Joint graph + Plan -> forward and backward GraphModules that run the plan's schedule.

torch's extractor cuts the joint graph at the saved values (everything the
backward needs and is not handed lands in the backward, i.e. is recomputed);
this pass then puts both programs in exactly ``solvers.schedule``'s order and
checks that the two agree node for node, so the simulator's timeline is the
program's.
"""

from __future__ import annotations

import torch
from torch import fx

from remat.solvers import Plan

from ._torch_compat import extract_fwd_bwd_modules
from .extract import Extracted, is_resident, is_symbolic
from .rng import restore_in_backward

aten = torch.ops.aten


class ScheduleMismatch(AssertionError):
    """The extracted graphs do not run the nodes the schedule says: a remat bug."""


def rewrite(
    joint: fx.GraphModule,
    extracted: Extracted,
    plan: Plan,
    num_fwd_outputs: int,
    *,
    eager: bool = True,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward programs of ``plan``; ``eager``: they run op by op (not
    through a compiler that lays tensors out itself), so their views are made reshapes
    (``reshape_views``)."""
    nodes = extracted.fx_nodes
    sched = plan.schedule
    saved = [nodes[i] for i in sorted(sched.saved)]
    backward_nodes = [nodes[i] for i in sched.backward]
    # Parameters and inputs the backward reads are handed over too; they are resident.
    resident_reads = sorted(
        {
            i
            for n in backward_nodes
            for i in n.all_input_nodes
            if is_resident(i) and i.op == "placeholder"
        },
        key=lambda n: n.name,
    )
    # sizes (SymInts) go apart from the tensors, where AOTAutograd's runtime keeps them
    handed = [*saved, *resident_reads]
    saved_values = [n for n in handed if not is_symbolic(n)]
    saved_syms = [n for n in handed if is_symbolic(n)]
    fw, bw = extract_fwd_bwd_modules(joint, saved_values, saved_syms, num_fwd_outputs)
    restore_in_backward(bw)
    _drop_unscheduled_dead_code(bw, {n.name for n in backward_nodes})
    _reorder(fw, [nodes[i].name for i in sched.forward], "forward")
    _reorder(bw, [n.name for n in backward_nodes], "backward")
    if eager:
        reshape_views(fw)
        reshape_views(bw)
    return fw, bw


def reshape_views(gm: fx.GraphModule) -> None:
    """Make each ``aten.view`` an ``aten.reshape``: the same view wherever the strides
    allow one, and a copy, as eager's own reshape makes, where the tensor met at run time
    is laid out otherwise than the tracer's fake one said and ``layouts`` could not
    restore it (a traced layout that is not contiguous): a step that runs, where a view
    would fail (docs/architecture.md, "Modules")."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default
    gm.recompile()


def _drop_unscheduled_dead_code(gm: fx.GraphModule, scheduled: set[str]) -> None:
    """Erase unused nodes the schedule does not run. torch's extractor ends with a dead-code
    pass that keeps ops it counts impure (random ones, and attention with a dropout
    argument when called outside a compile): a copy of the forward's attention landed in
    the backward, read by nothing."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node.name not in scheduled:
            graph.erase_node(node)


# Nodes that compute nothing at run time: inputs, and tensor constants the graph holds
# (``get_attr``, e.g. a Hugging Face T5's ``torch.tensor`` literals), resident like them.
_INPUTS = ("placeholder", "get_attr")


def _reorder(gm: fx.GraphModule, order: list[str], program: str) -> None:
    """Move ``gm``'s computing nodes into ``order``, after its inputs and constants; fail
    loudly if the sets differ. A name ``order`` repeats runs again as a copy of the node,
    and every node placed reads the latest copy of each input (multiple recomputation)."""
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes if n.op not in (*_INPUTS, "output")}
    inputs = [n for op in _INPUTS for n in graph.nodes if n.op == op]
    names = {n.name for n in inputs}
    wanted = [name for name in order if name not in names]
    missing = [name for name in dict.fromkeys(wanted) if name not in by_name]
    extra = sorted(set(by_name) - set(wanted))
    if missing or extra:
        raise ScheduleMismatch(
            f"{program} program differs from the schedule: missing {missing[:10]}, "
            f"unexpected {extra[:10]}"
        )
    cursor = None
    for node in inputs:  # placeholders first (fx wants them so), then the constants
        if cursor is not None:
            cursor.append(node)
        cursor = node
    latest: dict[fx.Node, fx.Node] = {}  # node -> its latest run (itself or a copy)
    for name in wanted:
        original = by_name[name]
        if original in latest:
            node = graph.node_copy(original, lambda a: latest.get(a, a))
        else:
            node = original
            if latest:
                node.args = fx.map_arg(node.args, lambda a: latest.get(a, a))
                node.kwargs = fx.map_arg(node.kwargs, lambda a: latest.get(a, a))
        latest[original] = node
        if cursor is None:
            graph.output_node().prepend(node)  # no inputs: keep order before the output
        else:
            cursor.append(node)
        cursor = node
    output = graph.output_node()
    output.args = fx.map_arg(output.args, lambda a: latest.get(a, a))
    graph.lint()
    gm.recompile()
