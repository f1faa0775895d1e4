"""The CUDA check: remat on one GPU, measured in minutes, into one JSON and a table.

    python benchmarks/cuda_check.py --json out/cuda_check.json           # on a GPU
    python benchmarks/cuda_check.py --device cpu --small --json FILE     # its dry run

Needs torch 2.11 or later with CUDA, ortools (on a machine without network, its wheel and
those of its dependencies brought along: docs/benchmarks.md, "CUDA"), transformers for
``hf-gpt2``, and remat from this checkout (``pip install --no-deps --no-build-isolation
-e .``: torch requires the setuptools that builds it). It names everything missing before
measuring anything, and exits with status 2. Sections, in this order, each added to the
JSON as soon as it is done (a run cut short keeps what it measured):

- ``dropout``: a small ``gpt`` with dropout 0.5 whose every dropout remat recomputes
  (``solver="recompute-all"``), its masks drawn again from the state of the device's
  generator it saved: gradients bit for bit eager's from the same seed, the generator
  left where eager leaves it.
- ``reversible``: linear layers around a ``remat.nn.ReversibleSequential`` with dropout,
  under ``remat.optimize(budget=1.0)``: gradients against eager's, measured peak against
  the prediction; and the stack alone against its ordinary twin: gradients, generator
  state, peak.
- ``bench``: ``remat bench`` (``remat.tools.bench.run_bench``) on ``gpt`` and ``hf-gpt2``
  at GPT-2 small's sizes (12 layers, d=768, 12 heads, seq 1024, vocabulary 50,257; batch
  ``--batch``), in float32 and bfloat16: eager, ``torch.utils.checkpoint`` per block,
  torch's min-cut partition at ``activation_memory_budget`` 1 / 0.5 / 0.3, remat at 1 /
  0.5 / 0.3 of its store-all peak and at each of torch's measured peaks. Peaks are
  ``torch.cuda.max_memory_allocated`` (``remat.memory.peak``); gradients from the same
  seed against eager's (bfloat16: a plain ``torch.compile``'s, ``remat.tools.grads``).
  Checked per remat row: gradients, measured peak within the budget; reported: measured
  over predicted. Plans go to a fresh cache folder, so each graph is measured once for
  all its budgets.

What fits in the deadline (``--deadline``, 8 minutes) is an estimate from CPU runs; no
GPU has run the check yet. Each of a table's ten or so configurations is traced (and
torch's partitioned) on the CPU whatever the device, and at these sizes a first step under
remat took 66 s on two CPU cores (docs/benchmarks.md, "The plan cache"): expect the two
short sections and one table or two in 8 minutes, and ``--deadline 40`` for all four. A
table starts only when the slowest one so far would still end before the deadline; the
tables come in the order that measures each model and each dtype first (``tables``), and
those not started are listed under ``not measured``.

``--device cpu --small`` runs every section on small sizes, on the CPU (peaks from the
profiler): the check's own dry run, in the test suite (tests/tools/test_cuda_check.py).
Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

GPT2_SMALL = dict(layers=12, d_model=768, heads=12, seq=1024, vocab=50257)
SMALL = dict(layers=2, d_model=64, heads=4, seq=64, vocab=256)  # the dry run's
MODELS = ("gpt", "hf-gpt2")
DTYPES = ("float32", "bfloat16")
BUDGETS = (1.0, 0.5, 0.3)  # torch's activation_memory_budget and remat's fractions
DEADLINE_MIN = 8.0
# What the check imports, and where each comes from on a machine without network.
NEEDED = {
    "torch": "torch 2.11 or later, a CUDA build",
    "numpy": "pip install numpy (transformers brings it)",
    "tabulate": "pip install tabulate",
    "transformers": "pip install transformers (for hf-gpt2)",
    "ortools.sat.python.cp_model": "the ortools wheel and its dependencies, brought along: "
    "pip install --no-index --find-links WHEELS ortools (docs/benchmarks.md, CUDA)",
    "remat": "pip install --no-deps --no-build-isolation -e . in this checkout",
}

Say = Callable[[str], None]


# ----------------------------------------------------------------------------- before


def missing(device: str) -> list[str]:
    """What this machine lacks for the check, each with where to get it (empty: ready)."""
    lacks = []
    for name, where in NEEDED.items():
        try:
            importlib.import_module(name)
        except ImportError as e:  # remat's own names a torch it cannot run on
            lacks.append(f"{name.split('.')[0]}: {e} ({where})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        lacks.append(f"a CUDA device: torch {torch.__version__} ({build}) sees none")
    return lacks


def machine(device: str, sizes: dict) -> dict:
    versions = {n: metadata.version(n) for n in ("torch", "ortools", "transformers")}
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    return {
        "device": device,
        "device name": name,
        "cuda": torch.version.cuda,
        **versions,
        "sizes": sizes,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/cuda_check.py " + " ".join(sys.argv[1:]),
    }


def tables(models: list[str], dtypes: list[str]) -> list[tuple[str, str]]:
    """Every (model, dtype), in the order that measures each model and each dtype as early
    as possible: with two of each, gpt float32, hf-gpt2 bfloat16, gpt bfloat16, hf-gpt2
    float32 (a run stopped by its deadline has had one table of each)."""
    pairs = [(i, j) for i in range(len(models)) for j in range(len(dtypes))]
    pairs.sort(key=lambda p: ((p[1] - p[0]) % len(dtypes), p[0]))
    return [(models[i], dtypes[j]) for i, j in pairs]


# ----------------------------------------------------------------------------- bench


def bench(model: str, dtype: str, sizes: dict, args, say: Say) -> dict:
    """One ``remat bench`` table (``--budgets``, and remat at torch's peaks) and its checks."""
    from remat.tools.bench import run_bench

    start = time.perf_counter()
    rows = run_bench(
        model,
        args.budgets,
        device=args.device,
        size_kwargs={**sizes, "dtype": dtype},
        repeat=args.repeat,
        threads=None,
        at_torch_peaks=True,
        progress=say,
    )
    return {
        "model": model,
        "dtype": dtype,
        "rows": [r.record() for r in rows],
        "checks": bench_checks(rows),
        "seconds": time.perf_counter() - start,
    }


def bench_checks(rows) -> list[dict]:
    """Per remat row that ran: its gradients, and its measured peak within its budget;
    per row that failed other than by an infeasible budget: the failure."""
    checks = []
    for r in rows:
        if r.error is not None and not r.error.startswith("infeasible"):
            checks.append(check(f"{r.label} ran", False, r.error))
        if r.method != "remat" or r.peak_bytes is None:
            continue
        error = "" if r.grad_error is None else f"{r.grad_error:.2g} of the largest"
        checks.append(check(f"{r.label} gradients", r.grads_ok, error))
        ratio = r.peak_bytes / r.predicted_peak if r.predicted_peak else None
        within = r.peak_bytes <= r.budget_bytes
        detail = f"measured {r.peak_bytes:,} B, predicted {r.predicted_peak:,} B"
        detail += f" ({ratio:.3f}x), budget {r.budget_bytes:,} B" if ratio else ""
        checks.append(check(f"{r.label} within its budget", within, detail))
    return checks


def check(name: str, ok: bool, detail: str = "") -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail}


# ----------------------------------------------------------------------------- dropout


def dropout_replay(device: str) -> dict:
    """remat recomputing every dropout of a small ``gpt``: its masks replayed from the
    generator state it saved (module docstring)."""
    import remat
    from remat.tools import examples

    sizes = dict(layers=2, d_model=64, heads=4, seq=64, vocab=256, batch=2, dropout=0.5)
    model, inputs = examples.load("gpt", device=device, **sizes)
    eager = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=1.0, solver="recompute-all", cache=False)
    seeded_step(optimized, model, inputs, device)  # compiles and plans
    grads, state = seeded_step(optimized, model, inputs, device)
    ref_grads, ref_state = seeded_step(eager, eager, inputs, device)
    graph = optimized.remat.report().graphs[0]
    nodes = graph.extracted.problem.nodes
    replayed = sum(nodes[i].op.startswith("dropout_mask") for i in graph.plan.recomputed)
    same = all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    return {
        "masks replayed": replayed,
        "checks": [
            check("dropout masks recomputed in the backward", replayed > 0, f"{replayed}"),
            check("gradients bit for bit eager's", same),
            check("generator left where eager leaves it", torch.equal(state, ref_state)),
        ],
    }


def seeded_step(run, params, inputs, device: str):
    """Gradients of one step of ``run`` from a fixed seed, and the device generator's state
    after it."""
    params.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    run(*inputs).backward()
    grads = [p.grad.clone() for p in params.parameters() if p.grad is not None]
    return grads, generator_state(device)


def generator_state(device: str) -> torch.Tensor:
    if device.startswith("cuda"):
        return torch.cuda.get_rng_state(torch.device(device))
    return torch.get_rng_state()


# ----------------------------------------------------------------------------- reversible


def reversible(device: str, small: bool) -> dict:
    """The reversible stack on ``device`` (module docstring)."""
    width, depth, batch = (16, 4, 64) if small else (1024, 16, 4096)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(device)
    return {
        "width": width,
        "depth": depth,
        "batch": batch,
        "checks": [*stack_checks(width, depth, x), *planned_checks(width, depth, x)],
    }


def couplings(width: int, depth: int, p: float) -> nn.Module:
    """A ``ReversibleSequential`` of MLP couplings with dropout ``p``, from one seed."""
    from remat.nn import Coupling, ReversibleSequential

    def branch():
        half = width // 2
        return nn.Sequential(nn.Linear(half, 4 * half), nn.GELU(), nn.Dropout(p),
                             nn.Linear(4 * half, half))  # fmt: skip

    torch.manual_seed(0)
    return ReversibleSequential(*(Coupling(branch(), branch()) for _ in range(depth)))


class Mixed(nn.Module):
    """Linear layers around a reversible stack, and the loss: what remat.optimize plans."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.rev = couplings(width, depth, 0.1)
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.out(self.rev(self.inp(x)).relu()).square().mean()


def stack_checks(width: int, depth: int, x: torch.Tensor) -> list[dict]:
    """The stack alone against its ordinary twin (the same couplings run by autograd)."""
    from remat import memory

    device = str(x.device)
    rev = couplings(width, depth, 0.1).to(device)
    twin = nn.Sequential(*rev.blocks)
    grads, state = seeded_step(lambda: rev(x).square().mean(), rev, (), device)
    ref_grads, ref_state = seeded_step(lambda: twin(x).square().mean(), twin, (), device)
    error = relative_error(grads, ref_grads)
    peaks = {}
    for name, model in (("reversible", rev), ("ordinary", twin)):
        model.zero_grad(set_to_none=True)
        peaks[name] = memory.peak(lambda m=model: m(x).square().mean().backward(),
                                  device=device).peak_bytes  # fmt: skip
    return [
        check("stack: gradients the ordinary twin's", error < 1e-4, f"relative {error:.2g}"),
        check(
            "stack: dropout replayed, generator where the twin leaves it",
            torch.equal(state, ref_state),
        ),  # fmt: skip
        check(
            "stack: peak below the twin's",
            peaks["reversible"] < peaks["ordinary"],
            f"{peaks['reversible']:,} B against {peaks['ordinary']:,} B",
        ),  # fmt: skip
    ]


def planned_checks(width: int, depth: int, x) -> list[dict]:
    """Linear layers around the stack under ``remat.optimize(budget=1.0)``."""
    import remat
    from remat import memory

    device = str(x.device)
    model = Mixed(width, depth).to(device)
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=1.0, cache=False)
    seeded_step(optimized, model, (x,), device)  # compiles and plans
    grads, _ = seeded_step(optimized, model, (x,), device)
    ref_grads, _ = seeded_step(reference, reference, (x,), device)
    error = relative_error(grads, ref_grads)
    model.zero_grad(set_to_none=True)
    measured = memory.peak(lambda: optimized(x).backward(), device=device).peak_bytes
    predicted = optimized.remat.report().predicted_peak
    return [
        check("optimize: gradients eager's", error < 1e-4, f"relative {error:.2g}"),
        check(
            "optimize: measured peak within 1% of the prediction",
            abs(measured - predicted) <= 0.01 * predicted,
            f"measured {measured:,} B, predicted {predicted:,} B",
        ),  # fmt: skip
    ]


def relative_error(grads, reference) -> float:
    """Norm of the difference of the concatenated gradients over the reference's norm."""
    a = torch.cat([g.double().flatten() for g in grads])
    b = torch.cat([g.double().flatten() for g in reference])
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------- output


def summary(result: dict) -> str:
    """Every check, one line each: verdict, section, check, detail."""
    lines = []
    for section, found in sections(result):
        for c in found:
            verdict = "ok  " if c["ok"] else "FAIL"
            detail = f": {c['detail']}" if c["detail"] else ""
            lines.append(f"{verdict}  {section}  {c['check']}{detail}")
    return "\n".join(lines)


def sections(result: dict) -> list[tuple[str, list[dict]]]:
    found = [(f"bench {b['model']} {b['dtype']}", b["checks"]) for b in result.get("bench", [])]
    for name in ("dropout", "reversible"):
        if name in result:
            found.append((name, result[name]["checks"]))
    return found


def all_ok(result: dict) -> bool:
    return all(c["ok"] for _, found in sections(result) for c in found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--small", action="store_true", help="small sizes: the dry run's")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (small: 2)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument(
        "--budgets",
        type=lambda text: tuple(float(b) for b in text.split(",")),
        default=BUDGETS,
        help=f"torch's and remat's fractions (default {','.join(map(str, BUDGETS))})",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE_MIN,
        help=f"minutes: no bench table starts that the slowest so far would end past "
        f"(default {DEADLINE_MIN:g})",
    )
    parser.add_argument("--json", type=Path, help="where the results go, as they come")
    args = parser.parse_args(argv)
    lacks = missing(args.device)
    if lacks:
        print("cuda_check: this machine lacks:\n  " + "\n  ".join(lacks), file=sys.stderr)
        return 2
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", file=sys.stderr, flush=True)

    sizes = {
        **(SMALL if args.small else GPT2_SMALL),
        "batch": args.batch or (2 if args.small else 4),
    }
    result: dict = {"machine": machine(args.device, sizes), "bench": [], "not measured": []}

    def done(section: str) -> None:
        result["seconds"] = time.perf_counter() - start
        say(f"{section} done")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as cache:
        # A fresh plan cache: each graph's problem is measured once for all its budgets,
        # and nothing planned before this run is reused.
        os.environ.update(REMAT_CACHE="1", REMAT_CACHE_DIR=cache)
        result["dropout"] = dropout_replay(args.device)
        done("dropout")
        result["reversible"] = reversible(args.device, args.small)
        done("reversible")
        slowest = 0.0
        for model, dtype in tables(args.models.split(","), args.dtypes.split(",")):
            if time.perf_counter() - start + slowest > 60 * args.deadline:
                result["not measured"].append(f"bench {model} {dtype}: past the deadline")
                say(f"bench {model} {dtype}: not started, it would end past the deadline")
                continue
            result["bench"].append(bench(model, dtype, sizes, args, say))
            slowest = max(slowest, result["bench"][-1]["seconds"])
            done(f"bench {model} {dtype}")
    done("the check")
    print(report(result))
    return 0 if all_ok(result) else 1


def report(result: dict) -> str:
    """The bench tables, every check, what was not measured and the time it all took."""
    from remat.tools.rows import rows_table

    parts = [f"{t['model']}, {t['dtype']}\n{rows_table(_rows(t['rows']))}" for t in result["bench"]]
    parts.append(summary(result))
    parts += [f"not measured: {what}" for what in result["not measured"]]
    parts.append(f"{result['seconds']:.0f} s in all")
    return "\n\n".join(parts)


def _rows(records: list[dict]):
    """``Row``s back from their records, for the bench's own table."""
    from dataclasses import fields

    from remat.tools.rows import Row

    names = {f.name for f in fields(Row)}
    return [Row(**{k: v for k, v in r.items() if k in names}) for r in records]


if __name__ == "__main__":
    sys.exit(main())
