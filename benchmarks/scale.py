"""Planning time at LLM depth: torch's min-cut partition against remat's plan, one graph.

    python benchmarks/scale.py --layers 8,32,80 --budgets 0.7,0.5,0.3 --json out/scale.json

Each row trains one first step of a Hugging Face ``LlamaForCausalLM`` (from a config,
random weights; hidden 128, 4 heads, 2 KV heads, batch 2 x 128 tokens, loss inside) or of
the built-in ``gpt`` at GPT-2 small's sizes (``--model gpt``), twice from a fresh dynamo:

- **torch**: AOTAutograd with ``min_cut_rematerialization_partition`` at
  ``activation_memory_budget`` = the row's budget (a fraction of what torch estimates);
  "partition s" is that call.
- **remat**: ``remat.optimize(model, budget=fraction, cache=False)`` (a fraction of the
  store-all peak; no plan cache, so each row plans); "extract s" (costs, each distinct
  kernel measured), "solve s", "rewrite s" from the plan's report.

Both compile their programs as plain fx ("eager"), so "first step s" (trace, plan or
partition, and one forward and backward) differs by what each planner does. "plan cost"
is the plan's step-time cost (recompute plus save seconds, ``Plan.cost``), "gap" its
excess over the proven lower bound (empty when none was proven).
``--save-problems DIR`` pickles each graph's ``solvers.Problem`` for solver work offline.
``--prove SECONDS`` adds, after the step, each plan's bound from ``remat.solvers.prove``
(the MIP of the pointed relaxation, at most SECONDS per graph; the ``prove`` extra):
"proven gap" and "prove s", not part of the plan's time.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import torch
from _output import write_rows
from tabulate import tabulate

import remat
from remat import solvers
from remat.passes._torch_compat import (
    aot_autograd,
    boxed,
    compile_caches_off,
    min_cut_partition,
)
from remat.tools import examples

LLAMA = dict(d_model=128, heads=4, kv_heads=2, seq=128, batch=2)
GPT2_SMALL = dict(d_model=768, heads=12, seq=1024, batch=1, vocab=50257)


def build(model: str, layers: int):
    if model == "hf-llama":
        return examples.load("hf-llama", layers=layers, **LLAMA)
    return examples.load("gpt", layers=layers, **GPT2_SMALL)


def first_step(model, inputs) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(*inputs).backward()
    return time.perf_counter() - start


def torch_row(model, inputs, budget: float) -> dict:
    partitions: list[tuple[float, int]] = []

    def timed_partition(joint, joint_inputs, **kwargs):
        nodes = len(joint.graph.nodes)
        start = time.perf_counter()
        out = min_cut_partition(joint, joint_inputs, **kwargs)
        partitions.append((time.perf_counter() - start, nodes))
        return out

    def plain(gm, _inputs):  # fx run as Python, as remat's eager compiler does
        return boxed(gm)

    torch.compiler.reset()
    backend = aot_autograd(fw_compiler=plain, bw_compiler=plain, partition_fn=timed_partition)
    with compile_caches_off(budget):
        seconds = first_step(torch.compile(model, backend=backend, dynamic=False), inputs)
    return {
        "joint nodes": sum(n for _, n in partitions),
        "partition s": sum(s for s, _ in partitions),
        "first step s": seconds,
    }


def remat_row(
    model, inputs, budget: float, save: Path | None, tag: str, prove: float | None
) -> dict:
    torch.compiler.reset()
    optimized = remat.optimize(model, budget=budget, cache=False)  # plan, not reread
    seconds = first_step(optimized, inputs)
    graphs = optimized.remat.report().graphs
    phase = {k: sum(g.phase_seconds[k] for g in graphs) for k in ("extract", "solve", "rewrite")}
    plans = [g.plan for g in graphs]
    cost = sum(p.cost for p in plans)  # recompute + save seconds: what the bound bounds
    bounds = [p.bound for p in plans]
    gap = None if None in bounds else (cost - sum(bounds)) / cost if cost else 0.0
    if save:
        save.mkdir(parents=True, exist_ok=True)
        for g in graphs:
            with open(save / f"{tag}-{g.name}.pkl", "wb") as f:
                pickle.dump((g.extracted.problem, g.limit), f)
    proof = {}
    if prove:
        start = time.perf_counter()
        proved = [solvers.prove(g.extracted.problem, g.plan, prove) for g in graphs]
        bound = sum(p.bound for p in proved)
        proof = {"proven gap": (cost - bound) / cost if cost else 0.0}
        proof["prove s"] = time.perf_counter() - start
    return {
        "problem nodes": sum(len(g.extracted.problem) for g in graphs),
        **{f"{k} s": v for k, v in phase.items()},
        "first step s": seconds,
        "plan cost": cost,
        "gap": gap,
        "predicted peak": max(p.peak for p in plans),
        "solver": ", ".join(sorted({p.solver for p in plans})),
        **proof,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("hf-llama", "gpt"), default="hf-llama")
    parser.add_argument("--layers", default="8,32,80")
    parser.add_argument("--budgets", default="0.7,0.5,0.3")
    parser.add_argument("--only", choices=("torch", "remat"))
    parser.add_argument("--save-problems", type=Path)
    parser.add_argument("--prove", type=float, metavar="SECONDS")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        model, inputs = build(args.model, layers)
        for budget in (float(x) for x in args.budgets.split(",")):
            row = {"model": args.model, "layers": layers, "budget": budget}
            if args.only != "remat":
                t = torch_row(model, inputs, budget)
                row |= {f"torch {k}": v for k, v in t.items()}
            if args.only != "torch":
                tag = f"{args.model}{layers}-{budget}"
                try:
                    r = remat_row(model, inputs, budget, args.save_problems, tag, args.prove)
                except remat.InfeasibleBudget as refusal:  # no plan fits: say so, go on
                    r = {"refused": f"minimum {refusal.minimum / refusal.store_all:.3f}"}
                row |= {f"remat {k}": v for k, v in r.items()}
            rows.append(row)
            print(tabulate([row], headers="keys", floatfmt=".3g"), flush=True)
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    write_rows(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
