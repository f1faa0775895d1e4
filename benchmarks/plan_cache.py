"""What the plan cache saves a restarted process: two processes, one cache folder.

    python benchmarks/plan_cache.py --json out/plan_cache.json

Each process builds the built-in ``gpt`` (by default at GPT-2 small's sizes: 12 layers,
d=768, 12 heads, seq 1024, vocabulary 50,257, batch 1, dropout 0), optimizes it with
``remat.optimize(model, budget=BUDGET, cache=FOLDER)`` and runs a first step (trace, plan,
one forward and backward), then ``--repeat`` more steps. Both processes share one fresh
cache folder, one after the other: the first plans and stores, the second (a restarted
job) reads. Per process: the first step, the planning inside it (the report's phases:
"extract", costs and each distinct kernel measured, "solve", "rewrite"), the median later
step, the first step less that median ("compile": tracing and planning), and the cache's
counts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _output import write_rows
from tabulate import tabulate

GPT2_SMALL = dict(layers=12, d_model=768, heads=12, seq=1024, vocab=50257, batch=1, dropout=0.0)


def one_process(folder: str, budget: float, repeat: int) -> dict:
    """One process's row (run in a child process: a fresh dynamo and nothing in memory)."""
    import statistics

    import remat
    from remat.tools import examples

    model, inputs = examples.load("gpt", **GPT2_SMALL)
    optimized = remat.optimize(model, budget=budget, cache=folder)

    def step() -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        optimized(*inputs).backward()
        return time.perf_counter() - start

    first = step()
    later = statistics.median(step() for _ in range(repeat))
    graphs = optimized.remat.report().graphs
    phases = {
        k: sum(g.phase_seconds.get(k, 0.0) for g in graphs) for k in ("extract", "solve", "rewrite")
    }
    return {
        "nodes": sum(len(g.extracted.problem) for g in graphs),
        "first step s": first,
        "plan s": sum(g.plan_seconds for g in graphs),
        **{f"{k} s": v for k, v in phases.items()},
        "later step s": later,
        "compile s": first - later,
        "cache": dict(optimized.remat.cache.counts),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--child", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.child, args.budget, args.repeat)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for process in ("first", "restarted"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", folder, "--budget", str(args.budget),
                 "--repeat", str(args.repeat)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rows.append({"process": process, **json.loads(out.stdout.splitlines()[-1])})
            print(tabulate([rows[-1]], headers="keys", floatfmt=".1f"), flush=True)
    write_rows(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
