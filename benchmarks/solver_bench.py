"""Solvers side by side on large joint graphs: solve time, plan cost, bound and gap.

    python benchmarks/solver_bench.py --sizes 500,2000,10000 --gpt-layers 12 \\
        --budgets 0.7,0.5,0.3 --solvers greedy,cpsat --json out/solvers.json

Graphs: ``synthetic.layered`` transformer stacks of about ``--sizes`` nodes each (the
solver tests' graphs, ``tests/solvers/synthetic.py``, through ``_test_graphs.py``), and
(unless ``--gpt-layers 0``) the traced joint graph of the built-in ``gpt`` example with
that many layers, at its default sizes or those ``--gpt-size key=value`` gives (e.g.
GPT-2 small's: ``d_model=768 heads=12 seq=1024 vocab=50257``). Budgets are fractions
of each graph's store-all peak. ``cost`` is the plan's (``Plan.cost``: recompute plus
save seconds; the synthetic graphs' save costs are 0). The greedy runs first for every
graph and budget: ``overhead`` is ``(cost - greedy cost) / greedy cost``. Every plan is
re-scheduled and re-simulated here and must peak within its budget.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from _output import write_rows
from _test_graphs import layered
from tabulate import tabulate

from remat.solvers import (
    SOLVERS,
    InfeasibleBudget,
    Problem,
    format_bytes,
    schedule,
    simulate,
    solve,
    store_all,
)
from remat.solvers.cpsat import cpsat

NODES_PER_LAYER = 44  # len(layered(k)) == 44 * k + 5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def graphs(sizes: list[int], gpt_layers: int, gpt_sizes: dict) -> list[tuple[str, Problem]]:
    out = []
    for size in sizes:
        problem = layered(max(1, round((size - 5) / NODES_PER_LAYER)))
        out.append((problem.name, problem))
    if gpt_layers:
        import remat  # torch: only when the GPT graph is wanted
        from remat.tools import examples

        start = time.perf_counter()
        model, inputs = examples.load("gpt", layers=gpt_layers, **gpt_sizes)
        report = remat.plan(model, inputs, budget=1.0, solver="store-all")
        label = f"gpt{gpt_layers}" + "".join(f",{k}={v}" for k, v in gpt_sizes.items())
        for g in report.graphs:
            name = label + (f"/{g.name}" if len(report.graphs) > 1 else "")
            out.append((name, g.extracted.problem))
        log(f"gpt{gpt_layers}: traced and extracted in {time.perf_counter() - start:.1f}s")
    return out


def solver(name: str, time_limit: float | None):
    """A name ``solve`` accepts, or for cpsat a callable carrying the time limit."""
    if name == "cpsat":
        return functools.partial(cpsat, time_limit=time_limit)
    if name not in SOLVERS:
        raise SystemExit(f"unknown solver {name!r}; choose from {sorted(SOLVERS)}")
    return name


def run(problem: Problem, budget: int, name: str, fn) -> dict:
    start = time.perf_counter()
    try:
        plan = solve(problem, budget, solver=fn)
    except InfeasibleBudget as e:
        seconds = time.perf_counter() - start
        return dict(seconds=seconds, status="infeasible", minimum=e.minimum)
    seconds = time.perf_counter() - start
    peak = simulate(problem, schedule(problem, plan.saved)).peak
    status = plan.status
    if peak != plan.peak or peak > budget:
        status = f"INVALID (simulated peak {peak}, plan says {plan.peak})"
    return dict(
        seconds=seconds,
        status=status,
        cost=plan.cost,
        bound=plan.bound,
        gap=plan.gap,
        peak=plan.peak / budget,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="500,2000,10000", help="approximate node counts")
    parser.add_argument("--gpt-layers", type=int, default=12, help="0 skips the GPT graph")
    parser.add_argument(
        "--gpt-size",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="a size of the gpt example (repeatable), e.g. d_model=768",
    )
    parser.add_argument("--budgets", default="0.7,0.5,0.3", help="fractions of store-all")
    parser.add_argument("--solvers", default="greedy,cpsat")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="cpsat, in its deterministic seconds, all it may spend (default: cpsat's own, "
        "default_time_limit: 2, or nodes / 2,000 beyond 4,000 nodes, and up to EXTRA_LIMIT "
        "more where its plan is not proven within 1%% by then)",
    )
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    sizes = [int(s) for s in args.sizes.split(",") if s]
    try:
        gpt_sizes = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.gpt_size)}
    except ValueError:
        parser.error(f"--gpt-size takes KEY=INT, got {args.gpt_size}")
    budgets = [float(b) for b in args.budgets.split(",")]
    names = ["greedy"] + [s for s in args.solvers.split(",") if s and s != "greedy"]
    fns = {name: solver(name, args.time_limit) for name in names}

    rows = []
    for graph, problem in graphs(sizes, args.gpt_layers, gpt_sizes):
        full = store_all(problem).peak
        log(f"{graph}: {len(problem)} nodes, store-all peak {format_bytes(full)}")
        for fraction in budgets:
            budget = int(fraction * full)
            reference = None
            for name in names:
                result = run(problem, budget, name, fns[name])
                if name == "greedy":
                    reference = result.get("cost")
                cost = result.get("cost")
                overhead = None
                if cost is not None and reference is not None:
                    overhead = (cost - reference) / reference if reference else float(cost > 0)
                row = dict(
                    graph=graph,
                    nodes=len(problem),
                    fwd_nodes=len(problem.forward_nodes),
                    budget=fraction,
                    budget_bytes=budget,
                    solver=name,
                    status=result["status"],
                    seconds=result["seconds"],
                    cost=cost,
                    bound=result.get("bound"),
                    gap=result.get("gap"),
                    peak=result.get("peak"),
                    overhead=overhead,
                    minimum=result.get("minimum"),
                )
                rows.append(row)
                log(
                    f"  {fraction:g} {name}: {row['status']} in {row['seconds']:.2f}s"
                    + ("" if cost is None else f", cost {cost:.4g}")
                )

    print(tabulate([display(r) for r in rows], headers="keys", tablefmt="github"))
    write_rows(rows, args.json, args.csv)
    return 1 if any(r["status"].startswith("INVALID") for r in rows) else 0


def display(row: dict) -> dict:
    def pct(v, sign=""):
        return "-" if v is None else f"{v:{sign}.1%}"

    def num(v):
        return "-" if v is None else f"{v:.4g}"

    out = dict(row)
    out["budget_bytes"] = format_bytes(row["budget_bytes"])
    out["seconds"] = f"{row['seconds']:.2f}"
    out["cost"], out["bound"] = num(row["cost"]), num(row["bound"])
    out["gap"], out["peak"] = pct(row["gap"]), pct(row["peak"])
    out["overhead"] = pct(row["overhead"], "+")
    out["minimum"] = "-" if row["minimum"] is None else format_bytes(row["minimum"])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
