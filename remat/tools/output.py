"""What the ``remat`` commands print about a model: the joint graph (``inspect``), a plan
and its values by module (``plan``, ``train``), a training comparison (``train``), and the
graphs as DOT."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from remat.candidates import TORCH_CANDIDATE, fraction_reference
from remat.report import uncalibrated
from remat.solvers import format_bytes
from remat.values import TOP_LEVEL, module_paths, recomputed

__all__ = [
    "INSPECT_COLUMNS",
    "dot",
    "format_seconds",
    "inspect_table",
    "plan_table",
    "time_ratio_line",
    "time_spread",
    "train_table",
    "values_table",
]

INSPECT_COLUMNS = (
    "#",
    "name",
    "op",
    "shape",
    "dtype",
    "bytes",
    "est. time",
    "phase",
    "recomputable",
    "view of",
)


def inspect_table(
    g, index: int, count: int, *, sort: str = "order", limit: int | None = None
) -> str:
    """One graph of ``remat inspect``: heading, node table, summary line."""
    problem, fx_nodes = g.extracted.problem, g.extracted.fx_nodes
    nodes = problem.nodes
    order = list(range(len(nodes)))
    if sort == "bytes":
        order.sort(key=lambda i: -nodes[i].bytes)
    elif sort == "time":
        order.sort(key=lambda i: -nodes[i].cost)
    shown = order if limit is None else order[:limit]
    # Scratch memory of kernels (convolutions): a column only where some node has any.
    workspace = any(getattr(n, "workspace", 0) for n in nodes)
    rows = []
    for i in shown:
        node, fx_node = nodes[i], fx_nodes[i]
        shape, dtype = _shape_dtype(fx_node.meta.get("val"))
        row = [
            i,
            node.name,
            _op_label(node, fx_node, nodes),
            shape,
            dtype,
            format_bytes(node.bytes),
            format_seconds(node.cost),
            node.phase,
            "yes" if node.recomputable else "no",
            nodes[node.alias_of].name if node.alias_of is not None else "",
        ]
        if workspace:
            row.append(format_bytes(node.workspace) if node.workspace else "")
        rows.append(row)
    headers = INSPECT_COLUMNS + (("workspace",) if workspace else ())
    n_fwd = sum(1 for n in nodes if n.phase == "fwd")
    act = sum(n.bytes for n in nodes if n.phase == "fwd")
    heading = f"{g.name} (graph {index + 1} of {count}, sorted by {sort})"
    summary = (
        f"{g.name}: {len(nodes)} nodes ({n_fwd} fwd, {len(nodes) - n_fwd} bwd), "
        f"activation bytes {format_bytes(act)} ({act} B, all forward values), "
        f"resident {format_bytes(problem.resident_bytes)} (parameters and inputs), "
        f"store-all peak {format_bytes(g.store_all.peak)}"
    )
    if len(shown) < len(nodes):
        summary += f"; showing {len(shown)} of {len(nodes)} rows"
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    return f"{heading}\n{table}\n{summary}"


def _op_label(node, fx_node, nodes) -> str:
    if node.output_of is not None and len(fx_node.args) > 1:
        return f"{nodes[node.output_of].name}[{fx_node.args[1]}]"
    return node.op.removesuffix(".default")


def _shape_dtype(val: Any) -> tuple[str, str]:
    import torch

    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(str(d) for d in val.shape) + "]", str(val.dtype).removeprefix(
            "torch."
        )
    if isinstance(val, (tuple, list)):
        parts = [_shape_dtype(v) for v in val]
        dtypes = sorted({d for _, d in parts if d})
        return "(" + ", ".join(s or "-" for s, _ in parts) + ")", "/".join(dtypes)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "", type(val).__name__
    return "", ""


def format_seconds(s: float) -> str:
    """Seconds in the unit that reads best: '7.6 µs', '12.3 ms', '1.20 s'."""
    if s == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def plan_table(report, budget: str) -> str:
    """``remat plan``'s output: one column per graph, then a summary line."""
    if not report.graphs:
        return "no graph was compiled (does the model's forward run any torch op?)"
    metrics: list[tuple[str, Callable]] = [
        ("nodes", lambda g: len(g.extracted.problem)),
        ("budget", lambda g: format_bytes(g.limit)),
        ("saved values", lambda g: len(g.plan.saved)),
        ("saved bytes", lambda g: format_bytes(g.saved_bytes)),
        ("recomputed values", lambda g: len(recomputed(g.plan))),
        ("recomputed bytes", lambda g: format_bytes(_recomputed_bytes(g))),
        ("predicted peak", lambda g: format_bytes(g.plan.peak)),
        ("store-all peak", lambda g: format_bytes(g.store_all.peak)),
        ("peak / store-all", lambda g: f"{g.plan.peak / max(g.store_all.peak, 1):.1%}"),
        ("recompute (est.)", lambda g: format_seconds(g.plan.recompute_cost)),
        ("recompute overhead", lambda g: f"+{_overhead(g):.1%} of forward"),
        ("save cost (est.)", lambda g: format_seconds(g.plan.save_cost)),
        ("step time (est.)", lambda g: format_seconds(g.step_seconds) + uncalibrated(g)),
        ("solver", lambda g: g.plan.solver),
        ("status", lambda g: g.plan.status),
        ("lower bound", lambda g: "-" if g.plan.bound is None else format_seconds(g.plan.bound)),
        ("plan space", lambda g: _space(g.plan)),
        ("gap", lambda g: "-" if g.plan.gap is None else f"{g.plan.gap:.1%}"),
        ("solve time", lambda g: f"{g.plan.solve_seconds:.3f} s"),
        ("plan time", lambda g: f"{g.plan_seconds:.3f} s"),
    ]
    rows = [(label, *(str(f(g)) for g in report.graphs)) for label, f in metrics]
    headers = ("", *(g.name for g in report.graphs))
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    predicted, store_all = report.predicted_peak, report.store_all_peak
    summary = (
        f"budget {budget}: predicted peak {format_bytes(predicted)} ({predicted} B), "
        f"{predicted / max(store_all, 1):.1%} of the store-all peak {format_bytes(store_all)} "
        f"({store_all} B)"
    )
    if len(report.graphs) > 1:
        summary += f"; {len(report.graphs)} graphs (graph breaks), planned one after another"
    return f"{table}\n{summary}"


def _space(plan) -> str:
    """Which plans a solver chose among: a CP-SAT bound and gap hold over single ones."""
    return "multiple recomputation" if plan.multiple else "single recomputation"


def _recomputed_bytes(g) -> int:
    problem = g.extracted.problem
    return sum(problem.nodes[i].bytes for i in recomputed(g.plan))


def values_table(report) -> str:
    """``remat plan --values``: each value the plans that run save or recompute, as
    ``module: op``, in execution order, with a count per plan."""
    values = report.values()
    if not values:
        return "no value is saved or recomputed"
    rows = [
        (f"{v.module or TOP_LEVEL}: {v.op}", v.kind, format_bytes(v.bytes), v.graph, v.name)
        for v in values
    ]
    headers = ("value (module: op)", "plan", "bytes", "graph", "fx node")
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    counts = {
        kind: (sum(v.kind == kind for v in values), sum(v.bytes for v in values if v.kind == kind))
        for kind in ("saved", "recomputed")
    }
    where = "the step's joint plan" if report.steps else "each graph's plan"
    summary = (
        f"values of {where}: "
        + ", ".join(f"{n} {kind} ({format_bytes(b)})" for kind, (n, b) in counts.items())
        + "; a view has 0 bytes (it keeps its base's storage)"
    )
    return f"{table}\n{summary}"


def _overhead(g) -> float:
    """Recompute cost as a fraction of the forward's estimated time (as ``PlanReport``)."""
    problem = g.extracted.problem
    fwd_cost = sum(problem.nodes[i].cost for i in g.store_all.schedule.forward)
    return g.plan.recompute_cost / max(fwd_cost, 1e-12)


def reference(g) -> str:
    """What a fraction of the budget was of for graph ``g`` (``fraction_reference``, or
    the module's eager step where that is lower: ``GraphPlan.eager_peak``), named, with
    its peak."""
    plan = fraction_reference(g.store_all, g.yours, g.theirs)
    if g.eager_peak is not None and g.eager_peak < plan.peak:
        return f"your module's eager step {format_bytes(g.eager_peak)}"
    name = {TORCH_CANDIDATE: "torch's partition"}.get(plan.solver, plan.solver)
    return f"{name} {format_bytes(plan.peak)}"


def train_table(args, report, peaks, times, losses) -> str:
    budgets = sorted({g.limit for g in report.graphs})
    budget = args.budget
    if len(budgets) == 1:
        of = f" of {reference(report.graphs[0])}" if args.budget.fraction is not None else ""
        budget = f"{args.budget}{of} = {format_bytes(budgets[0])}"
    rows = [
        (
            "peak memory (measured, fwd+bwd)",
            format_bytes(peaks["eager"]),
            format_bytes(peaks["remat"]),
        ),
        (
            "predicted peak",
            f"{format_bytes(report.store_all_peak)} (store-all)",
            format_bytes(report.predicted_peak),
        ),
        ("budget", "-", budget),
        (
            f"step time (median of {args.repeat}, min-max)",
            time_spread(times["eager"]),
            time_spread(times["remat"]),
        ),
    ]
    for i, (a, b) in enumerate(zip(losses["eager"], losses["remat"], strict=True)):
        rows.append((f"loss step {i + 1}", f"{a:.6f}", f"{b:.6f}"))
    return tabulate(rows, headers=("", "eager", "remat"), tablefmt="simple", disable_numparse=True)


def time_spread(times: list[float]) -> str:
    """The median of timed rounds with their range: '12.3 ms (11.9 ms - 13.0 ms)'."""
    median = statistics.median(times)
    return f"{format_seconds(median)} ({format_seconds(min(times))} - {format_seconds(max(times))})"


def time_ratio_line(times: dict[str, list[float]]) -> str:
    """remat's step time over eager's, round by round (each round timed one step of
    each): the median ratio and its range, the spread a single number hides."""
    ratios = [r / max(e, 1e-12) for r, e in zip(times["remat"], times["eager"], strict=True)]
    median = statistics.median(ratios)
    return (
        f"step time: remat {median:.2f}x eager's (median over {len(ratios)} rounds, "
        f"{min(ratios):.2f}x - {max(ratios):.2f}x)"
    )


# Fill colours of ``dot``: what a plan does with each forward value.
_DOT_FILL = {"saved": "#9ecae1", "recomputed": "#fdae6b", "fwd": "#ffffff", "bwd": "#d9d9d9"}
# What each fill means, in the legend every DOT file carries (with a plan / without)
_DOT_MEANING = {
    "saved": "saved: kept from the forward for the backward",
    "recomputed": "recomputed: run again in the backward",
    "fwd": "forward value",
    "bwd": "backward value (reads the loss gradient)",
}
_DOT_PLAN_FWD = "forward value not kept (freed in the forward, or computed once in the backward)"


def dot(graphs, *, with_plan: bool = False) -> str:
    """The joint graphs as Graphviz DOT, one cluster per graph: a box per value (name, op,
    bytes, module path) and an edge per read, with a legend. ``with_plan`` fills each
    graph's saved values blue and its recomputed ones orange (backward values grey, the
    rest white)."""
    lines = ["digraph remat {", "  rankdir=TB;", "  node [shape=box, style=filled, fontsize=9];"]
    for k, g in enumerate(graphs):
        problem, plan, fx_nodes = g.extracted.problem, g.plan, g.extracted.fx_nodes
        again = recomputed(plan)
        paths = module_paths(fx_nodes[0].graph.nodes) if fx_nodes else {}
        lines += [f"  subgraph cluster_{k} {{", f'    label="{_dot_text(g.name)}";']
        for i, node in enumerate(problem.nodes):
            role = node.phase
            if with_plan and i in plan.saved:
                role = "saved"
            elif with_plan and i in again:
                role = "recomputed"
            op = node.op.removesuffix(".default")
            module = paths.get(fx_nodes[i]) or TOP_LEVEL
            label = _dot_text(f"{node.name}\\n{op}\\n{format_bytes(node.bytes)}\\n{module}")
            lines.append(f'    g{k}n{i} [label="{label}", fillcolor="{_DOT_FILL[role]}"];')
        for i, node in enumerate(problem.nodes):
            lines += [f"    g{k}n{j} -> g{k}n{i};" for j in node.inputs]
        lines.append("  }")
    lines += _dot_legend(with_plan)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_legend(with_plan: bool) -> list[str]:
    """A cluster explaining the fills, the box's lines and the edges."""
    roles = ("saved", "recomputed", "fwd", "bwd") if with_plan else ("fwd", "bwd")
    meaning = {**_DOT_MEANING, **({"fwd": _DOT_PLAN_FWD} if with_plan else {})}
    lines = ["  subgraph cluster_legend {", '    label="legend";']
    for role in roles:
        text = _dot_text(meaning[role])
        lines.append(f'    legend_{role} [label="{text}", fillcolor="{_DOT_FILL[role]}"];')
    box = "a box: fx node name, op, bytes it allocates (0: a view), module path"
    lines += [
        f'    legend_box [label="{box}", shape=plaintext, style=""];',
        '    legend_reader [label="an edge points from a value to a node that reads it", '
        'shape=plaintext, style=""];',
        "  }",
    ]
    return lines


def _dot_text(text: str) -> str:
    return text.replace('"', '\\"')
