"""The partitioner remat plugs into AOTAutograd: joint graph -> plan -> fw/bw modules.

One ``Planner`` serves one compiled model. It plans every joint graph dynamo
hands it (one per graph break) and keeps the plans, so a user can look at
what was decided and a test can check the prediction against a measurement.

Budget across graph breaks: graphs are compiled in forward order, and the
values an earlier graph saves or returns stay allocated while later graphs run.
An absolute budget therefore shrinks, for each graph, by the bytes the earlier
graphs of its step hold (a recompile for new input shapes starts a step of its
own); a fractional budget applies to each graph's own store-all peak. Graphs
with symbolic input sizes are refused: a plan is for concrete shapes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._guards import CompileContext, CompileId

from remat import costs
from remat.passes._torch_compat import real_tensors
from remat.passes.clones import drop_identity_clones
from remat.passes.extract import Extracted, extract, is_root_tangent
from remat.passes.rewrite import rewrite
from remat.passes.rng import replay_dropouts
from remat.solvers import (
    InfeasibleBudget,
    Plan,
    format_bytes,
    held_bytes,
    parse_budget,
    resolve_budget,
    returned_bytes,
    saved_bytes,
    solve,
    store_all,
)
from remat.solvers.budget import Budget
from remat.solvers.solve import Solver

log = logging.getLogger("remat")

COST_MODELS = ("roofline", "profile")


@dataclass
class CostModel:
    """Node facts for ``passes.extract``: bytes and aliasing from fake tensors (bytes
    raised to a kernel's measured output storage), scratch measured per kernel, time by
    roofline estimate or, with ``measured``, by timing each op on the device."""

    spec: costs.DeviceSpec
    device: torch.device
    measured: dict[str, float] = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)  # costs.kernel_memory's cache

    def allocated_bytes(self, node: fx.Node) -> int:
        """The fake tensors' sizes, or the measured storage where a single output's is
        larger (``costs.KernelMemory``); never less, so the budget stays safe."""
        nominal = costs.allocated_bytes(node)
        if nominal == 0 or isinstance(node.meta.get("val"), (list, tuple)):
            return nominal  # aliases, views, multi-output ops (their parts own the bytes)
        measured = costs.kernel_memory(node, self.device, self.kernels)
        return nominal if measured is None else max(nominal, measured.storage)

    def aliased_input(self, node: fx.Node) -> fx.Node | None:
        return costs.aliased_input(node)

    def seconds(self, node: fx.Node) -> float:
        if node.name in self.measured:
            return self.measured[node.name]
        return costs.estimate_seconds(node, self.spec)

    def workspace(self, node: fx.Node) -> int:
        measured = costs.kernel_memory(node, self.device, self.kernels)
        return 0 if measured is None else measured.scratch

    def recomputable(self, node: fx.Node) -> bool:
        return not (costs.is_random(node) or costs.has_side_effects(node))


@dataclass(frozen=True)
class GraphPlan:
    """What remat decided for one compiled graph, with the numbers behind it."""

    name: str
    extracted: Extracted
    plan: Plan
    store_all: Plan
    budget: int
    plan_seconds: float
    # dynamo's id of the compile that produced this graph (None outside dynamo), and the
    # names of the graphs that run before it in the same step (``Planner._earlier_in_step``)
    compile_id: CompileId | None = None
    after: tuple[str, ...] = ()
    # (identity, bytes) of the leaf tensors (parameters) its backward gives gradients to:
    # those stay in ``.grad`` while the backwards of earlier graphs of the step run
    leaves: frozenset[tuple[int, int]] = frozenset()
    # its backward starts from a scalar's gradient (a loss computed inside the graph)
    loss_inside: bool = True

    @property
    def saved_bytes(self) -> int:
        return saved_bytes(self.extracted.problem, self.plan)

    @property
    def held_bytes(self) -> int:
        """What stays allocated while later graphs of the step run (``solvers.held_bytes``)."""
        return held_bytes(self.extracted.problem, self.plan)


class Planner:
    """``partition_fn`` for AOTAutograd (and inductor's custom partitioner)."""

    def __init__(
        self, budget: Budget, *, solver: str | Solver = "auto", cost_model: str = "roofline"
    ) -> None:
        parse_budget(budget)  # fail at construction, not at the first forward
        if cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
        if isinstance(solver, str):
            from remat.solvers import SOLVERS

            if solver not in SOLVERS:
                raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
        self.budget = budget
        self.solver = solver
        self.cost_model = cost_model
        self.graphs: list[GraphPlan] = []
        # set by the backend for the next graph: its inputs that are leaves needing a
        # gradient, as ``GraphPlan.leaves`` (the joint graph alone does not say which)
        self.next_leaves: frozenset[tuple[int, int]] = frozenset()

    def __call__(
        self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_ignored
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        start = time.perf_counter()
        name = f"graph{len(self.graphs)}"
        _refuse_symbolic_shapes(joint, name)
        compile_id = CompileContext.current_compile_id()
        earlier = self._earlier_in_step(compile_id)
        dropped = drop_identity_clones(joint)  # e.g. dropout(p=0): eager has no such copy
        replayed = replay_dropouts(joint)  # dropout becomes recomputable (mask replayed)
        log.debug(
            "remat %s: %d identity clones dropped, %d dropouts replayed", name, dropped, replayed
        )
        extracted = self._extract(joint, num_fwd_outputs, name)
        problem = extracted.problem
        baseline = store_all(problem)
        held = sum(g.held_bytes for g in earlier)
        limit = self._graph_budget(baseline.peak, name, held)
        solver = self.solver if isinstance(self.solver, str) else "custom solver"
        log.info("remat %s: solving (%s, budget %s)", name, solver, format_bytes(limit))
        try:
            plan = solve(problem, limit, self.solver)
        except InfeasibleBudget as e:
            raise self._in_step_terms(e, name, held) from None
        fw, bw = rewrite(joint, extracted, plan, num_fwd_outputs)
        bw.meta["remat"] = name  # for ``runs.RunTracker``
        leaves, self.next_leaves = self.next_leaves, frozenset()
        record = GraphPlan(
            name,
            extracted,
            plan,
            baseline,
            limit,
            plan_seconds=time.perf_counter() - start,
            compile_id=compile_id,
            after=tuple(g.name for g in earlier),
            leaves=leaves,
            loss_inside=_starts_from_a_scalar(joint),
        )
        self._check_gradients_fit(record)
        self.graphs.append(record)
        log.info(
            "remat %s: %s (store-all %s, budget %s, planned in %.2fs)",
            name,
            plan,
            format_bytes(baseline.peak),
            format_bytes(limit),
            record.plan_seconds,
        )
        return fw, bw

    def _extract(self, joint: fx.GraphModule, num_fwd_outputs: int, name: str) -> Extracted:
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

    def _graph_budget(self, store_all_peak: int, name: str, held: int) -> int:
        """This graph's share of the budget: a fraction applies to its own store-all peak,
        bytes are what the ``held`` bytes of earlier graphs of the step leave."""
        value = parse_budget(self.budget)
        if isinstance(value, float):
            return resolve_budget(value, store_all_peak)
        if held >= value:
            raise ValueError(
                f"budget {format_bytes(value)} is used up before {name}: earlier graphs of the "
                f"step (graph breaks) save or return {format_bytes(held)}. Raise the budget or "
                "remove the graph breaks (torch._dynamo.explain shows them)."
            )
        return value - held

    def _earlier_in_step(self, compile_id: CompileId | None) -> list[GraphPlan]:
        """The graphs planned so far that run before this one in a step, holding what they
        saved or returned while it runs.

        dynamo numbers frames in the order a step first reaches them (the forward, then the
        code after each graph break) and compiles a frame again for new input shapes, so
        those graphs are the latest compile of each earlier frame, not every graph so far
        (a recompile is an alternative to the graph it replaces, not part of its step),
        and the graphs of this same compile planned before (DDP's optimizer splits one
        compile into a graph per gradient bucket). Graphs planned outside dynamo have no
        compile id: all of them count."""
        if compile_id is None:
            return list(self.graphs)
        frame = compile_id.frame_id
        latest = {}
        for g in self.graphs:  # in planning order: a later compile of a frame replaces
            if g.compile_id is not None and g.compile_id.frame_id < frame:
                latest[g.compile_id.frame_id] = g
        same = [g for g in self.graphs if g.compile_id == compile_id]
        return [latest[f] for f in sorted(latest)] + same

    def _check_gradients_fit(self, graph: GraphPlan) -> None:
        """The gradients ``graph``'s backward leaves in ``.grad`` stay allocated while the
        backwards of the earlier graphs of its step run, and those were planned before
        this graph was traced: refuse when that takes the step over an absolute budget."""
        value = parse_budget(self.budget)
        if isinstance(value, float) or not graph.leaves or not graph.after:
            return
        predicted = step_peak([*self.graphs, graph], lambda g: g.plan)
        if predicted > value:
            raise ValueError(
                f"budget {format_bytes(value)} cannot hold this step: the parameter gradients "
                f"{graph.name} leaves ({format_bytes(sum(b for _, b in graph.leaves))}) stay "
                f"allocated while the backward of {', '.join(graph.after)} runs, which was "
                f"planned before {graph.name} was traced (a graph break); the step would peak "
                f"at {format_bytes(predicted)} ({predicted} bytes). Remove the graph break "
                "(torch._dynamo.explain shows it) so remat plans the step as one, or raise "
                "the budget."
            )

    def warn_if_loss_outside(self, name: str) -> None:
        """After ``name``'s first backward: if no graph of the step computed the loss, code
        remat does not compile did (a loss computed on the model's outputs), and what it
        holds during the step is in no plan."""
        graph = next(g for g in self.graphs if g.name == name)
        if graph.loss_inside or any(name in g.after for g in self.graphs):
            return
        log.warning(
            "remat %s: its backward started from the gradient of a non-scalar output, so "
            "the loss was computed outside the compiled model (e.g. on the logits it "
            "returns): what that code holds during the step (a cross-entropy keeps a "
            "softmax the size of the logits) is not in remat's plan or predicted peak. "
            "Compute the loss inside forward to have it planned.",
            name,
        )

    def _in_step_terms(self, refusal: InfeasibleBudget, name: str, held: int) -> InfeasibleBudget:
        """A later graph's refusal, in the step's terms. An absolute budget: the budget,
        and the graph's minimum plus what earlier graphs hold (``_graph_budget`` took that
        off). A fraction: the same numbers, saying that it applies per graph."""
        value, r = parse_budget(self.budget), refusal
        if not held:
            return refusal
        if isinstance(value, float):
            note = (
                f"{name} runs after a graph break, and a fractional budget applies to each "
                "graph's own store-all peak: a graph that cannot shrink that far (a loss "
                "computed after a break) needs a larger fraction, an absolute budget, or the "
                "break removed (torch._dynamo.explain shows it)."
            )
            return InfeasibleBudget(r.budget, r.minimum, r.store_all, name, r.proven, note=note)
        return InfeasibleBudget(value, r.minimum + held, r.store_all + held, name, r.proven, held)

    def _cost_model(self, joint: fx.GraphModule) -> CostModel:
        device = _device_of(joint)
        model = CostModel(costs.DeviceSpec.for_device(device), device)
        if self.cost_model == "profile":
            model.measured.update(costs.profile_seconds(joint, device))
        return model


def step_peak(graphs: list[GraphPlan], plan_of) -> int:
    """The predicted peak of a step made of ``graphs`` (graph breaks), under the plans
    ``plan_of(graph)``: the largest, over graphs, of its own timeline plus

    - what the earlier graphs of its step hold (saved and returned, ``GraphPlan.after``),
      all through it;
    - during its backward, the gradients of the leaves of the later graphs (their
      backwards ran first: autograd keeps them in ``.grad``);
    - once its backward returns, the largest leaf it shares with a later graph: autograd
      adds the two gradients into a new tensor before it frees the old one.

    Over every input shape planned (each recompile is a step of its own)."""
    peak = 0
    for g in graphs:
        plan = plan_of(g)
        held = held_before(g, graphs, plan_of)
        later = set().union(*(h.leaves for h in graphs if g.name in h.after))
        grads = sum(b for _, b in later)
        shared = max((b for leaf, b in g.leaves if (leaf, b) in later), default=0)
        timeline = plan.timeline
        done = returned_bytes(g.extracted.problem) + grads + shared
        own = max(timeline.forward_peak, timeline.backward_peak + grads, done)
        peak = max(peak, held + own)
    return peak


def held_before(graph: GraphPlan, graphs: list[GraphPlan], plan_of) -> int:
    """What the earlier graphs of ``graph``'s step (``GraphPlan.after``, among ``graphs``)
    hold while it runs, under the plans ``plan_of(graph)``: saved and returned bytes."""
    earlier = (g for g in graphs if g.name in graph.after)
    return sum(held_bytes(g.extracted.problem, plan_of(g)) for g in earlier)


def _starts_from_a_scalar(joint: fx.GraphModule) -> bool:
    """Whether the backward is fed a scalar's gradient (the loss is computed in the graph)."""
    return any(is_root_tangent(n) for n in joint.graph.find_nodes(op="placeholder"))


def _refuse_symbolic_shapes(joint: fx.GraphModule, name: str) -> None:
    """remat plans a step at concrete sizes (bytes, times, the budget itself): a graph
    whose inputs have symbolic sizes is refused with what to do, not planned at one size
    and run at others."""
    symbols = set()
    for node in joint.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        sizes = val.shape if isinstance(val, torch.Tensor) else (val,)
        symbols |= {str(s) for s in sizes if isinstance(s, torch.SymInt)}
    if symbols:
        raise ValueError(
            f"remat plans a step at concrete shapes, but {name}'s inputs have symbolic sizes "
            f"({', '.join(sorted(symbols))}): torch.compile made the graph dynamic (it does "
            "so by itself when a second input shape arrives). Pass dynamic=False, as in "
            "torch.compile(model, backend=remat.backend(budget), dynamic=False) (remat.optimize "
            "does), so each input shape is planned on its own."
        )


def _device_of(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
