"""The training step as remat runs it: one plan for every graph run of a step.

A user's step may run several compiled graphs (graph breaks), one graph several times
(a module called twice, a graph break inside a loop), and code remat does not compile
between them (a loss computed on the returned logits). dynamo compiles graphs lazily,
so the step becomes known only by running it:

1. **The first step** runs each graph under the plan made when dynamo compiled it (the
   budget less what the runs before it in the step hold; a graph that cannot fit what is
   left takes its lowest-peak plan), and records the step: which graphs ran, in what
   order, which gradient of one fed another's backward, and the bytes the code between
   them held (``OutsideMemory``).
2. **At its end** (the last waiting backward returned) the recorded runs are composed
   into one problem (``solvers.step``) and solved against the budget: the step's joint
   plan, a program pair per run, or ``InfeasibleBudget`` naming the step's minimum.
   A step of one run whose first plan already fits is not solved again.
3. **From the next step on** each run takes its program from the joint plan of the
   recorded step its runs so far match. A step that matches none (new shapes, another
   path through the code) runs the compile-time plans and is recorded like the first.

Each run's forward saves, before its saved values, an empty tensor whose shape names
the run and the program it ran, so its backward runs the matching program even when
the plans changed in between.

One file because the runners, the dispatch mode stack discipline (``entering``,
``returned``) and the step's solve all read and write the step being recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from remat.agree import distributed, planning_solver
from remat.cache import PlanCache
from remat.handed import Handed, keeping, own_order
from remat.outside import OutsideMemory, push_if_not_top
from remat.passes._torch_compat import (
    FakeTensor,
    after_backward,
    boxed,
    current_dispatch_mode,
    dispatch_modes_off,
    pop_dispatch_mode,
    storage_of,
    tree_flatten,
)
from remat.passes.extract import is_tangent
from remat.passes.rewrite import rewrite
from remat.solvers import (
    InfeasibleBudget,
    Plan,
    evaluate,
    held_bytes,
    solve,
    store_all,
)
from remat.solvers.budget import Budget
from remat.solvers.step import (
    Composed,
    Link,
    Outside,
    Step,
    compose,
    joint_order,
    joint_saved,
    split,
    split_orders,
)

log = logging.getLogger("remat")


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
    at compile time)."""

    record: object  # planner.GraphPlan
    joint: fx.GraphModule
    num_fwd_outputs: int
    programs: list[Program] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def problem(self):
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


def make_program(plan: Plan, fw: fx.GraphModule, bw: fx.GraphModule, extracted) -> Program:
    """``plan``'s programs, with their tangent inputs and returned gradients as problem
    nodes (what ``Link``s are made of)."""
    where = {n.name: i for i, n in enumerate(extracted.fx_nodes)}
    inputs = bw.graph.find_nodes(op="placeholder")
    tangents = tuple((k, where[p.name]) for k, p in enumerate(inputs) if is_tangent(p))
    returned = bw.graph.output_node().args[0]
    grads = tuple(where.get(g.name) if isinstance(g, fx.Node) else None for g in returned)
    return Program(plan, boxed(fw), boxed(bw), tangents, grads)


@dataclass(frozen=True)
class StepPlan:
    """The joint plan of a recorded step: per run, its graph and program."""

    graphs: tuple[str, ...]  # per run, in forward order
    programs: tuple[int, ...]  # per run, the index into its graph's programs
    composed: Composed
    plan: Plan  # of ``composed.problem``
    first_peak: int  # what the recorded (first) step's plans peak at, predicted
    budget: int

    @property
    def runs(self) -> int:
        return len(self.graphs)


@dataclass
class _Run:
    graph: Graph
    program: int
    done: bool = False


@dataclass
class _Recording:
    """The step in progress."""

    outside: OutsideMemory | None
    runs: list[_Run] = field(default_factory=list)
    backward_order: list[int] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    gradients: dict = field(default_factory=dict)  # storage -> (run, node) returned
    links: list[Link] = field(default_factory=list)
    irregular: str = ""  # why the step cannot be planned as one, if it cannot
    handed: Handed | None = None  # the gradients the backwards returned, once returned
    # (run, output node) -> the section before which the caller dropped that output, where
    # it did so before the first backward (``solvers.step.Step.released``)
    released: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outside is not None:
            self.handed = Handed(self.outside, self.levels)

    @property
    def signature(self) -> tuple[str, ...]:
        return tuple(r.graph.name for r in self.runs)

    @property
    def waiting(self) -> int:
        return sum(not r.done for r in self.runs)

    def watch_outputs(self, position: int, graph: Graph, outs: Sequence) -> None:
        """Note where the caller drops run ``position``'s outputs: one dropped before the
        backwards begin (the logits beside a loss) is not held through them."""
        by_storage: dict = {}
        for t, node in zip(outs, graph.output_nodes, strict=False):
            key = storage_of(t)
            if key is not None and node is not None:
                by_storage.setdefault(key, (t, []))[1].append(node)
        for t, nodes in by_storage.values():
            weakref.finalize(t.untyped_storage(), self._dropped_output, position, tuple(nodes))

    def _dropped_output(self, position: int, nodes: tuple[int, ...]) -> None:
        if self.backward_order:
            return  # held into the backwards: as the problem holds it
        for node in nodes:
            self.released[position, node] = len(self.levels)  # the section running now


class StepRunner:
    """Runs the graphs of one compiled model step by step (module docstring)."""

    def __init__(self, budget: Budget, solver, cache: PlanCache | None = None) -> None:
        self.budget, self.solver = budget, solver
        self.cache = cache  # ``remat.cache``: a joint plan an earlier process made
        self.graphs: dict[str, Graph] = {}
        self.plans: list[StepPlan] = []
        self.step: _Recording | None = None
        self.record_next = True
        self._runs = 0  # run ids, for the markers
        # count from the call's start, not the first graph (``entering``): FSDP2's hooks
        # and a root module dynamo skips run before it
        self.from_call = True
        self._pending: OutsideMemory | None = None
        self._pending_inputs: tuple = ()
        self._recorded_inputs: set[tuple] = set()  # input shapes of the steps recorded so far
        # tensors whose storages are resized outside the dispatcher (``OutsideMemory.watch``)
        self.resized: Callable[[], list[torch.Tensor]] = list
        self._live: dict[int, tuple[_Recording, int]] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ compile time

    def add(self, record, joint, num_fwd_outputs, fw, bw) -> Graph:
        graph = Graph(record, joint, num_fwd_outputs)
        graph.programs.append(make_program(record.plan, fw, bw, record.extracted))
        self.graphs[record.name] = graph
        return graph

    def held_now(self) -> int:
        """What the runs of the step in progress hold while a newly compiled graph runs."""
        if self.step is None:
            return 0
        return sum(
            held_bytes(r.graph.problem, r.graph.programs[r.program].plan)
            for r in self.step.runs
            if not r.done
        )

    def forward(self, graph: Graph) -> Callable:
        """The boxed forward AOTAutograd calls for ``graph``."""

        def run(args: list):
            if _fake(args):  # DDP's optimizer runs graphs on fake tensors while compiling
                return graph.programs[0].forward(args)
            step = self._step(graph)
            if any(r.done for r in step.runs) and not step.irregular:
                step.irregular = f"{graph.name} ran after a backward of the same step"
            k = self._choose(step, graph)
            self._section(step)
            outs = list(graph.programs[k].forward(args))
            if step.outside is not None and not distributed():
                # where the caller drops an output is seen per rank, and a step's solve is
                # a collective: ranks that saw it differently would solve unequally often
                step.watch_outputs(len(step.runs), graph, outs[: graph.num_fwd_outputs])
            self._runs += 1
            marker = torch.empty((0, self._runs, k))
            weakref.finalize(marker, self._dropped, self._runs)
            outs.insert(graph.num_fwd_outputs, marker)
            self._live[self._runs] = (step, len(step.runs))
            step.runs.append(_Run(graph, k))
            self._resume(step)
            return outs

        run._boxed_call = True
        return run

    def backward(self, graph: Graph) -> Callable:
        """The boxed backward AOTAutograd calls for ``graph``."""

        def run(args: list):
            marker = args.pop(0)
            if not (isinstance(marker, torch.Tensor) and marker.dim() == 3 and not marker.numel()):
                raise AssertionError(f"remat {graph.name}: backward without its run's marker")
            run_id, k = marker.shape[1], marker.shape[2]
            program = graph.programs[k]
            found = self._live.pop(run_id, None)
            if found is None or found[0] is not self.step:
                return program.backward(args)
            step, position = found
            # no reference to a tangent may outlive this: the program frees each after use
            self._backward_section(step, position, [(args[a], n) for a, n in program.tangents])
            grads = program.backward(args)
            for g, node in zip(grads, program.grads, strict=False):
                key = storage_of(g)
                if key is not None and node is not None:
                    step.gradients.setdefault(key, (position, node))
            if step.handed is not None:
                step.handed.returned(position, zip(grads, program.grads, strict=False))
            step.runs[position].done = True
            self._resume(step)
            if not step.waiting:  # the code after it in this backward is the step's too
                after_backward(functools.partial(self._end, step))
            return grads

        run._boxed_call = True
        return run

    # ------------------------------------------------------------------ the step

    def _step(self, first: Graph) -> _Recording:
        """The step in progress, or a new one starting with ``first``: recorded when no
        joint plan starts with it (a new input shape) or the last unplanned step was not."""
        if self.step is None:
            known = any(p.graphs[0] == first.name for p in self.plans)
            record = self.record_next or not known
            pending, self._pending = self._pending, None
            if record and pending is not None:
                self._recorded_inputs.add(self._pending_inputs)
            if record:
                outside = pending or OutsideMemory()
            elif pending is not None:
                pending.stop()  # off the stack when the call returns (``returned``)
            self.step = _Recording(outside if record else None)
        return self.step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Planning a graph or a step mid-step, with no ``OutsideMemory`` on the stack: its
        allocations are not the user's code's, and its collectives (ranks agreeing on a
        plan) need not pass through a Python dispatch mode."""
        with dispatch_modes_off(OutsideMemory):
            yield

    def _choose(self, step: _Recording, graph: Graph) -> int:
        """The program of the step's next run: from the latest joint plan whose runs so far
        are this step's, else the graph's compile-time one."""
        prefix = (*step.signature, graph.name)
        for plan in reversed(self.plans):
            if plan.graphs[: len(prefix)] == prefix:
                return plan.programs[len(prefix) - 1]
        return 0

    def _section(self, step: _Recording) -> None:
        if step.outside is not None:
            step.outside.watch(self.resized())
            level, peak = step.outside.section()
            step.levels.append(level)
            step.peaks.append(peak)

    def _resume(self, step: _Recording) -> None:
        if step.outside is not None:
            step.outside.resume()

    @property
    def forwards_run(self) -> int:
        """How many forward programs have run (a fallback to eager is safe only before
        a call ran any: a rerun would update buffers twice)."""
        return self._runs

    def entering(self, inputs: Sequence = ()) -> None:
        """The user calls the compiled function or module with ``inputs`` (``remat.optimize``'s
        wrappers, before a module's hooks): the ``OutsideMemory`` counting this call goes on
        top of the dispatch mode stack, any other (left by a step that ended or failed) off
        it. With ``from_call``, a call starting a step that may be recorded (the next is, or
        none on inputs of these shapes was) counts with a pending one, so the code before its
        first graph is in the step's first section; others run without (a mode sees every
        op, about 20 us each on CPU). Modes are pushed and popped only here and in
        ``returned``, outside compiled frames: AOTAutograd wraps its first run in a mode of
        its own, whose exit pops whatever is on top."""
        mine = self._counting()
        if self.from_call and mine is None and self.step is None and torch.is_grad_enabled():
            shapes = _shapes(inputs)
            if self.record_next or shapes not in self._recorded_inputs:
                mine = self._pending = OutsideMemory()
                self._pending_inputs = shapes
                mine.resume()
        top = current_dispatch_mode()
        while isinstance(top, OutsideMemory) and top is not mine:
            pop_dispatch_mode()
            top = current_dispatch_mode()
        if mine is not None:
            push_if_not_top(mine)
            mine.watch(self.resized())

    def returned(self) -> None:
        """The compiled function returned to the user's code: the step's ``OutsideMemory``
        stays on the stack, to count what the code after it (a loss on its output, its
        backward) allocates; a call that ran no training graph, or a step not recorded,
        leaves none."""
        mine = self._counting()
        if mine is not None:
            push_if_not_top(mine)
            return
        self._pending = None
        while isinstance(current_dispatch_mode(), OutsideMemory):
            pop_dispatch_mode()

    def _counting(self) -> OutsideMemory | None:
        """The ``OutsideMemory`` counting now: the recorded step's, or a pending one."""
        if self.step is None:
            return self._pending
        outside = self.step.outside
        return outside if outside is not None and outside.active else None

    def _backward_section(self, step: _Recording, position: int, tangents) -> None:
        if step.outside is not None:
            step.handed.fed([t for t, _ in tangents])
            step.outside.forget([t for t, _ in tangents])
        self._section(step)
        step.backward_order.append(position)
        for t, node in tangents:
            source = step.gradients.get(storage_of(t))
            if source is not None:
                step.links.append(Link(source[0], source[1], position, node))

    def _dropped(self, run_id: int) -> None:
        """A run's autograd graph was freed without its backward (its output dropped)."""
        found = self._live.pop(run_id, None)
        if found is None:
            return
        step, position = found
        step.runs[position].done = True
        if not step.irregular:
            step.irregular = f"{step.runs[position].graph.name} ran without a backward"
        if step is self.step and not step.waiting:
            self._end(step)

    def _end(self, step: _Recording) -> None:
        self.step = None
        if step.outside is not None:
            last = step.outside.section()[1]
            step.outside.stop()
            step.handed.ended = True
            step.peaks.append(last)
        if any(p.graphs == step.signature for p in self.plans):
            return
        if step.outside is None:
            self.record_next = True  # a new kind of step, not measured: record the next
            return
        self.record_next = False
        if step.irregular:
            if step.irregular not in self._warned:
                self._warned.add(step.irregular)
                log.warning(
                    "remat: this step cannot be planned as one (%s): its graphs keep the "
                    "plans made as they were compiled, and its memory may exceed the budget.",
                    step.irregular,
                )
            return
        with self.paused():
            self.plans.append(self._solve(step))

    def _solve(self, step: _Recording, release: bool = True) -> StepPlan:
        """The step's joint plan; with ``release``, counting the outputs its caller dropped
        before the backwards as freed there (``Step.released``)."""
        runs = step.runs
        levels, peaks, freed = step.handed.planned(step.levels, step.peaks)
        problems = tuple(
            keeping(r.graph.problem, freed.get(k, frozenset())) for k, r in enumerate(runs)
        )
        order = tuple(step.backward_order)
        accumulate = _accumulate(runs, order)
        released = tuple((r, i, s) for (r, i), s in sorted(step.released.items()) if release)
        outside = Outside(levels, peaks)
        shape = Step(problems, order, tuple(step.links), accumulate, outside, released)
        names = ", ".join(r.graph.name for r in runs)
        composed = compose(shape, name=f"step ({names})")
        used = tuple(r.graph.programs[r.program].plan for r in runs)
        first = _as_run(composed, used, "compile-time")
        log.info("remat: first step of (%s) predicted at %d bytes", names, first.peak)
        limit = _limit(self.budget, composed)
        if len(runs) == 1 and first.peak <= limit:
            compiled = runs[0].graph.programs[runs[0].program].plan
            plan = _kept(first, compiled, limit)
            programs = (runs[0].program,)
        else:
            try:
                solver = planning_solver(self.solver, self.cache)
                plan = solve(composed.problem, self.budget, solver)
            except InfeasibleBudget as refusal:
                raise _in_step_terms(refusal, runs) from None
            saved = split(composed, plan)
            orders = (
                tuple(
                    own_order(o, r.graph.problem)
                    for o, r in zip(split_orders(composed, plan), runs, strict=True)
                )
                if plan.ordered
                else (None,) * len(runs)
            )
            programs = tuple(
                r.graph.program_for(evaluate(r.graph.problem, s, backward=o, solver=plan.solver))
                for r, s, o in zip(runs, saved, orders, strict=True)
            )
            if released:
                # a run's program still hands a held output its backward reads over to
                # it: the step's plan is what the programs run, checked against the limit
                ran = tuple(r.graph.programs[k].plan for r, k in zip(runs, programs, strict=True))
                again = _as_run(composed, ran, plan.solver)
                if again.peak > limit:
                    return self._solve(step, release=False)
                plan = dataclasses.replace(again, status=plan.status, bound=plan.bound)
            log.info("remat: step (%s) planned as one: %s", names, plan)
        return StepPlan(
            tuple(r.graph.name for r in runs), programs, composed, plan, first.peak, limit
        )


def _as_run(composed: Composed, plans: tuple[Plan, ...], solver: str) -> Plan:
    """The plan of ``composed`` that runs each run's own ``plans[r]``."""
    saved = joint_saved(composed, tuple(p.saved for p in plans))
    order = joint_order(composed, plans) if any(p.ordered for p in plans) else None
    return evaluate(composed.problem, saved, backward=order, solver=solver)


def _kept(first: Plan, compiled: Plan, limit: int) -> Plan:
    """A one-run step keeping the plan its graph was compiled with. Its status and bound
    carry over when the step's limit is within the graph's budget: outside memory only
    adds to a peak, so every plan that fits the step fit the graph."""
    if compiled.budget is not None and limit <= compiled.budget:
        return dataclasses.replace(
            first, solver=compiled.solver, status=compiled.status, bound=compiled.bound
        )
    return dataclasses.replace(first, solver=f"{compiled.solver} (compile-time)")


def _limit(budget: Budget, composed: Composed) -> int:
    return budget.resolve(store_all(composed.problem).peak)


def _accumulate(runs: list[_Run], order: tuple[int, ...]) -> tuple[int, ...]:
    """Per run: the largest parameter it shares with a run whose backward ran before its
    own (autograd sums the two gradients into a new tensor before freeing the old)."""
    out = [0] * len(runs)
    seen: set = set()
    for position in order:
        leaves = runs[position].graph.record.leaves
        out[position] = max((b for ident, b in leaves if (ident, b) in seen), default=0)
        seen |= leaves
    return tuple(out)


def _in_step_terms(refusal: InfeasibleBudget, runs: list[_Run]) -> InfeasibleBudget:
    names = ", ".join(r.graph.name for r in runs)
    note = (
        ""
        if len(runs) == 1
        else f"The step runs {len(runs)} graphs ({names}), planned together: the minimum is "
        "the whole step's."
    )
    r = refusal
    where = f"step ({names})"
    return InfeasibleBudget(r.budget, r.minimum, r.store_all, where, r.proven, note=note)


def _shapes(inputs: Sequence) -> tuple:
    """The shapes and dtypes of the tensors in ``inputs`` (what a new plan is made for)."""
    return tuple(
        (tuple(t.shape), t.dtype) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)
    )


def _fake(args: Sequence) -> bool:
    return any(isinstance(a, FakeTensor) for a in args)
