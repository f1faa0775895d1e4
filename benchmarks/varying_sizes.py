"""Training on inputs whose sizes change every step: traces, plans and peaks per step.

    python benchmarks/varying_sizes.py hf-llama --lengths 16 --longest 256 --fraction 0.7 \\
        --json out/varying.json

One model (built-in or ``module:factory``, its input cut to each step's length), one
absolute budget (``--fraction`` of eager's measured peak at the longest length), and
``--lengths`` distinct lengths in a fixed random order. Four runs, each from a fresh
dynamo: eager; remat as ``optimize`` makes it (``dynamic=None``: the first size traced
static, the second with sizes symbolic, then planned again without a trace where sizes
grow); remat with the longest length declared (``max_sizes``: every input's length up
to ``--longest``, traced once and planned once at it); and remat with ``dynamic=False``
(every length traced and planned, dynamo's recompile limit raised for it). Every step is
timed, and its gradients are compared with eager's. Its peak is measured (profiler) in a
second pass that reads the first pass's plans from a plan cache: a step that traces runs
as it did, without measuring kernels inside the profiler (that planning cannot measure
kernels' scratch), so the first step of every length is measured too. Prints one
row per step and a summary: the first trace+plan against serving a new size, traces,
graph plans and step plans per run, the worst peak against the budget, and the run's
total against the mark: the first two traces of remat as ``optimize`` makes it (the
static one and the symbolic one) plus twice eager's time for every step.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _output import write_rows
from tabulate import tabulate

import remat
from remat import memory
from remat.passes._torch_compat import dynamo_config
from remat.solvers import format_bytes
from remat.tools import examples
from remat.tools.cli import size_option


def lengths_of(count: int, shortest: int, longest: int, seed: int) -> list[int]:
    """``count`` distinct lengths in ``[shortest, longest]`` (both ends included), shuffled:
    the order padded batches of a text corpus come in."""
    pool = list(range(shortest, longest + 1))
    chosen = random.Random(seed).sample(pool[1:-1], count - 2) + [shortest, longest]
    random.Random(seed + 1).shuffle(chosen)
    return chosen


def cut(inputs: tuple, length: int) -> tuple:
    """The inputs of one step: each tensor's second dimension cut to ``length``."""
    return tuple(t[:, :length].contiguous() for t in inputs)


def one_step(model, fn, batch, measure: bool) -> tuple[float, int | None, list]:
    """Time one forward and backward of ``fn``, or (``measure``) its peak instead: the CPU
    profiler costs a step more time than the step itself on small models."""
    for p in model.parameters():
        p.grad = None

    def step():
        fn(*batch).backward()

    start = time.perf_counter()
    peak = memory.peak(step).peak_bytes if measure else step()
    seconds = time.perf_counter() - start
    return seconds, peak, [p.grad.clone() for p in model.parameters()]


def declared(model, inputs: tuple, longest: int) -> dict[str, dict[int, int]]:
    """``max_sizes`` for ``model``'s inputs: each one's length (its second dimension) up to
    ``longest``, named as its forward's signature names its positional arguments."""
    names = list(inspect.signature(model.forward).parameters)[: len(inputs)]
    return {name: {1: longest} for name in names}


def run(model, inputs, lengths, budget: int | None, options: dict, expected=None):
    """Two passes over ``lengths``, each from a fresh dynamo, sharing a fresh plan cache:
    one timed, which plans and stores its plans, one measured (its peaks), which reads
    them, so its tracing steps measure no kernels inside the profiler (which would count
    their scratch). ``options``: ``optimize``'s ``dynamic`` and ``max_sizes``. Per step its
    row, and per step the gradients."""
    with tempfile.TemporaryDirectory() as cache:
        options = {**options, "cache": cache} if budget is not None else options
        timed, _ = _pass(model, inputs, lengths, budget, options, measure=False)
        measured, grads = _pass(model, inputs, lengths, budget, options, measure=True)
    rows = []
    for k, (t, m) in enumerate(zip(timed, measured, strict=True)):
        row = {**t, "peak": m["peak"]}
        if expected is not None:
            pairs = zip(grads[k], expected[k], strict=True)
            row["grads equal"] = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs)
        rows.append(row)
    return rows, grads


def _pass(model, inputs, lengths, budget, options: dict, measure: bool):
    torch.compiler.reset()
    fn = model if budget is None else remat.optimize(model, budget=budget, **options)
    rows, grads, traced, planned, step_plans = [], [], 0, 0, 0
    for k, length in enumerate(lengths):
        rb = getattr(fn, "remat", None)
        seconds, peak, g = one_step(model, fn, cut(inputs, length), measure)
        row = {"step": k + 1, "length": length, "seconds": seconds, "peak": peak}
        if rb:
            names, records = len({g.name for g in rb.graphs}), len(rb.graphs)
            steps = len(rb.report().steps)
            row["traced"], row["planned"] = names > traced, records > planned
            row["step planned"] = steps > step_plans
            traced, planned, step_plans = names, records, steps
        rows.append(row)
        grads.append(g)
    return rows, grads


def summary(
    name: str, rows: list[dict], eager: list[dict], budget: int | None, mark: float
) -> dict:
    """The run's totals: traces, plans, the worst measured peak, its time against eager and
    against ``mark`` (the first two traces of remat with sizes undeclared, plus twice
    eager's time for every step)."""
    out = {"run": name, "steps": len(rows), "total s": sum(r["seconds"] for r in rows)}
    out["median step s"] = statistics.median(r["seconds"] for r in rows)
    if budget is not None:
        measured = [r["peak"] for r in rows if r["peak"] is not None]
        out["traces"] = sum(r["traced"] for r in rows)
        out["plans"] = sum(r["planned"] for r in rows)
        out["step plans"] = sum(r["step planned"] for r in rows)
        out["worst peak / budget"] = max(measured) / budget if measured else None
        out["grads equal"] = all(r["grads equal"] for r in rows)
        traces = [r["seconds"] for r in rows if r["traced"]]
        out["first trace+plan s"] = traces[0]
        new_sizes = [r["seconds"] - e["seconds"] for r, e in zip(rows, eager, strict=True)
                     if r["planned"] and not r["traced"]]  # fmt: skip
        out["serve a new size s (median)"] = statistics.median(new_sizes) if new_sizes else 0.0
        out["total / (2 traces + 2x eager)"] = out["total s"] / mark
        out["meets the mark"] = out["total s"] <= mark
    return out


def the_mark(remat_rows: list[dict], eager: list[dict]) -> float:
    """What two traces (static, then symbolic) and no planning per size would take: the
    first two tracing steps of remat as ``optimize`` makes it, plus twice eager's time for
    every step. One figure for every run, so the runs compare on it."""
    traces = [r["seconds"] for r in remat_rows if r["traced"]][:2]
    return sum(traces) + 2 * sum(r["seconds"] for r in eager)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="hf-llama")
    parser.add_argument("--lengths", type=int, default=16, help="distinct lengths (steps)")
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--fraction", type=float, default=0.7, help="of eager's peak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", action="append", default=[], type=size_option)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    sizes = dict(args.size)
    # the model takes lengths up to ``seq``; at exactly its longest some models slice a
    # buffer to a no-op, which dynamo guards on: one more trace, so ``seq`` is one longer
    model, inputs = examples.load(args.model, **{"seq": args.longest + 1, **sizes})
    lengths = lengths_of(args.lengths, args.shortest, args.longest, args.seed)
    eager_peak = memory.peak(lambda: model(*cut(inputs, args.longest)).backward()).peak_bytes
    budget = int(args.fraction * eager_peak)
    print(f"{args.model}: lengths {lengths}; budget {format_bytes(budget)} "
          f"({args.fraction} of eager's {format_bytes(eager_peak)} at {args.longest})",
          file=sys.stderr)  # fmt: skip

    eager, expected = run(model, inputs, lengths, None, {})
    limit = dynamo_config.recompile_limit
    runs = {"eager": eager}
    runs["remat"] = run(model, inputs, lengths, budget, {}, expected)[0]
    max_sizes = declared(model, inputs, args.longest)
    runs["remat, declared maximum"] = run(
        model, inputs, lengths, budget, {"max_sizes": max_sizes}, expected
    )[0]
    try:
        dynamo_config.recompile_limit = len(lengths) + 2  # (its default: 8)
        static = run(model, inputs, lengths, budget, {"dynamic": False}, expected)[0]
        runs["remat, static shapes"] = static
    finally:
        dynamo_config.recompile_limit = limit
    torch.compiler.reset()

    table = []
    for k, length in enumerate(lengths):
        row = {"step": k + 1, "length": length, "eager s": eager[k]["seconds"]}
        for name in ("remat", "remat, declared maximum", "remat, static shapes"):
            r = runs[name][k]
            row[f"{name} s"] = r["seconds"]
            row[f"{name} peak"] = "-" if r["peak"] is None else format_bytes(r["peak"])
            row[f"{name} work"] = work(r)
        table.append(row)
    print(tabulate(table, headers="keys", floatfmt=".3f"))
    mark = the_mark(runs["remat"], eager)
    totals = [summary(name, rows, eager, None if name == "eager" else budget, mark)
              for name, rows in runs.items()]  # fmt: skip
    print()
    print(tabulate(totals, headers="keys", floatfmt=".3g"))
    out = [{"kind": "step", "run": name, **r} for name, rows in runs.items() for r in rows]
    meta = {"model": args.model, "sizes": sizes, "budget": budget, "eager peak": eager_peak,
            "max_sizes": max_sizes}  # fmt: skip
    write_rows([{"kind": "meta", **meta}, *out, *({"kind": "summary", **t} for t in totals)],
               args.json, args.csv)  # fmt: skip
    return 0


def work(row: dict) -> str:
    """What remat did at a step: traced and planned, planned a graph again without a trace,
    or planned the step again (what its code outside the graphs holds measured at a size
    larger than before; its plan kept where it still fits)."""
    if row["traced"]:
        return "trace+plan"
    if row["planned"]:
        return "plan"
    return "step plan" if row["step planned"] else ""


if __name__ == "__main__":
    sys.exit(main())
