"""A compiled graph as run time keeps it: the programs its runs may take, one per plan."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from remat.passes._torch_compat import boxed
from remat.passes.extract import Extracted, is_tangent
from remat.passes.rewrite import rewrite
from remat.planner import CompiledGraph, GraphPlan
from remat.solvers import Plan, Problem


@dataclass
class Program:
    """One plan of a graph as runnable programs, with what its backward is fed and returns."""

    plan: Plan
    forward: Callable
    backward: Callable
    tangents: tuple[tuple[int, int], ...]  # (backward argument, problem node) per tangent
    grads: tuple[int | None, ...]  # problem node of each returned gradient


@dataclass
class Graph:
    """A compiled graph and the programs its runs may take (``programs[0]``: the plan made
    at compile time). Made from what the planner handed over (``from_compiled``)."""

    record: GraphPlan
    joint: fx.GraphModule
    num_fwd_outputs: int
    programs: list[Program] = field(default_factory=list)

    @classmethod
    def from_compiled(cls, compiled: CompiledGraph) -> Graph:
        record = compiled.record
        first = make_program(record.plan, compiled.forward, compiled.backward, record.extracted)
        return cls(record, compiled.joint, compiled.num_fwd_outputs, [first])

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def problem(self) -> Problem:
        return self.record.extracted.problem

    @functools.cached_property
    def output_nodes(self) -> tuple[int | None, ...]:
        """Per forward output (what the forward program returns first), its problem node."""
        where = {n.name: i for i, n in enumerate(self.record.extracted.fx_nodes)}
        outs = self.joint.graph.output_node().args[0][: self.num_fwd_outputs]
        return tuple(where.get(o.name) if isinstance(o, fx.Node) else None for o in outs)

    def program_for(self, plan: Plan) -> int:
        """The index of the program running ``plan``'s schedule, built if new."""
        for k, p in enumerate(self.programs):
            if p.plan.saved == plan.saved and p.plan.schedule == plan.schedule:
                return k
        fw, bw = rewrite(self.joint, self.record.extracted, plan, self.num_fwd_outputs)
        self.programs.append(make_program(plan, fw, bw, self.record.extracted))
        return len(self.programs) - 1


def make_program(
    plan: Plan, fw: fx.GraphModule, bw: fx.GraphModule, extracted: Extracted
) -> Program:
    """``plan``'s programs, with their tangent inputs and returned gradients as problem
    nodes (what ``Link``s are made of)."""
    where = {n.name: i for i, n in enumerate(extracted.fx_nodes)}
    inputs = bw.graph.find_nodes(op="placeholder")
    tangents = tuple((k, where[p.name]) for k, p in enumerate(inputs) if is_tangent(p))
    returned = bw.graph.output_node().args[0]
    grads = tuple(where.get(g.name) if isinstance(g, fx.Node) else None for g in returned)
    return Program(plan, boxed(fw), boxed(bw), tangents, grads)
