"""Budget -> measured peak of the first and second steps -> step time, for a step of several
graphs (by default Hugging Face GPT-2 called with ``labels=``, a graph break before its loss).

    python benchmarks/step_budget.py hf-gpt2-labels --fractions 0.7,0.5,0.3 --json out/step.json

Budgets are fractions of eager's measured peak, given to remat in bytes. Each gets a fresh
``remat.optimize`` (dynamo reset): step 1 compiles, runs the compile-time plans and
records the step (its peak here includes compiling); step 2 runs the joint plan. Where a
budget is refused, the row says so and the next row retries at the minimum it named.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from _output import write_rows
from tabulate import tabulate

import remat
from remat import memory
from remat.solvers import format_bytes
from remat.tools import examples


def run_budget(model, inputs, budget: int, repeat: int) -> dict:
    torch.compiler.reset()
    optimized = remat.optimize(model, budget=budget)

    def step():
        model.zero_grad(set_to_none=True)
        optimized(*inputs).backward()

    row = {"budget": budget}
    try:
        row["step 1 peak"] = memory.peak(step).peak_bytes
    except remat.InfeasibleBudget as refusal:
        return {**row, "refused": refusal.minimum}
    row["step 2 peak"] = memory.peak(step).peak_bytes
    report = optimized.remat.report()
    row["predicted"] = report.predicted_peak
    row["first step predicted"] = report.first_step_peak
    row["graphs"] = len(report.graphs)
    row["step s"] = memory.step_time(step, repeat=repeat)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="hf-gpt2-labels")
    parser.add_argument("--fractions", default="0.7,0.5,0.3")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    sizes = {k: int(v) if v.isdigit() else v for k, v in (s.split("=", 1) for s in args.size)}
    model, inputs = examples.load(args.model, **sizes)
    reference = copy.deepcopy(model)
    eager = memory.peak(lambda: reference(*inputs).backward()).peak_bytes
    eager_s = memory.step_time(lambda: reference(*inputs).backward(), repeat=args.repeat)
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        row = run_budget(model, inputs, int(fraction * eager), args.repeat)
        rows.append({"fraction of eager": fraction, **row})
        if "refused" in row:
            retry = run_budget(model, inputs, row["refused"], args.repeat)
            rows.append({"fraction of eager": f"{fraction} -> minimum", **retry})
    print(f"eager: peak {format_bytes(eager)}, step {eager_s:.3f}s", file=sys.stderr)
    shown = [
        {k: format_bytes(v) if "peak" in k or "predicted" in k or k in ("budget", "refused") else v
         for k, v in r.items()}
        for r in rows
    ]
    print(tabulate(shown, headers="keys", tablefmt="github"))
    write_rows([{"eager peak": eager, "eager s": eager_s, **r} for r in rows], args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
