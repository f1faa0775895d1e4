"""What remat decided for a model, as numbers (``to_dict``), as a table, and value by value
(``values``): ``PlanReport``."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from tabulate import tabulate

from remat.candidates import YOURS
from remat.compiled import GraphPlan
from remat.runtime import StepPlan
from remat.solvers import Plan, format_bytes, store_all
from remat.timeline import StepTimeline
from remat.values import Value, graph_values, recomputed, step_values


@dataclass(frozen=True)
class PlanReport:
    """Plans of every graph of a model (as compiled, for its first step) and of every
    step planned as one, printable as a table."""

    graphs: tuple[GraphPlan, ...]
    steps: tuple[StepPlan, ...] = ()

    @property
    def predicted_peak(self) -> int:
        """The predicted peak of a step from the second on: its joint plan's, the largest
        over every kind of step planned (each input shape is one). Before a step ended,
        the largest graph's own."""
        if self.steps:
            return max(s.plan.peak for s in self.steps)
        return max(g.plan.peak for g in self.graphs)

    @property
    def first_step_peak(self) -> int:
        """What the first step (each graph under its compile-time plan, the step recorded)
        peaks at, predicted with what the code between the graphs was measured to hold."""
        return max(s.first_peak for s in self.steps)

    @property
    def store_all_peak(self) -> int:
        if self.steps:
            return max(s.store_all_peak for s in self.steps)
        return max(g.store_all.peak for g in self.graphs)

    def values(self) -> list[Value]:
        """What the plans that run save and recompute, each value named by module path and
        op: the joint plan of each step planned as one, else each graph's own."""
        if self.steps:
            return [v for s in self.steps for v in self._step_values(s)]
        return [v for g in self.graphs for v in _graph_values(g)]

    def to_dict(self) -> dict:
        """The report as numbers, for JSON: bytes as ints, seconds as floats, a fraction
        as a float in [0, 1]; a graph's ``values`` are its compile-time plan's, a step's
        its joint plan's (what runs from the second step on)."""
        steps = [_step_dict(s, self._step_values(s)) for s in self.steps]
        return {
            "predicted_peak_bytes": self.predicted_peak if self.graphs else None,
            "first_step_peak_bytes": self.first_step_peak if self.steps else None,
            "store_all_peak_bytes": self.store_all_peak if self.graphs else None,
            "graphs": [_graph_dict(g) for g in self.graphs],
            "steps": steps,
        }

    def timeline(self) -> StepTimeline:
        """The predicted memory over time of the step ``predicted_peak`` is the peak of
        (before a step ended, of the graph with the highest peak), against storing
        everything."""
        if self.steps:
            s = max(self.steps, key=lambda s: s.plan.peak)
            everything = store_all(s.composed.problem)
            return StepTimeline.of(s.composed.problem.name, s.limit, s.plan, everything)
        g = max(self.graphs, key=lambda g: g.plan.peak)
        return StepTimeline.of(g.name, g.limit, g.plan, g.store_all)

    def _step_values(self, step: StepPlan) -> list[Value]:
        fx_nodes = {g.name: g.extracted.fx_nodes for g in self.graphs}
        return step_values(step.graphs, step.composed, step.plan, fx_nodes)

    def step_rows(self) -> list[dict]:
        return [
            {
                "step": ", ".join(s.graphs),
                "budget": format_bytes(s.limit),
                "predicted peak": format_bytes(s.plan.peak),
                "first step": format_bytes(s.first_peak),
                "store-all peak": format_bytes(s.store_all_peak),
                "solver": solver_label(s.plan),
            }
            for s in self.steps
        ]

    def rows(self) -> list[dict]:
        out = []
        symbolic = any(g.binding for g in self.graphs)
        checkpointed = any(g.yours for g in self.graphs)
        eager = any(g.as_given for g in self.graphs)
        for g in self.graphs:
            p, problem = g.plan, g.extracted.problem
            fwd_cost = sum(problem.nodes[i].cost for i in g.store_all.schedule.forward)
            sizes = {"sizes": ", ".join(f"{s}={v}" for s, v in g.binding) or "-"}
            out.append(
                {
                    "graph": g.name,
                    **(sizes if symbolic else {}),
                    "compile": "-" if g.compile_id is None else str(g.compile_id),
                    "nodes": len(problem),
                    "saved": len(p.saved),
                    "saved bytes": format_bytes(g.saved_bytes),
                    "recomputed": len(p.recomputed),
                    "budget": format_bytes(g.limit),
                    "predicted peak": format_bytes(p.peak),
                    "store-all peak": format_bytes(g.store_all.peak),
                    "recompute": f"+{p.recompute_cost / max(fwd_cost, 1e-12):.1%} fwd",
                    "step (est.)": f"{g.step_seconds:.3g}s{uncalibrated(g)}",
                    "solver": solver_label(p),
                    **({"your checkpointing": _yours(g)} if checkpointed else {}),
                    **({"eager step": _eager(g)} if eager else {}),
                    "plan time": f"{g.plan_seconds:.2f}s",
                }
            )
        return out

    def __str__(self) -> str:
        if not self.graphs:
            return "PlanReport(no graph compiled yet: call the model once)"
        graphs = tabulate(self.rows(), headers="keys", tablefmt="simple")
        if not self.steps:
            return graphs + "\n(no step has ended yet: the step is planned as one after the first)"
        steps = tabulate(self.step_rows(), headers="keys", tablefmt="simple")
        why = "\n" + textwrap.fill(ROWS_DIFFER, 100) if self._rows_differ() else ""
        return graphs + "\n\n" + steps + why

    def _rows_differ(self) -> bool:
        """Whether a step row's budget or store-all peak is not its graph row's."""
        by_name = {g.name: g for g in self.graphs}
        for s in self.steps:
            graph = by_name.get(s.graphs[0])
            if len(s.graphs) > 1 or graph is None:
                return True
            if (s.limit, s.store_all_peak) != (graph.limit, graph.store_all.peak):
                return True
        return False


# Said under the tables where a step row's budget or store-all peak is not its graph row's.
ROWS_DIFFER = (
    "Graph rows: each graph's plan for the first step, made as it compiled, before the rest "
    "of the step was known: its budget is its share (less what earlier graphs of the step "
    "hold and room for the code after it), its store-all peak its own. Step rows: the "
    "step's graphs planned together with the code run between them, which every later "
    "step runs: their budget and store-all peak are the whole step's."
)


def solver_label(plan: Plan) -> str:
    """Who made ``plan`` and how sure it is: ``cpsat (feasible, gap 0.4% over ...)``."""
    gap = "" if plan.gap is None else f", gap {plan.gap:.1%} over single recomputation"
    multiple = ", multiple recomputation" if plan.multiple else ""
    return f"{plan.solver} ({plan.status}{gap}{multiple})"


def _yours(g: GraphPlan) -> str:
    """What became of the user's own checkpointing in graph ``g``: its plan's peak, and
    kept, or replaced by a plan that costs less, or by one under a budget it exceeds."""
    y = g.yours
    if y is None:
        return "-"
    if g.plan.solver == YOURS:
        verdict = "kept"
    elif y.peak > g.limit:
        verdict = "over the budget: replaced"
    else:
        verdict = f"replaced by a plan {1 - g.plan.cost / max(y.cost, 1e-12):.0%} cheaper"
    return f"peak {format_bytes(y.peak)}, {verdict}"


def _eager(g: GraphPlan) -> str:
    """The peak of the graph's step with the module run eagerly in its place, where its
    eager step was run under fake tensors (``remat.as_given``)."""
    return "-" if g.eager_peak is None else format_bytes(g.eager_peak)


def _graph_values(g: GraphPlan) -> list[Value]:
    return graph_values(g.name, g.extracted.problem, g.extracted.fx_nodes, g.plan)


def _plan_numbers(plan: Plan) -> dict:
    """Who made ``plan`` and how sure it is, as numbers."""
    return {
        "solver": plan.solver,
        "status": plan.status,
        "recompute_seconds": plan.recompute_cost,
        "save_seconds": plan.save_cost,
        "bound_seconds": plan.bound,
        "gap": plan.gap,
        "multiple_recomputation": plan.multiple,
        "solve_seconds": plan.solve_seconds,
    }


def uncalibrated(g: GraphPlan) -> str:
    """A mark on a time estimate from the datasheet's figures (``REMAT_CALIBRATE=0``),
    which can be 2x off on a CPU (docs/cost-model.md, "Calibration")."""
    return "" if g.figures == "calibrated" else " (datasheet)"


def _graph_dict(g: GraphPlan) -> dict:
    p, problem = g.plan, g.extracted.problem
    forward_seconds = sum(problem.nodes[i].cost for i in g.store_all.schedule.forward)
    again = recomputed(p)
    return {
        "name": g.name,
        "compile_id": None if g.compile_id is None else str(g.compile_id),
        "sizes": dict(g.binding),
        "nodes": len(problem),
        "limit_bytes": g.limit,
        "predicted_peak_bytes": p.peak,
        "store_all_peak_bytes": g.store_all.peak,
        "eager_step_peak_bytes": g.eager_peak,
        "saved_values": len(p.saved),
        "saved_bytes": g.saved_bytes,
        "recomputed_values": len(again),
        "recomputed_bytes": sum(problem.nodes[i].bytes for i in again),
        "recompute_overhead": p.recompute_cost / max(forward_seconds, 1e-12),
        "step_seconds": g.step_seconds,
        "step_seconds_figures": g.figures,
        "plan_seconds": g.plan_seconds,
        **_plan_numbers(p),
        "values": [v.to_dict() for v in _graph_values(g)],
    }


def _step_dict(s: StepPlan, values: list[Value]) -> dict:
    return {
        "graphs": list(s.graphs),
        "limit_bytes": s.limit,
        "predicted_peak_bytes": s.plan.peak,
        "first_step_peak_bytes": s.first_peak,
        "store_all_peak_bytes": s.store_all_peak,
        **_plan_numbers(s.plan),
        "values": [v.to_dict() for v in values],
    }
