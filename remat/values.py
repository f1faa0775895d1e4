"""The values a plan saves and recomputes, named as the user's model knows them: the module
that computed each (``transformer.h.0.mlp.act``) and its op (``gelu``), not the fx node.

The trace records where each op came from in ``node.meta``: forward nodes carry
``nn_module_stack`` (innermost module last), backward nodes (torch 2.13) the forward's as
``fwd_nn_module_stack``; a node with neither (one remat inserts, such as a dropout's
generator state) takes the module of the forward node with its ``seq_nr``, else of its
first reader that has one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from torch import fx

from remat.solvers import Plan, Problem, format_bytes
from remat.solvers.step import Composed

__all__ = [
    "TOP_LEVEL",
    "Value",
    "graph_values",
    "module_paths",
    "recomputed",
    "step_values",
]

TOP_LEVEL = "(top level)"  # how a value computed outside every submodule is shown

SAVED, RECOMPUTED = "saved", "recomputed"

# dynamo names the module it traced ``L['self']`` (a method's self) or ``L['net']`` /
# ``G['net']`` (a function's local or global); submodules follow as attributes or items
_SOURCE = re.compile(r"^[LG]\['([^']*)'\]")
_ITEM = re.compile(r"\._modules\['([^']*)'\]|\['([^']*)'\]|\[(\d+)\]")


@dataclass(frozen=True)
class Value:
    """One value a plan keeps for the backward (``saved``) or runs again in it
    (``recomputed``): its graph, fx node name, module path ("" outside every submodule),
    op and bytes (0 for a view, which keeps its base's storage)."""

    graph: str
    name: str
    module: str
    op: str
    bytes: int
    kind: str

    def __str__(self) -> str:
        return f"{self.module or TOP_LEVEL}: {self.op} ({self.kind}, {format_bytes(self.bytes)})"

    def to_dict(self) -> dict:
        return asdict(self)


def recomputed(plan: Plan) -> frozenset[int]:
    """The values ``plan``'s backward runs again: recomputed values the forward ran too (a
    forward value only the backward reads is computed there once, which costs nothing
    more, though ``plan.recomputed`` holds it)."""
    return plan.recomputed & frozenset(plan.schedule.forward)


def module_paths(nodes: Iterable[fx.Node]) -> dict[fx.Node, str]:
    """Each node's module path from the trace's metadata (module docstring); "" where the
    trace recorded none."""
    nodes = list(nodes)
    own: dict[fx.Node, str] = {}
    by_seq: dict[int, str] = {}
    for n in nodes:
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
        if stack:
            own[n] = _path(stack)
            if "nn_module_stack" in n.meta and n.meta.get("seq_nr") is not None:
                by_seq.setdefault(n.meta["seq_nr"], own[n])
    paths = {}
    for n in nodes:
        if n in own:
            paths[n] = own[n]
        elif n.meta.get("seq_nr") in by_seq:
            paths[n] = by_seq[n.meta["seq_nr"]]
        else:
            paths[n] = next((own[u] for u in n.users if u in own), "")
    return paths


def _op_label(problem: Problem, i: int, fx_node: fx.Node) -> str:
    """The op of node ``i`` without its namespace and overload (``gelu``, ``addmm``), or
    ``op[k]`` for output ``k`` of a multi-output op (``native_layer_norm[0]``)."""
    node = problem.nodes[i]
    if node.output_of is not None and len(fx_node.args) > 1:
        return f"{_short(problem.nodes[node.output_of].op)}[{fx_node.args[1]}]"
    return _short(node.op)


def graph_values(
    name: str, problem: Problem, fx_nodes: Sequence[fx.Node], plan: Plan
) -> list[Value]:
    """The values ``plan`` of one graph saves and recomputes, in execution order."""
    return _values(name, problem, fx_nodes, plan, range(len(problem.nodes)))


def step_values(
    graphs: Sequence[str], composed: Composed, plan: Plan, fx_nodes: dict[str, Sequence]
) -> list[Value]:
    """The values the joint ``plan`` of a step saves and recomputes, run by run (``graphs``
    names each run's graph, ``fx_nodes`` each graph's nodes), in execution order; a node
    remat adds to the step (code between the graphs) is not a value of the model."""
    values = []
    for name, where in zip(graphs, composed.index, strict=True):
        own = where[: len(fx_nodes[name])]  # past them: a node the runtime adds to a run
        run_nodes: list = [None] * len(composed.problem.nodes)
        for i, j in enumerate(own):
            run_nodes[j] = fx_nodes[name][i]
        values += _values(name, composed.problem, run_nodes, plan, sorted(own))
    return values


def _values(name, problem, fx_nodes, plan, indices) -> list[Value]:
    """``Value``s of the ``indices`` (into ``problem``) that ``plan`` saves or recomputes;
    a value only the backward reads and runs once there is neither."""
    again = recomputed(plan)
    graph = next((n.graph for n in fx_nodes if n is not None), None)
    paths = module_paths(graph.nodes) if graph is not None else {}
    out = []
    for i in indices:
        if i in plan.saved:
            kind = SAVED
        elif i in again:
            kind = RECOMPUTED
        else:
            continue
        node, fx_node = problem.nodes[i], fx_nodes[i]
        out.append(
            Value(name, node.name, paths[fx_node], _op_label(problem, i, fx_node), node.bytes, kind)
        )
    return out


def _path(stack: dict) -> str:
    """The innermost module's path from an ``nn_module_stack`` (``{key: (path, type)}``)."""
    path = str(list(stack.values())[-1][0])
    source = _SOURCE.match(path)
    if source:
        rest = path[source.end() :]
        path = rest if source.group(1) == "self" else source.group(1) + rest
    path = _ITEM.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    return path.lstrip(".")


def _short(op: str) -> str:
    """``gelu.default`` (an op overload's name) -> ``gelu``."""
    return op.partition(".")[0]
