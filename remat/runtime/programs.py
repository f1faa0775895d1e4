"""A compiled graph as run time keeps it: the programs its runs may take, one per plan."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from remat.compiled import CompiledGraph, GraphPlan
from remat.passes._torch_compat import FakeTensor, boxed, inductor_program, real_tensors
from remat.passes.extract import Extracted, is_symbolic, is_tangent
from remat.passes.rewrite import reshape_views, rewrite
from remat.passes.sizes import Binding, Sizes, no_guards
from remat.solvers import Plan, Problem

aten = torch.ops.aten
log = logging.getLogger("remat")
CPU = torch.device("cpu")
MARKER = "remat_marker"  # the backward's input for its run's marker


@dataclass
class Program:
    """One plan of a graph as runnable programs, with what its backward is fed and returns."""

    plan: Plan
    forward: Callable
    backward: Callable
    tangents: tuple[tuple[int, int], ...]  # (backward argument, problem node) per tangent
    grads: tuple[int | None, ...]  # problem node of each returned gradient
    # what the forward hands over: the marker's slot (``add_marker_slot``), ``saved``
    # tensors, then ``syms`` sizes (ints), which the backward takes first (AOTAutograd's
    # layout)
    saved: int = 0
    syms: int = 0


@dataclass
class Graph:
    """A compiled graph and the programs its runs may take. ``compiled`` is what the
    planner handed over, with the graph's latest plan of its own (made at the largest
    sizes it has seen, where its sizes are symbolic: ``grow``); ``current`` indexes that
    plan's program (``programs[0]``: the plan made at compile time)."""

    compiled: CompiledGraph
    programs: list[Program] = field(default_factory=list)
    current: int = 0

    @classmethod
    def from_compiled(cls, compiled: CompiledGraph) -> Graph:
        record = compiled.record
        first = make_program(
            record.plan, compiled.forward, compiled.backward, record.extracted, compiled.compiler
        )
        return cls(compiled, [first])

    @property
    def record(self) -> GraphPlan:
        return self.compiled.record

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def joint(self) -> fx.GraphModule:
        return self.compiled.joint

    @property
    def num_fwd_outputs(self) -> int:
        return self.compiled.num_fwd_outputs

    @property
    def sizes(self) -> Sizes:
        return self.compiled.sizes

    @property
    def binding(self) -> Binding:
        return self.compiled.binding

    @property
    def problem(self) -> Problem:
        return self.record.extracted.problem

    @functools.cached_property
    def output_nodes(self) -> tuple[int | None, ...]:
        """Per forward output (what the forward program returns first), its problem node."""
        where = {n.name: i for i, n in enumerate(self.record.extracted.fx_nodes)}
        outs = self.joint.graph.output_node().args[0][: self.num_fwd_outputs]
        return tuple(where.get(o.name) if isinstance(o, fx.Node) else None for o in outs)

    def grow(self, record: GraphPlan, binding: Binding) -> None:
        """The graph planned again at larger sizes (``Planner.replan``): its problem and
        its own plan are ``record``'s from now on."""
        self.compiled = dataclasses.replace(self.compiled, record=record, binding=dict(binding))
        self.current = self.program_for(record.plan)

    def program_for(self, plan: Plan) -> int:
        """The index of the program running ``plan``'s schedule, built if new. A program
        serves every size, so a plan made at other sizes with the same order shares it."""
        for k, p in enumerate(self.programs):
            if p.plan.saved == plan.saved and _order(p.plan) == _order(plan):
                return k
        with no_guards(self.joint):
            fw, bw = rewrite(self.joint, self.record.extracted, plan, self.num_fwd_outputs)
        add_marker_slot(fw, bw, self.num_fwd_outputs)
        compiler = self.compiled.compiler
        self.programs.append(make_program(plan, fw, bw, self.record.extracted, compiler))
        return len(self.programs) - 1


def _order(plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return plan.schedule.forward, plan.schedule.backward


def add_marker_slot(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Give a forward program an output, and its backward an input, for its run's marker
    (``remat.runtime.steps``), in place: the first of the tensors the forward saves, an
    empty one the run's marker replaces. AOTAutograd's runtime counts the tensors a forward
    saves on the programs it compiles (torch 2.14 and later index a list of them by
    position), so the marker must be among them there and in every program a run may take.
    """
    fake = _empty_fake(fw)
    output = fw.graph.output_node()
    with fw.graph.inserting_before(output):
        slot = fw.graph.call_function(aten.empty.memory_format, ([0, 0, 0],), {"device": CPU})
    slot.meta["val"] = fake
    outs = list(output.args[0])
    outs.insert(num_fwd_outputs, slot)
    output.args = (tuple(outs),)
    fw.recompile()
    after_sizes = next(n for n in bw.graph.nodes if n.op != "placeholder" or not is_symbolic(n))
    with bw.graph.inserting_before(after_sizes):
        bw.graph.placeholder(MARKER).meta["val"] = fake
    bw.recompile()


def _empty_fake(gm: fx.GraphModule) -> FakeTensor:
    """An empty fake tensor of the fake mode ``gm`` was traced in: AOTAutograd reads the
    ``val`` of each program input and output."""
    mode = next(
        n.meta["val"].fake_mode for n in gm.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)
    )
    with real_tensors():
        return mode.from_tensor(torch.empty((0, 0, 0)))


def make_program(
    plan: Plan,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    extracted: Extracted,
    compiler: str = "eager",
) -> Program:
    """``plan``'s programs (with their marker's slot), run op by op or compiled by
    ``compiler``, with their tangent inputs and returned gradients as problem nodes (what
    ``Link``s are made of)."""
    where = {n.name: i for i, n in enumerate(extracted.fx_nodes)}
    inputs = bw.graph.find_nodes(op="placeholder")
    tangents = tuple((k, where[p.name]) for k, p in enumerate(inputs) if is_tangent(p))
    returned = bw.graph.output_node().args[0]
    grads = tuple(where.get(g.name) if isinstance(g, fx.Node) else None for g in returned)
    syms = next((k for k, p in enumerate(inputs) if not is_symbolic(p)), len(inputs))
    saved = (tangents[0][0] if tangents else len(inputs)) - syms - 1  # less the marker
    if compiler != "eager":
        # the planner wrote them for a compiler that lays tensors out itself; they are run
        # again on fake tensors through inductor's decompositions (or op by op), where a
        # traced view can meet another layout than it was traced at
        reshape_views(fw)
        reshape_views(bw)
    forward, backward = (None, None) if compiler == "eager" else _compiled(fw, bw)
    if backward is None:
        return Program(plan, boxed(fw), boxed(bw), tangents, grads, saved, syms)

    def run_backward(args: list):
        # a compiled program checks its inputs' sizes: the marker's encode its run
        args[syms] = torch.empty((0, 0, 0))
        return backward(args)

    run_backward._boxed_call = True
    return Program(plan, forward, run_backward, tangents, grads, saved, syms)


def _compiled(fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[Callable | None, Callable | None]:
    """The two programs compiled by inductor, or (None, None) where either cannot be
    (``passes._torch_compat.inductor_program``): they then run op by op, with the
    schedule remat planned (logged once per program)."""
    forward = inductor_program(fw)
    backward = None if forward is None else inductor_program(bw, backward=True)
    if backward is None:
        log.info(
            "remat: a program at symbolic sizes runs op by op: inductor's compile of it "
            "guards its sizes where no dynamo compile is in progress to check them, or lays "
            "out an output otherwise than traced"
        )
        return None, None
    return forward, backward
