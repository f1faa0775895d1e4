"""Budget -> predicted peak, measured peak and step time, against eager, for one example.

    python benchmarks/budget_sweep.py gpt --budgets 1.0,0.7,0.5,0.4,min --json out/gpt.json

Each budget gets a fresh model (same seed) optimised with ``remat.optimize``;
after one warm-up step (compilation), the peak of one full step (forward +
backward) is measured with ``remat.memory.peak`` and the step time is the
median of ``--repeat`` steps. Eager runs the same model uncompiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from _output import write_rows
from tabulate import tabulate

import remat
from remat import memory
from remat.solvers import format_bytes, min_peak_plan
from remat.tools import examples


def measure(step, model, repeat: int) -> tuple[int, float]:
    def run():
        model.zero_grad(set_to_none=True)
        step()

    run()  # compile / warm up
    model.zero_grad(set_to_none=True)
    peak = memory.peak(step).peak_bytes
    return peak, memory.step_time(run, repeat=repeat)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="built-in example or module:factory")
    parser.add_argument("--budgets", default="1.0,0.7,0.5,0.4,min")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 keeps timings stable on a shared machine)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, inputs = examples.load(args.model)
    eager_peak, eager_time = measure(lambda: model(*inputs).backward(), model, args.repeat)
    rows = [
        dict(
            run="eager",
            budget="-",
            predicted="-",
            measured=eager_peak,
            time_s=eager_time,
            overhead="+0.0%",
        )
    ]
    for token in args.budgets.split(","):
        model, inputs = examples.load(args.model)
        if token == "min":
            problem = remat.plan(model, inputs, budget=1.0).graphs[0].extracted.problem
            budget: int | float = min_peak_plan(problem).peak
        else:
            budget = float(token)
        print(f"budget {token}...", file=sys.stderr)
        optimized = remat.optimize(model, budget=budget)
        peak, seconds = measure(lambda m=optimized, x=inputs: m(*x).backward(), model, args.repeat)
        report = optimized.remat.report()
        rows.append(
            dict(
                run="remat",
                budget=report.graphs[0].limit,
                predicted=report.predicted_peak,
                measured=peak,
                time_s=seconds,
                overhead=f"{seconds / eager_time - 1:+.1%}",
            )
        )
        torch.compiler.reset()

    # remat at 1.0 runs the same compiled programs with nothing recomputed: the
    # difference to it is what recomputation costs, apart from compiling at all.
    tokens = args.budgets.split(",")
    store_all = rows[1 + tokens.index("1.0")]["time_s"] if "1.0" in tokens else None
    for r in rows:
        r["vs_store_all"] = (
            "-"
            if store_all is None or r["run"] == "eager"
            else (f"{r['time_s'] / store_all - 1:+.1%}")
        )

    def show(v):
        return format_bytes(v) if isinstance(v, int) else v

    table = [
        {k: (show(v) if k in ("budget", "predicted", "measured") else v) for k, v in r.items()}
        for r in rows
    ]
    print(tabulate(table, headers="keys", floatfmt=".4f"))
    write_rows(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
