"""The space-time curve of checkpointing: store-all, √n and REVOLVE on deep MLPs.

For the built-in MLP at each depth L, trains one step under each plan and reports its
measured peak (one step, forward + backward, gradients set to None first), the predicted
peak and the forward work: how many forward ops the step runs, repeats included (one
forward pass is the ``fwd ops`` column), and the extra forward work over one forward
pass, in ops and in estimated time (the op count includes the weights' free transposes,
which nothing recomputes). Methods:

- ``store-all``: keep every activation the backward reads;
- ``sqrt``: checkpoint every round(√n) stages of the graph's chain of n stages (``stages``:
  about two per layer, the Linear's and the GELU's outputs, coarsened to at most 256; the
  solver named ``"sqrt"`` picks the cheapest segment length under the budget, which at a
  loose budget is one segment, i.e. store-all, so the segment is fixed here);
- ``revolve``: the binomial schedule over those stages with ceil(log2 L) checkpoint slots
  (the chain's input counts as one);
- ``auto``: remat's default solver at the revolve plan's predicted peak, in bytes.

It then fits the peak's growth: the slope of log(peak) against log(L) (store-all ~1,
√n ~0.5) and, for the logarithmic end, peak against log2(L), each with its R^2; both on
the measured peak and on the peak less the parameters' gradients (which every method
holds at the end of the backward and which grow linearly in L).

    python examples/space_time_curve.py [--depths 16,32,64,128,256] [--width 64]
        [--batch 1024] [--out out/space_time]

Writes ``space_time.csv``, ``space_time.json`` and, with matplotlib, ``space_time.png``
(log-log peak against L) under ``--out``. One thread; about 3 minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from tabulate import tabulate

import remat
from remat.solvers.chain import chain_plan, find_chain, revolve, sqrt_actions
from remat.tools.examples import mlp

METHODS = ("store-all", "sqrt", "revolve", "auto")


def sqrt_checkpoints(problem, limit):
    """A solver: checkpoint every round(√n) stages of the forward's chain of n stages."""
    chain = find_chain(problem)
    segment = max(1, round(math.sqrt(chain.length)))
    return chain_plan(chain, sqrt_actions(chain.length, segment), solver="sqrt", limit=limit)


def eager_step(depth: int, width: int, batch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model, (x, y) = mlp(layers=depth, width=width, batch=batch)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def agreement(loss, grads, reference) -> str:
    """``exact``, ``allclose`` or ``DIFFERENT (relative error)`` against eager's step."""
    ref_loss, ref_grads = reference
    pairs = [(loss, ref_loss), *zip(grads, ref_grads, strict=True)]
    if all(torch.equal(a, b) for a, b in pairs):
        return "exact"
    if all(torch.allclose(a, b) for a, b in pairs):
        return "allclose"
    scale = max(float(b.abs().max()) for _, b in pairs) or 1.0
    return f"DIFFERENT ({max(float((a - b).abs().max()) for a, b in pairs) / scale:.1e})"


def measure(depth: int, width: int, batch: int, method: str, solver, budget, reference) -> dict:
    """One configuration: first step (compiles, checked against eager), then the peak of
    a second."""
    start = time.perf_counter()
    model, (x, y) = mlp(layers=depth, width=width, batch=batch)
    step = remat.optimize(model, budget=budget, solver=solver)
    loss = step(x, y)
    loss.backward()
    agrees = agreement(loss.detach(), [p.grad for p in model.parameters()], reference)
    model.zero_grad(set_to_none=True)
    measured = remat.memory.peak(lambda: step(x, y).backward()).peak_bytes
    report = step.remat.report()
    graph = report.graphs[0]
    problem, plan = graph.extracted.problem, graph.plan
    nodes = problem.nodes
    recomputed = sum(nodes[i].phase == "fwd" for i in plan.schedule.backward)
    torch.compiler.reset()
    return {
        "L": depth,
        "method": method,
        "solver": plan.solver,
        "measured": measured,
        "predicted": report.predicted_peak,
        "grads": sum(p.numel() * p.element_size() for p in model.parameters()),
        "fwd ops": len(problem.forward_nodes),
        "fwd work": len(plan.schedule.forward) + recomputed,
        "extra ops": (len(plan.schedule.forward) + recomputed) / len(problem.forward_nodes) - 1,
        "extra time": plan.recompute_cost / sum(nodes[i].cost for i in problem.forward_nodes),
        "stages": find_chain(problem).length,
        "vs eager": agrees,
        "seconds": round(time.perf_counter() - start, 1),
    }


def fit(xs, ys) -> tuple[float, float]:
    """Least-squares slope of ys on xs and its R^2."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(xs, ys, 1)
    residual = ys - (slope * xs + intercept)
    total = ((ys - ys.mean()) ** 2).sum()
    return float(slope), float(1 - (residual**2).sum() / total) if total else 1.0


def fits(rows: list[dict]) -> list[dict]:
    """Per method, of the measured peak and of the peak less the gradients: the slope of
    log(peak) on log(L), and of peak on log2(L) (bytes per doubling), with their R^2."""
    out = []
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if len(mine) < 2:
            continue
        depths = [r["L"] for r in mine]
        for quantity, less in (("peak", 0), ("peak - grads", 1)):
            ys = [r["measured"] - less * r["grads"] for r in mine]
            slope, r2 = fit(np.log(depths), np.log(ys))
            per_doubling, r2_log = fit(np.log2(depths), ys)
            row = {"method": method, "of": quantity, "log-log slope": slope, "R^2": r2}
            row.update({"MiB per doubling": per_doubling / 2**20, "R^2 (vs log2 L)": r2_log})
            out.append(row)
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[plot]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        style = "x--" if method == "auto" else "o-"  # auto often runs revolve's plan
        ax.loglog([r["L"] for r in mine], [r["measured"] / 2**20 for r in mine], style,
                  label=method, base=2)  # fmt: skip
    ax.set_xlabel("depth L (layers)")
    ax.set_ylabel("measured peak of one step (MiB)")
    ax.set_title("Deep MLP: peak memory against depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", default="16,32,64,128,256")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("out/space_time"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    for depth in [int(d) for d in args.depths.split(",")]:
        reference = eager_step(depth, args.width, args.batch)
        run = functools.partial(measure, depth, args.width, args.batch, reference=reference)
        rows.append(run("store-all", "store-all", 1.0))
        rows.append(run("sqrt", sqrt_checkpoints, 1.0))
        slots = math.ceil(math.log2(depth))
        rows.append(run("revolve", functools.partial(revolve, slots=slots), 1.0))
        rows.append(run("auto", "auto", rows[-1]["predicted"]))
        for row in rows[-4:]:
            print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)

    mib, extra = ("measured", "predicted", "grads"), ("extra ops", "extra time")
    table = [{**r, **{k: r[k] / 2**20 for k in mib}, **{k: f"{r[k]:+.0%}" for k in extra}}
             for r in rows]  # fmt: skip
    print(tabulate(table, headers="keys", floatfmt=".2f"))
    print("(peaks and grads in MiB)\n")
    fitted = fits(rows)
    print(tabulate(fitted, headers="keys", floatfmt=".3f"))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "space_time.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "space_time.json").write_text(json.dumps({"rows": rows, "fits": fitted}, indent=1))
    plot(rows, args.out / "space_time.png")
    print(f"total {time.perf_counter() - start:.0f} s; wrote {args.out}/space_time.csv, .json")


if __name__ == "__main__":
    main()
