"""Compile time: joint graph -> plan -> forward and backward programs.

One ``Planner`` serves one compiled model. It plans every joint graph dynamo
hands it (one per graph break, one per new input shape) as it is compiled, and
keeps the plans, so a user can look at what was decided and a test can check the
prediction against a measurement. ``Planner.plan`` returns a ``CompiledGraph``:
everything run time (``remat.runtime``) needs of the graph, handed over explicitly.

That plan is the graph's plan for the first step: dynamo compiles lazily, so the
rest of the step is not known yet. An absolute budget shrinks by what the runs
before it in the step hold (``held``); a fraction applies to the lowest first-step peak
of the graph's reference programs, the room kept for the code after it included
(``first_step.first_step_peak``). ``remat.runtime`` then plans the step as one. A graph
with symbolic sizes is planned at the largest sizes seen (``passes.sizes``) and
re-planned, from the same trace, when larger ones come (``Planner.replan``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import fx

from remat import costs
from remat.agree import planning_solver
from remat.as_given import Phases, as_measured, below_eager, graph_eager_peak
from remat.cache import PlanCache
from remat.candidates import (
    cheaper_and_fits,
    made_under,
    offered,
    remember,
    still_fitting,
    torch_partition,
    user_plan,
)
from remat.compiled import CompiledGraph, GraphPlan, Leaves
from remat.costs import CostModel, calibration, check_cost_model
from remat.device_budget import on_device
from remat.first_step import (
    first_step_peak,
    in_room,
    only_a_loss,
    outside_reserve,
    own_plan,
    widest_room,
    with_room,
    with_the_rest,
)
from remat.keys import candidates_key
from remat.passes._torch_compat import CompileContext, CompileId, real_tensors
from remat.passes.clones import drop_identity_clones
from remat.passes.extract import (
    Extracted,
    extract,
)
from remat.passes.layouts import copied_into_grad, restore_traced_layouts
from remat.passes.rewrite import rewrite
from remat.passes.rng import replay_dropouts
from remat.passes.sizes import Binding, Sizes, describe, no_guards, reading_at
from remat.passes.slice_grads import scatter_slice_gradients
from remat.solvers import (
    InfeasibleBudget,
    Plan,
    Problem,
    format_apart,
    format_bytes,
    held_bytes,
    lowest_budget,
    min_peak_plan,
    solve,
    store_all,
)
from remat.solvers.budget import Budget
from remat.solvers.solve import (
    CPSAT_SOLVERS,
    SOLVERS,
    Solver,
    solver_for,
)

log = logging.getLogger("remat")


class Planner:
    """Plans each joint graph as dynamo compiles it (``plan``): its plan for the first
    step, and as inductor's partitioner (``remat.partitioner``) its only one.

    ``joint_follows``: the step is planned as one after its first run
    (``remat.runtime``), so a graph that cannot fit what is left of the budget runs its
    lowest-peak plan for that step instead of being refused; False where remat does not
    run the programs (``remat.partitioner``), and a graph's plan is its last word.
    """

    def __init__(
        self,
        budget: Budget,
        *,
        solver: str | Solver = "auto",
        cost_model: str = "roofline",
        compiler: str = "eager",
        cache: PlanCache | None = None,
        joint_follows: bool = False,
    ) -> None:
        check_cost_model(cost_model)  # fail at construction, not at the first forward
        solver_for(solver)  # fail at construction, not at the first forward
        if not isinstance(budget, Budget):
            raise TypeError(f"Planner takes a parsed Budget, got {type(budget).__name__}")
        self.budget = budget
        self.solver = solver
        self.cost_model = cost_model
        self.compiler = compiler  # what runs the programs: node times and save costs differ
        self.cache = cache  # problems and plans of earlier processes (``remat.cache``)
        self.joint_follows = joint_follows
        self.graphs: list[GraphPlan] = []
        # the module's eager step, run under fake tensors before the first training call
        # (``as_given``): it caps a fraction for the first graph planned, at those sizes
        self.as_given: Phases | None = None

    def plan(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        *,
        leaves: Leaves = (),
        held: int = 0,
        seen: Sequence[tuple | None] = (),
        held_stored: int = 0,
        stored_peak: int = 0,
        alone: bool = False,
        unseen: bool = False,
    ) -> CompiledGraph:
        """Plan ``joint`` (AOTAutograd's joint graph, rewritten in place by the passes) and
        rewrite it into programs.

        ``leaves``: per input, (identity, bytes) where autograd accumulates a gradient into it
        (``GraphPlan.leaves``; the joint graph alone does not say which). ``held``: bytes the
        runs before it in the step hold while it runs, which an absolute budget leaves it
        less of; ``held_stored``: what they would hold had each stored everything, and
        ``stored_peak``: the highest store-all peak among them, which a fraction is of too (the
        step's store-all peak is at least each). ``alone``: the first graph of its step, ending
        where its frame returns (no graph break after it). ``unseen``: code nothing has seen runs
        after it in the step (a caller's frame resuming eagerly), so its first-step plan keeps it
        the widest room it can (``first_step.widest_room``). A graph with symbolic sizes is planned
        at the sizes it was traced at, or larger ones an earlier trace of its code ran at (``seen``,
        per input of the joint graph: ``Sizes.hints``); ``replan`` plans it again at larger ones.
        """
        start = time.perf_counter()
        self.budget = on_device(self.budget, _device_of(joint))  # "device": bytes from now on
        name = f"graph{len({g.name for g in self.graphs})}"
        as_given, self.as_given = self.as_given, None  # of the call that compiles this graph
        compile_id = CompileContext.current_compile_id()
        with no_guards(joint):
            dropped = drop_identity_clones(joint)  # e.g. dropout(p=0): eager has no such copy
            replayed = replay_dropouts(joint)  # dropout becomes recomputable (mask replayed)
            scattered = scatter_slice_gradients(joint)  # as eager's in-place sum holds
            # read as traced: copies where a layout differs
            copied = restore_traced_layouts(joint, costs.output_strides)
            log.debug(
                "remat %s: %d identity clones dropped, %d dropouts replayed, %d slice "
                "gradients scattered into their sums, %d tensors read as traced through a copy",
                name,
                dropped,
                replayed,
                scattered,
                copied,
            )
            sizes = Sizes.of(joint)
            binding = sizes.hints(seen)
            prepared = time.perf_counter()
            record = self._plan_at(
                joint, num_fwd_outputs, name, binding, held, leaves, compile_id,
                held_stored=held_stored, stored_peak=stored_peak, alone=alone, unseen=unseen,
                as_given=as_given if alone and not held else None,
            )  # fmt: skip
            solved = time.perf_counter()
            eager = self.compiler == "eager"
            fw, bw = rewrite(joint, record.extracted, record.plan, num_fwd_outputs, eager=eager)
        done = time.perf_counter()
        phases = {
            "extract": prepared - start + record.phase_seconds["extract"],
            "solve": record.phase_seconds["solve"],
            "rewrite": done - solved,
        }
        record = dataclasses.replace(record, plan_seconds=done - start, phase_seconds=phases)
        self.graphs[-1] = record
        self._log(record, binding)
        return CompiledGraph(
            record, joint, num_fwd_outputs, fw, bw, sizes, binding, compiler=self.compiler
        )

    def replan(
        self,
        compiled: CompiledGraph,
        binding: Binding,
        held: int = 0,
        held_stored: int = 0,
        stored_peak: int = 0,
        followed: bool = False,
    ) -> GraphPlan:
        """``compiled``'s graph planned again at ``binding``, larger sizes than it was
        planned for (no trace: its programs serve every size). Its plan is kept where it
        still fits, which costs no solve and no new programs; else solved anew, with the
        kept plan as a candidate. ``followed``: other graphs of its step run after it, so
        it keeps them the widest room it can (as ``plan``'s ``unseen``). The caller
        rewrites the plan into programs where it is new (``remat.runtime``)."""
        r = compiled.record
        grown = r.extracted.grown(compiled.binding, binding)
        with no_guards(compiled.joint):
            record = self._plan_at(
                compiled.joint, compiled.num_fwd_outputs, r.name, binding, held, r.leaves,
                r.compile_id, r.plan, grown, held_stored=held_stored, stored_peak=stored_peak,
                unseen=r.room is not None or followed, theirs_before=r.theirs,
            )  # fmt: skip
        self._log(record, binding)
        return record

    def _plan_at(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        name: str,
        binding: Binding,
        held: int,
        leaves: Leaves,
        compile_id: CompileId | None,
        kept: Plan | None = None,
        extracted: Extracted | None = None,
        *,
        held_stored: int = 0,
        stored_peak: int = 0,
        alone: bool = False,
        unseen: bool = False,
        theirs_before: Plan | None = None,
        as_given: Phases | None = None,
    ) -> GraphPlan:
        """The recorded plan of ``joint`` at ``binding`` (its problem ``extracted``, else
        measured): ``kept`` (an earlier binding's plan) where it still fits, else the
        solver's. ``held``, ``held_stored``, ``stored_peak``, ``alone``, ``unseen``: as
        ``plan`` takes them; ``theirs_before``: torch's partition at the earlier binding;
        ``as_given``: the eager step of the module this graph is the whole forward of, at
        ``binding``'s sizes (``remat.as_given``)."""
        start = time.perf_counter()
        with reading_at(binding):
            if extracted is None:
                extracted = self._extract(joint, num_fwd_outputs, name, binding)
            is_leaf = [leaf is not None for leaf in leaves]
            copied = copied_into_grad(joint, num_fwd_outputs, is_leaf)
        extracted_at = time.perf_counter()
        problem = extracted.problem
        baseline = store_all(problem)
        yours = user_plan(extracted, baseline)
        theirs = None
        if self.solver == "auto":  # a candidate, and what a fraction may be of
            theirs = torch_partition(joint, num_fwd_outputs, extracted, self.cache, theirs_before)
        reserve = outside_reserve(extracted)
        after = with_room(problem, reserve, copied) if reserve or copied else None
        # each program's first step, with the room for the code after the graph
        stored_first = first_step_peak(after, baseline)
        reference = min(
            [stored_first] + [first_step_peak(after, p) for p in (yours, theirs) if p is not None]
        )
        eager = None
        if as_given is not None and not binding:  # the eager step was run at these sizes
            as_given = as_measured(extracted, baseline, as_given)
            eager = graph_eager_peak(problem, baseline, as_given, after)
            reference = min(reference, eager)
        else:
            as_given = None
        agree = not binding
        stored = max(stored_peak, held_stored + reference)  # the step's, so far
        limit = self._graph_limit(problem, stored, held, reserve, agree)
        room = widest_room(problem, limit + reserve, reserve) if unseen else None  # same share
        # a kept plan fits the limit, not the room: with one, it is a candidate only
        plan = still_fitting(problem, kept, limit) if room is None else None
        if plan is None:
            log.info(
                "remat %s: solving %d nodes under %s (solver %s)...",
                name,
                len(problem),
                format_bytes(limit),
                getattr(self.solver, "__name__", self.solver),
            )
            key = candidates_key(joint, num_fwd_outputs)
            made = made_under(key, limit)
            if kept is not None:
                candidates = functools.partial(dict, {f"{kept.solver} (kept)": kept.saved})
            elif self.solver == "auto":
                candidates = functools.partial(offered, yours, theirs, made)
            else:
                candidates = dict
            whole = alone and not reserve and only_a_loss(extracted)
            try:
                plan = self._first_plan(
                    problem,
                    limit + reserve,
                    name,
                    held,
                    candidates,
                    agree,
                    whole,
                    reference,
                    reserve if room is None else room,
                    copied,
                )
            except InfeasibleBudget as refusal:
                if eager is None or eager > reference:
                    raise
                raise below_eager(refusal, eager + held) from None
            if room is None and self.solver == "auto" and cheaper_and_fits(yours, plan, limit):
                plan = dataclasses.replace(yours, limit=limit)  # never worse than theirs
            if plan.peak <= limit + reserve:
                remember(key, limit, plan)
        solved_at = time.perf_counter()
        record = GraphPlan(
            name,
            extracted,
            plan,
            baseline,
            limit,
            plan_seconds=solved_at - start,
            phase_seconds={"extract": extracted_at - start, "solve": solved_at - extracted_at},
            compile_id=compile_id,
            leaves=leaves,
            binding=tuple(sorted((str(s), v) for s, v in binding.items())),
            reserve=reserve,
            room=room,
            yours=yours,
            theirs=theirs,
            as_given=as_given,
            figures=calibration.figures_source(),
            store_all_first_step=stored_first,
        )
        self.graphs.append(record)
        return record

    def _log(self, record: GraphPlan, binding: Binding) -> None:
        log.info(
            "remat %s%s: %s (store-all %s, budget %s, planned in %.2fs)",
            record.name,
            f" at {describe(binding)}" if binding else "",
            record.plan,
            format_bytes(record.store_all.peak),
            format_bytes(record.limit),
            record.plan_seconds,
        )

    def held_by_earlier_frames(self) -> int:
        """What earlier graphs of the step hold, where remat sees no runs (as inductor's
        partitioner, ``remat.partitioner``): the latest compile of each dynamo frame
        numbered below the current one (frames are numbered in the order a step reaches
        them; a recompile for new shapes replaces its frame's graph), each holding its
        saved values and outputs."""
        current = CompileContext.current_compile_id()
        if current is None:
            return 0
        latest = {}
        for g in self.graphs:  # in planning order: a later compile of a frame replaces
            if g.compile_id is not None and g.compile_id.frame_id < current.frame_id:
                latest[g.compile_id.frame_id] = g
        return sum(held_bytes(g.extracted.problem, g.plan) for g in latest.values())

    def _first_plan(
        self,
        problem: Problem,
        limit: int,
        name: str,
        held: int,
        candidates: Callable[[], dict[str, frozenset[int]]],
        agree: bool = True,
        whole: bool = False,
        reference: int | None = None,
        reserve: int = 0,
        copied: int = 0,
    ) -> Plan:
        """The plan under ``limit`` (or a cheaper one of ``candidates`` that fits), room for
        the code after the graph kept (``first_step.with_room``). Where none fits: refused
        where no step is planned as one (``remat.partitioner``) or the graph is the
        ``whole`` step (before anything runs), else the lowest-peak plan: the step planned
        as one at its end fits or names the step's minimum, which can be below the
        graph's (904 B against 912 B: a graph holds its outputs to the step's end).
        ``held``: earlier graphs'. ``copied``: bytes autograd copies a gradient into once
        the backward returned (``passes.layouts.copied_into_grad``)."""
        room = with_room(problem, reserve, copied) if reserve or copied else None
        planned = problem if room is None else room.problem

        def offered() -> dict[str, frozenset[int]]:
            found = candidates()
            return found if room is None else {k: in_room(room, v) for k, v in found.items()}

        def own(plan: Plan) -> Plan:
            return plan if room is None else own_plan(room, plan, problem)

        solver = self.solver
        if solver in CPSAT_SOLVERS and self.joint_follows and not whole:
            solver = functools.partial(SOLVERS[solver], probes=0)  # a refusal names no minimum
        if whole or not self.joint_follows:
            try:
                return own(solve(planned, limit, self._cached(solver, agree), offered))
            except InfeasibleBudget as refusal:
                raise with_the_rest(refusal, held, reference) from None
        try:
            return own(solve(planned, limit, self._cached(solver, agree), offered))
        except InfeasibleBudget:
            lowest = min_peak_plan(planned)
            log.warning(
                "remat %s: its first step runs at its lowest peak %s, above the %s left of "
                "the budget for it (the rest of the step counted at %s). Nothing is wrong "
                "yet: the whole step is planned as one when it ends, and from the next step "
                "on fits the budget, or the budget is refused naming the step's minimum.",
                name,
                *format_apart(lowest.peak, limit),
                format_bytes(held + reserve),
            )
            return own(lowest)

    def _cached(self, solver: str | Solver, agree: bool = True) -> str | Solver:
        return planning_solver(solver, self.cache, agree)

    def _extract(
        self, joint: fx.GraphModule, num_fwd_outputs: int, name: str, binding: Binding
    ) -> Extracted:
        """The graph as a ``Problem`` at ``binding``, from the plan cache where an earlier
        process stored it, else measured (``_measure``)."""

        def measure() -> Extracted:
            return self._measure(joint, num_fwd_outputs, name)

        if self.cache is None:
            return measure()
        device = _device_of(joint)
        model = f"{self.cost_model}/{self.compiler}/{calibration.figures_source()}"
        if binding:
            model += f" at {describe(binding)}"
        args = (joint, num_fwd_outputs, model, device, name, measure)
        return self.cache.extracted(*args)

    def _measure(self, joint: fx.GraphModule, num_fwd_outputs: int, name: str) -> Extracted:
        """The graph as a ``Problem``: bytes (each kernel measured on the device, see
        ``CostModel``) and times per node; logged, since on big models it takes a while."""
        with real_tensors():  # the cost model may run ops on the device
            facts = self._cost_model(joint)
            if not costs.scratch_measurable(facts.device):
                log.warning(
                    "remat %s: planned inside a torch.profiler session, so kernels' scratch "
                    "memory was not measured (profiler sessions do not nest) and the measured "
                    "peak may exceed the predicted one. Run a step before profiling: remat "
                    "plans at the first.",
                    name,
                )
            log.info("remat %s: measuring each kernel's memory on %s...", name, facts.device)
            start = time.perf_counter()
            extracted = extract(joint, num_fwd_outputs, facts, name=name)
        log.info(
            "remat %s: %d nodes, %d distinct kernels measured in %.1fs",
            name,
            len(extracted.problem),
            len(facts.kernels),
            time.perf_counter() - start,
        )
        return extracted

    def _graph_limit(
        self, problem, stored: int, held: int, reserve: int, agree: bool = True
    ) -> int:
        """This graph's share of the budget in its first step. Bytes: what the ``held``
        bytes of earlier runs and the ``reserve`` for the code after it leave. A fraction:
        of the step's reference peak so far (``stored``: with the graph's own first-step
        peak, its room included), less what the earlier runs hold and the reserve.
        ``"min"``: the graph's own lowest peak."""
        if self.budget.lowest:
            return lowest_budget(problem, self._cached(self.solver, agree))
        if self.budget.fraction is not None:
            return max(self.budget.resolve(stored) - held - reserve, 1)
        return max(self.budget.nbytes - held - reserve, 1)

    def _cost_model(self, joint: fx.GraphModule) -> CostModel:
        device = _device_of(joint)
        spec = costs.device_spec(joint, device, None if self.cache is None else self.cache.figures)
        return CostModel.for_graph(self.cost_model, joint, device, self.compiler, spec)


def _device_of(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
