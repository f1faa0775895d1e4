"""What remat decided for a model, as numbers and as a table: ``PlanReport``."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from tabulate import tabulate

from remat.candidates import YOURS
from remat.planner import GraphPlan
from remat.runtime import StepPlan
from remat.solvers import Plan, format_bytes


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
                    "step (est.)": f"{g.step_seconds:.3g}s",
                    "solver": solver_label(p),
                    **({"your checkpointing": _yours(g)} if checkpointed else {}),
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
