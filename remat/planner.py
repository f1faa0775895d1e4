"""The partitioner remat plugs into AOTAutograd: joint graph -> plan -> fw/bw modules.

One ``Planner`` serves one compiled model. It plans every joint graph dynamo
hands it (one per graph break) and keeps the plans, so a user can look at
what was decided and a test can check the prediction against a measurement.

Budget across graph breaks: graphs are compiled in forward order, and the
values an earlier graph saves stay allocated while later graphs run. An
absolute budget therefore shrinks, for each graph, by the bytes the graphs
compiled before it save; a fractional budget applies to each graph's own
store-all peak.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import fx

from remat import costs
from remat.passes._torch_compat import real_tensors
from remat.passes.clones import drop_identity_clones
from remat.passes.extract import Extracted, extract
from remat.passes.rewrite import rewrite
from remat.passes.rng import replay_dropouts
from remat.solvers import (
    InfeasibleBudget,
    Plan,
    format_bytes,
    held_bytes,
    parse_budget,
    resolve_budget,
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
    _kernels: dict = field(default_factory=dict)  # costs.kernel_memory's cache

    def allocated_bytes(self, node: fx.Node) -> int:
        """The fake tensors' sizes, or the measured storage where a single output's is
        larger (``costs.KernelMemory``); never less, so the budget stays safe."""
        nominal = costs.allocated_bytes(node)
        if nominal == 0 or isinstance(node.meta.get("val"), (list, tuple)):
            return nominal  # aliases, views, multi-output ops (their parts own the bytes)
        measured = costs.kernel_memory(node, self.device, self._kernels)
        return nominal if measured is None else max(nominal, measured.storage)

    def aliased_input(self, node: fx.Node) -> fx.Node | None:
        return costs.aliased_input(node)

    def seconds(self, node: fx.Node) -> float:
        if node.name in self.measured:
            return self.measured[node.name]
        return costs.estimate_seconds(node, self.spec)

    def workspace(self, node: fx.Node) -> int:
        measured = costs.kernel_memory(node, self.device, self._kernels)
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

    def __call__(
        self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_ignored
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        start = time.perf_counter()
        name = f"graph{len(self.graphs)}"
        dropped = drop_identity_clones(joint)  # e.g. dropout(p=0): eager has no such copy
        replayed = replay_dropouts(joint)  # dropout becomes recomputable (mask replayed)
        log.debug(
            "remat %s: %d identity clones dropped, %d dropouts replayed", name, dropped, replayed
        )
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
            extracted = extract(joint, num_fwd_outputs, facts, name=name)
        problem = extracted.problem
        baseline = store_all(problem)
        limit = self._graph_budget(baseline.peak, name)
        try:
            plan = solve(problem, limit, self.solver)
        except InfeasibleBudget as e:
            raise self._in_step_terms(e, name) from None
        fw, bw = rewrite(joint, extracted, plan, num_fwd_outputs)
        record = GraphPlan(name, extracted, plan, baseline, limit, time.perf_counter() - start)
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

    def _graph_budget(self, store_all_peak: int, name: str) -> int:
        value = parse_budget(self.budget)
        if isinstance(value, float):
            return resolve_budget(value, store_all_peak)
        held = self._held_by_earlier_graphs()
        if held >= value:
            raise ValueError(
                f"budget {format_bytes(value)} is used up before {name}: earlier graphs of the "
                f"step (graph breaks) save or return {format_bytes(held)}. Raise the budget or "
                "remove the graph breaks (torch._dynamo.explain shows them)."
            )
        return value - held

    def _held_by_earlier_graphs(self) -> int:
        """Bytes the graphs planned so far hold while the next one runs."""
        return sum(g.held_bytes for g in self.graphs)

    def _in_step_terms(self, refusal: InfeasibleBudget, name: str) -> InfeasibleBudget:
        """An absolute budget's refusal for a later graph, in the step's bytes: the
        budget, and the graph's minimum plus what earlier graphs hold (``_graph_budget``
        took that off)."""
        value = parse_budget(self.budget)
        held = self._held_by_earlier_graphs()
        if isinstance(value, float) or not held:
            return refusal
        r = refusal
        return InfeasibleBudget(value, r.minimum + held, r.store_all + held, name, r.proven, held)

    def _cost_model(self, joint: fx.GraphModule) -> CostModel:
        device = _device_of(joint)
        model = CostModel(costs.DeviceSpec.for_device(device), device)
        if self.cost_model == "profile":
            model.measured.update(costs.profile_seconds(joint, device))
        return model


def _device_of(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
