"""Where the step-time estimate meets the clock and where it misses: one model trained in a
process of its own, its measured steps against the estimate, and per aten op the time
the profiler measured in those steps against what the cost model charged for it.

    python benchmarks/step_time.py [MODEL] [--size KEY=VALUE ...] [--budgets 1.0,0.5]
        [--threads 1] [--steps 5] [--ops 12] [--json out/step_time.json]

Per budget: a fresh ``remat.optimize`` (plan cache off), two warm-up steps, then
``--steps`` timed steps under ``torch.profiler`` (one row: their median and the
estimate), and the ``--ops`` aten ops with the most time, measured (self CPU time per
step) or estimated, one row each. An op the graph holds under another name than the one
the profiler sees is listed under each: remat's ``dropout_mask`` runs ``bernoulli_``,
``apply_dropout_mask`` a ``copy_`` and two ``mul_``, ``native_dropout_backward`` a ``mul``.
Results: docs/cost-model.md, "The estimate against the clock".
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import finished, shown, step_parser, warmed_up  # noqa: E402


def op_name(target) -> str:
    """An fx node's op as the profiler names it, without the overload."""
    return str(getattr(target, "__name__", target)).split(".")[0]


def estimated_by_op(graph) -> collections.Counter:
    """Seconds the cost model charges each op for one step under the graph's plan: every
    node once, each recompute again."""
    charged = collections.Counter()
    nodes, fx_nodes = graph.extracted.problem.nodes, graph.extracted.fx_nodes
    for node, fx_node in zip(nodes, fx_nodes, strict=True):
        charged[op_name(fx_node.target)] += node.cost
    for i in graph.plan.recomputed:
        charged[op_name(fx_nodes[i].target)] += nodes[i].cost
    return charged


def measure(model_spec: str, size: dict, budget: float, steps: int) -> tuple[dict, dict]:
    """(the step row, per-op measured and estimated seconds) of one budget."""
    model, inputs, optimized = warmed_up(model_spec, size, budget)
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            optimized(*inputs).backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    measured = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            measured[event.key.removeprefix("aten::")] += event.self_cpu_time_total / 1e6 / steps
    graphs = optimized.remat.report().graphs
    estimate = sum(g.step_seconds for g in graphs)
    charged = sum((estimated_by_op(g) for g in graphs), collections.Counter())
    step = statistics.median(times)
    row = {
        "budget": budget,
        "op": "(whole step)",
        "measured_s": step,
        "estimated_s": estimate,
        "error": estimate / step - 1,
        "figures": graphs[0].figures,
    }
    return row, {"measured": measured, "estimated": charged}


def main(argv=None) -> int:
    parser = step_parser(__doc__, "gpt", "1.0,0.5", 5)
    parser.add_argument("--ops", type=int, default=12, help="ops listed per budget")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = dict(args.size)
    rows: list[dict] = []
    for budget in (float(b) for b in args.budgets.split(",")):
        step, ops = measure(args.model, size, budget, args.steps)
        shown(rows, step)
        measured, estimated = ops["measured"], ops["estimated"]
        top = sorted(set(measured) | set(estimated), key=lambda k: -max(measured[k], estimated[k]))
        for name in top[: args.ops]:
            row = {"budget": budget, "op": name, "measured_s": measured[name]}
            shown(rows, {**row, "estimated_s": estimated[name]})
    finished(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
