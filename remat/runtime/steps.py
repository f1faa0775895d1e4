"""The training step as remat runs it: one plan for every graph run of a step.

A user's step may run several compiled graphs (graph breaks), one graph several times
(a module called twice, a graph break inside a loop), and code remat does not compile
between them (a loss computed on the returned logits). dynamo compiles graphs lazily,
so the step becomes known only by running it:

1. **The first step** runs each graph under the plan made when dynamo compiled it (the
   budget less what the runs before it in the step hold; a graph that cannot fit what is
   left takes its lowest-peak plan), and records the step (``Recording``): which graphs
   ran, in what order, which gradient of one fed another's backward, and the bytes the
   code between them held (``OutsideMemory``).
2. **At its end** (the last waiting backward returned) the recorded runs are planned as
   one (``joint.plan_step``): a program pair per run, or ``InfeasibleBudget`` naming the
   step's minimum.
3. **From the next step on** each run takes its program from the joint plan of the
   recorded step its runs so far match. A step that matches none (new shapes, another
   path through the code) runs the compile-time plans and is recorded like the first.

Each run's forward saves, before its saved values, an empty tensor whose shape names
the run and the program it ran, so its backward runs the matching program even when
the plans changed in between. AOTAutograd's runtime is handed what a run saves in the
compile-time program's layout (``_in_compiled_layout``): as many tensors and sizes as
that program saved, whichever program ran.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from remat.agree import distributed
from remat.cache import PlanCache
from remat.compiled import CompiledGraph, GraphPlan
from remat.passes._torch_compat import (
    FakeTensor,
    after_backward,
    current_dispatch_mode,
    dispatch_modes_off,
    frames_compiled,
    pop_dispatch_mode,
    storage_of,
    tree_flatten,
)
from remat.passes.sizes import Binding, covers, describe, larger
from remat.runtime.joint import StepPlan, plan_step
from remat.runtime.outside import OutsideMemory, push_if_not_top
from remat.runtime.programs import Graph
from remat.runtime.recording import Recording, Run
from remat.solvers import held_bytes
from remat.solvers.budget import Budget
from remat.solvers.solve import Solver

log = logging.getLogger("remat")

Replan = Callable[[CompiledGraph, Binding, int, int, int, bool], GraphPlan]  # ``Planner.replan``


class StepRunner:
    """Runs the graphs of one compiled model step by step (module docstring)."""

    def __init__(
        self,
        budget: Budget,
        solver: str | Solver,
        cache: PlanCache | None = None,
        replan: Replan | None = None,
    ) -> None:
        self.budget, self.solver = budget, solver
        self.cache = cache  # ``remat.cache``: a joint plan an earlier process made
        # plans a graph with symbolic sizes again at larger ones (``Planner.replan``)
        self.replan = replan
        self.graphs: dict[str, Graph] = {}
        self.plans: list[StepPlan] = []
        self.step: Recording | None = None
        self.record_next = True
        self._runs = 0  # run ids, for the markers
        # count from the call's start, not the first graph (``entering``): FSDP2's hooks
        # and a root module dynamo skips run before it (``serve``)
        self.from_call = True
        self._pending: OutsideMemory | None = None
        self._pending_inputs: tuple = ()
        self._recorded_inputs: list[tuple] = []  # input shapes of the steps recorded so far
        # tensors whose storages are resized outside the dispatcher (``OutsideMemory.watch``)
        self.resized: Callable[[], list[torch.Tensor]] = list
        self._live: dict[int, tuple[Recording, int]] = {}
        # per run, what its forward hands its backward past AOTAutograd (``_in_compiled_layout``)
        self._aside: dict[int, tuple[list, list]] = {}
        self._warned: set[str] = set()
        # whether anything compiled since this runner last collected garbage: remat's
        # graphs, and dynamo's count of frames it compiled then (``compiled_since_collected``)
        self._added = False
        self._collected_at: int | None = None

    def serve(
        self, *, resized: Callable[[], list[torch.Tensor]] | None = None, from_call: bool = True
    ) -> None:
        """What the module whose steps this runs needs counted: ``resized``, the tensors
        whose storages it resizes outside the dispatcher (FSDP2's unsharded parameters);
        ``from_call``, whether what its call allocates before the first graph is the
        step's (not for DDP: gloo's threads free its broadcast buffers)."""
        self.resized = resized or list
        self.from_call = from_call

    # ------------------------------------------------------------------ compile time

    def add(self, compiled: CompiledGraph) -> Graph:
        """Take a graph the planner compiled: its runs go through ``forward``/``backward``."""
        graph = Graph.from_compiled(compiled)
        self.graphs[graph.name] = graph
        self._added = True
        return graph

    def compiled_since_collected(self) -> bool:
        """Whether dynamo compiled a frame since this runner last asked (a graph of its
        own, or any frame by dynamo's count): only then can its garbage hold what a
        recorded step ran (``Recording.backward_starts``)."""
        frames = frames_compiled()
        compiled = self._added or frames is None or frames != self._collected_at
        self._added, self._collected_at = False, frames
        return compiled

    def held_now(self, stored: bool = False) -> int:
        """What the step in progress holds while a newly compiled graph runs: its runs
        (with ``stored``, what they would hold had each stored everything) and the code
        outside them, as counted so far. That code includes what the call ran before its
        first graph: a forward whose start runs eagerly (a graph break at a call dynamo
        will not trace) compiles its first graph alone, where the step holds that code's
        tensors beside it (counted nothing, the refusal before the first step named the
        graph's minimum, 533,544 B, and a retry there was refused at the step's end,
        naming 664,616 B)."""
        outside = self._counting()
        code = 0 if outside is None else outside.level
        if self.step is None:
            return code
        return code + sum(
            held_bytes(
                r.graph.problem,
                r.graph.record.store_all if stored else r.graph.programs[r.program].plan,
            )
            for r in self.step.runs
            if not r.done
        )

    def stored_peak(self) -> int:
        """The highest store-all peak (with its room for the code after it) among the
        graphs the step in progress ran so far: its store-all peak is at least that."""
        if self.step is None:
            return 0
        return max((r.graph.record.store_all_first_step for r in self.step.runs), default=0)

    def starting(self) -> bool:
        """Whether no graph of the step in progress has run yet (a graph compiled now is
        its first)."""
        return self.step is None or not self.step.runs

    def forward(self, graph: Graph) -> Callable:
        """The boxed forward AOTAutograd calls for ``graph``."""

        def run(args: list):
            if _fake(args):  # DDP's optimizer runs graphs on fake tensors while compiling
                return graph.programs[0].forward(args)
            binding = graph.sizes.read(args) if graph.sizes else {}
            if not covers(graph.binding, binding):
                self._grow(graph, binding)
            step = self._step(graph, binding)
            if any(r.done for r in step.runs) and not step.irregular:
                step.irregular = f"{graph.name} ran after a backward of the same step"
            k = self._choose(step, graph, binding)
            step.section(self.resized())
            outs = list(graph.programs[k].forward(args))
            self._runs += 1
            if step.outside is not None and not distributed():
                # where the caller drops an output is seen per rank, and a step's solve is
                # a collective: ranks that saw it differently would solve unequally often
                step.watch_outputs(len(step.runs), graph, outs[: graph.num_fwd_outputs])
            marker = torch.empty((0, self._runs, k))
            weakref.finalize(marker, self._dropped, self._runs)
            outs[graph.num_fwd_outputs] = marker  # in its slot (``add_marker_slot``)
            outs = self._in_compiled_layout(graph, k, outs)
            self._live[self._runs] = (step, len(step.runs))
            step.runs.append(Run(graph, k, binding))
            step.resume()
            return outs

        run._boxed_call = True
        return run

    def backward(self, graph: Graph) -> Callable:
        """The boxed backward AOTAutograd calls for ``graph``."""

        def run(args: list):
            # the first tensor: AOTAutograd passes the saved sizes (ints) before them
            first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), 0)
            marker = args[first] if args else None
            if not (isinstance(marker, torch.Tensor) and marker.dim() == 3 and not marker.numel()):
                raise AssertionError(f"remat {graph.name}: backward without its run's marker")
            run_id, k = marker.shape[1], marker.shape[2]
            del marker
            program = graph.programs[k]
            args = self._in_program_layout(graph, k, args, run_id)
            found = self._live.pop(run_id, None)
            if found is None or found[0] is not self.step:
                return program.backward(args)
            step, position = found
            # no reference to a tangent may outlive this: the program frees each after use
            step.backward_starts(
                position,
                [(args[a], n) for a, n in program.tangents],
                self.resized(),
                self.compiled_since_collected,
            )
            grads = program.backward(args)
            for g, node in zip(grads, program.grads, strict=False):
                key = storage_of(g)
                if key is not None and node is not None:
                    step.gradients.setdefault(key, (position, node))
            if step.handed is not None:
                step.handed.returned(position, zip(grads, program.grads, strict=False))
            step.runs[position].done = True
            step.resume()
            if not step.waiting:  # the code after it in this backward is the step's too
                after_backward(functools.partial(self._end, step))
            return grads

        run._boxed_call = True
        return run

    # ------------------------------------------------------------------ the step

    def _grow(self, graph: Graph, binding: Binding) -> None:
        """``graph`` runs at sizes larger than it was planned for: planned again at sizes
        covering both (warned once per graph: it costs a solve where the plan no longer
        fits), before anything of the run allocates. Where other graphs of its step run
        after it (a graph break, DDP's buckets), it keeps them the widest room it can, as
        a first step does: their needs at the new sizes are unknown until the step,
        recorded, is planned as one at its end."""
        if self.replan is None:
            raise AssertionError(f"remat {graph.name}: sizes grew with no planner to replan")
        grown = larger(graph.binding, binding)
        log.info("remat %s: sizes grew to %s: planning again", graph.name, describe(grown))
        followed = any(graph.name in p.graphs[:-1] for p in self.plans)
        with self.paused():
            held, stored = self.held_now(), self.held_now(stored=True)
            record = self.replan(graph.compiled, grown, held, stored, self.stored_peak(), followed)
            graph.grow(record, grown)

    def _step(self, first: Graph, binding: Binding) -> Recording:
        """The step in progress, or a new one starting with ``first``: recorded when no
        joint plan starts with it at sizes covering ``binding`` (new input shapes, or
        sizes larger than any measured: ``StepPlan.measured``), or the last unplanned step
        was not."""
        if self.step is None:
            known = any(
                p.graphs[0] == first.name and covers(p.measured[0], binding) for p in self.plans
            )
            record = self.record_next or not known
            pending, self._pending = self._pending, None
            if record and pending is not None:
                self._recorded_inputs.append(self._pending_inputs)
            if record:
                outside = pending or OutsideMemory()
            elif pending is not None:
                pending.stop()  # off the stack when the call returns (``returned``)
            self.step = Recording(outside if record else None)
        return self.step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Planning a graph or a step mid-step, with no ``OutsideMemory`` on the stack: its
        allocations are not the user's code's, and its collectives (ranks agreeing on a
        plan) need not pass through a Python dispatch mode."""
        with dispatch_modes_off(OutsideMemory):
            yield

    def _choose(self, step: Recording, graph: Graph, binding: Binding) -> int:
        """The program of the step's next run: from the latest joint plan whose runs so far
        are this step's and whose sizes cover this run's, else the graph's own plan."""
        prefix = (*step.signature, graph.name)
        at = len(prefix) - 1
        for plan in reversed(self.plans):
            if plan.graphs[: len(prefix)] == prefix and covers(plan.bindings[at], binding):
                return plan.programs[at]
        return graph.current

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
            if self.record_next or not any(_within(shapes, r) for r in self._recorded_inputs):
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

    def _in_compiled_layout(self, graph: Graph, k: int, outs: list) -> list:
        """Program ``k``'s forward outputs as AOTAutograd's runtime expects the compiled
        program's (``programs[0]``): it counts the tensors and sizes handed over, indexes
        what it knows of each saved tensor by position (torch 2.14 and later), and marks
        their symbolic dimensions by position, all fixed at compile time, while a later
        plan may save other tensors and sizes. So the runtime gets as many saved tensors
        (empty ones added) and sizes (zeros) as the compiled program gave it; the sizes and
        any tensors past that count wait here, keyed by the run (``_in_program_layout``).
        """
        program, compiled = graph.programs[k], graph.programs[0]
        start = graph.num_fwd_outputs + 1  # after the marker
        fits = start + min(program.saved, compiled.saved)
        cut = start + program.saved
        self._aside[self._runs] = (outs[fits:cut], outs[cut:])
        padding = compiled.saved - (fits - start)
        return [*outs[:fits], *[_EMPTY] * padding, *[0] * compiled.syms]

    def _in_program_layout(self, graph: Graph, k: int, args: list, run_id: int) -> list:
        """``_in_compiled_layout`` undone for program ``k``'s backward, in place (the
        program frees each argument after its last use, so no other list may hold them):
        its own sizes first, then the marker and its saved tensors, then the rest."""
        program, compiled = graph.programs[k], graph.programs[0]
        more, sizes = self._aside.pop(run_id, ([], []))
        args[: compiled.syms] = sizes
        start = program.syms + 1 + min(program.saved, compiled.saved)
        padding = compiled.saved - min(program.saved, compiled.saved)
        args[start : start + padding] = more
        return args

    def _dropped(self, run_id: int) -> None:
        """A run's autograd graph was freed without its backward (its output dropped)."""
        self._aside.pop(run_id, None)
        found = self._live.pop(run_id, None)
        if found is None:
            return
        step, position = found
        step.runs[position].done = True
        if not step.irregular:
            step.irregular = f"{step.runs[position].graph.name} ran without a backward"
        if step is self.step and not step.waiting:
            self._end(step)

    def _end(self, step: Recording) -> None:
        self.step = None
        if step.outside is not None:
            last = step.outside.section()[1]
            step.outside.stop()
            step.handed.ended = True
            step.peaks.append(last)
        if any(self._serves(p, step) for p in self.plans):
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
        grown = next((p for p in reversed(self.plans) if p.graphs == step.signature), None)
        with self.paused():
            self.plans.append(plan_step(step, self.budget, self.solver, self.cache, grown=grown))

    @staticmethod
    def _serves(plan: StepPlan, step: Recording) -> bool:
        """Whether ``plan`` serves steps like ``step``: the same runs, none larger than
        measured."""
        return plan.graphs == step.signature and all(
            covers(b, r.binding) for b, r in zip(plan.measured, step.runs, strict=True)
        )


def _shapes(inputs: Sequence) -> tuple:
    """The shapes and dtypes of the tensors in ``inputs`` (what a new plan is made for)."""
    return tuple(
        (tuple(t.shape), t.dtype) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)
    )


def _within(shapes: tuple, recorded: tuple) -> bool:
    """Whether inputs of ``shapes`` are ``recorded``'s or smaller, dimension by dimension
    (a plan made at sizes serves every smaller one: ``passes.sizes``)."""
    return len(shapes) == len(recorded) and all(
        dtype == d and len(shape) == len(s) and all(a <= b for a, b in zip(shape, s, strict=True))
        for (shape, dtype), (s, d) in zip(shapes, recorded, strict=True)
    )


_EMPTY = torch.empty(0)  # a saved tensor that is only a place kept (``_in_compiled_layout``)


def _fake(args: Sequence) -> bool:
    return any(isinstance(a, FakeTensor) for a in args)
