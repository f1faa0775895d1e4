"""docs/benchmarks.md, generated from the measured results and the prose that explains them.

    python benchmarks/report.py                      # rewrites docs/benchmarks.md
    python benchmarks/report.py --out PATH           # writes the page elsewhere
    python benchmarks/report.py record NAME RAW.json --command "CMD" [--machine-note TEXT]

Inputs:

- ``benchmarks/results/NAME.json``, one per question: ``{"provenance": {...}, "data": ...}``.
  ``data`` is what the benchmark wrote with ``--json`` (``remat bench``'s ``{"meta",
  "rows"}``, a script's list of rows), unchanged; ``provenance`` holds the command that
  wrote it, the commit and machine it ran on and the date. ``record`` writes such a file
  from a run's JSON, reading the commit from git and the machine from this one: run it
  where and right after the benchmark ran. A result carried over from an older run (no
  JSON was kept) holds its rows as the old table gave them and says so in
  ``provenance["carried_over"]``.
- ``benchmarks/report_text.md``: the page's prose, as Markdown. A line
  ``<!-- table: NAME [VIEW] -->`` becomes the table of ``results/NAME.json`` (``VIEW``:
  another table of the same rows) and, under it, the line saying how it was made;
  ``<!-- summary: NAME NAME ... -->`` becomes one row per ``remat bench`` result.

The prose is a Markdown file of its own, not strings in this script and not notes inside
the JSON, because it is read and reviewed as Markdown (links, code spans, paragraphs),
and because a rerun replaces a JSON file whole: the measured data and the words about it
change in separate files, so a diff shows which changed. How each table is laid out
(columns, units) is code, here. Every result must be used by the text and every table
the text names must exist, so neither can be dropped silently; tests/test_benchmark_report.py
checks that the committed page is what this script writes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TEXT = ROOT / "benchmarks" / "report_text.md"
PAGE = ROOT / "docs" / "benchmarks.md"
COMMAND = "python benchmarks/report.py"

# Above this relative difference from the reference's gradients a configuration trains on
# other gradients; the rule of remat/tools/rows.py (GRAD_TOLERANCE), which this script
# does not import (it runs without torch).
GRAD_TOLERANCE = 1e-3
# A remat point dominates a torch point at no more peak and at most this times its step
# time (remat/tools/rows.py, ``dominates``).
DOMINANCE_SLACK = 1.02

DIRECTIVE = re.compile(r"^<!-- (table|summary): ([\w ]+?) -->$")


# ---------------------------------------------------------------------------- formats


def mib(n: float | None) -> str:
    """Bytes in binary units, as ``remat.solvers.format_bytes`` writes them."""
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def count(n) -> str:
    return "" if n is None else f"{n:,}"


def seconds(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fixed(digits: int) -> Callable[[float | None], str]:
    return lambda x: "" if x is None else f"{x:.{digits}f}"


def percent(digits: int) -> Callable[[float | None], str]:
    return lambda x: "" if x is None else f"{x:.{digits}%}"


def signed_percent(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def significant(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def plain(x) -> str:
    return "" if x is None else str(x)


def table(headers: list[str], body: list[list[str]]) -> str:
    """A Markdown pipe table, less the columns with no value in any row."""
    keep = [i for i in range(len(headers)) if any(row[i] for row in body)]
    headers = [headers[i] for i in keep]
    body = [[row[i] for i in keep] for row in body]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def columns(rows: list[dict], spec: list[tuple[str, str | Callable, Callable]]) -> str:
    """Rows of flat dicts as a table: per column its header, the key (or a function of the
    row) and the format of its value."""
    body = []
    for row in rows:
        cells = []
        for _header, key, fmt in spec:
            value = key(row) if callable(key) else row.get(key)
            cells.append(fmt(value))
        body.append(cells)
    return table([h for h, _, _ in spec], body)


# ------------------------------------------------------------------ remat bench tables


def _grads_ok(row: dict) -> bool:
    return row.get("grad_error") is None or row["grad_error"] <= GRAD_TOLERANCE


def _budget_text(b) -> str:
    if b is None:
        return "-"
    if isinstance(b, int) and b > 1:
        return mib(b)
    return f"{b:g}"


def _solver_text(row: dict) -> str:
    if row.get("solver") is None:
        return ""
    if row.get("cost_model") in (None, "roofline"):
        return row["solver"]
    return f"{row['solver']}, {row['cost_model']}"


def _grads_text(row: dict) -> str:
    if row.get("grad_error") is None:
        return ""
    if not _grads_ok(row):
        return f"WRONG ({row['grad_error']:.1e})"
    return f"= {row.get('grad_reference') or 'eager'}"


def _eager_peak(rows: list[dict]) -> int | None:
    return next((r["peak_bytes"] for r in rows if r["method"] == "eager"), None)


def bench_table(data: dict) -> str:
    """``remat bench``'s rows, as its own table prints them (less the compile column)."""
    rows = data["rows"]
    eager = _eager_peak(rows)
    headers = ["method", "budget", "solver", "peak", "vs eager", "step", "+-", "overhead"]
    headers += ["step (est.)", "est. err", "plan", "predicted", "gap", "grads", "note"]
    body = []
    for r in rows:
        remat = r["method"] == "remat" and r.get("error") is None
        gap = ("-" if r.get("gap") is None else f"{r['gap']:.1%}") if remat else ""
        peak = r.get("peak_bytes")
        body.append(
            [
                r["method"],
                _budget_text(r.get("budget")),
                _solver_text(r),
                mib(peak),
                f"{peak / eager:.2f}x" if peak is not None and eager else "",
                seconds(r.get("step_s")),
                percent(1)(r.get("spread")),
                signed_percent(r.get("overhead")),
                seconds(r.get("predicted_s")),
                _estimate_error(r),
                fixed(1)(r.get("plan_s")) + (" s" if r.get("plan_s") is not None else ""),
                mib(r.get("predicted_peak")),
                gap,
                _grads_text(r),
                r.get("error") or "",
            ]
        )
    return table(headers, body)


def _estimate_error(row: dict) -> str:
    """The estimated step against the measured median, signed (remat/tools/rows.py)."""
    if row.get("predicted_s") is None or not row.get("step_s"):
        return ""
    return f"{row['predicted_s'] / row['step_s'] - 1:+.0%}"


def dominance(rows: list[dict]) -> tuple[int, int, list[str]]:
    """How many torch points with correct gradients a remat point dominates (peak <= and
    step time <= DOMINANCE_SLACK x), of how many, and the labels of those it does not."""
    remat = [
        r for r in rows if r["method"] == "remat" and r.get("step_s") is not None and _grads_ok(r)
    ]
    points = [
        r for r in rows if r["method"] == "torch" and r.get("step_s") is not None and _grads_ok(r)
    ]
    missed = []
    for t in points:
        within = [r for r in remat if r["peak_bytes"] <= t["peak_bytes"]]
        best = min(within, key=lambda r: r["step_s"], default=None)
        if best is None or best["step_s"] > DOMINANCE_SLACK * t["step_s"]:
            missed.append(f"torch {_budget_text(t['budget'])}")
    return len(points) - len(missed), len(points), missed


def summary(names: list[str], results: dict[str, dict]) -> str:
    """One row per ``remat bench`` result: dominance over torch's correct points, remat's
    fastest point at 3x less peak than eager's, and the rows' median timing spread."""
    body = []
    for name in names:
        data = results[name]["data"]
        rows, meta = data["rows"], data["meta"]
        eager = next(r for r in rows if r["method"] == "eager")
        won, of, missed = dominance(rows)
        third = [
            r
            for r in rows
            if r["method"] == "remat"
            and r.get("step_s") is not None
            and _grads_ok(r)
            and r["peak_bytes"] * 3 <= eager["peak_bytes"]
        ]
        best = min(third, key=lambda r: r["step_s"], default=None)
        spreads = [r["spread"] for r in rows if r.get("spread") is not None]
        size = meta.get("size", {})
        model = meta["model"] + (" (no dropout)" if size.get("dropout") == 0 else "")
        body.append(
            [
                f"{model}, {meta['compiler']}",
                f"{won} of {of}" + (f" (not: {', '.join(missed)})" if missed else ""),
                "-" if best is None else f"remat {_budget_text(best['budget'])}",
                "-" if best is None else f"{best['peak_bytes'] / eager['peak_bytes']:.2f}x",
                "-" if best is None else signed_percent(best["overhead"]),
                percent(1)(statistics.median(spreads)) if spreads else "",
                str(meta.get("repeat", "")),
            ]
        )
    headers = ["model, compiler", "torch points dominated", "remat at 3x less than eager"]
    headers += ["its peak vs eager", "its step vs eager", "median +-", "rounds"]
    return table(headers, body)


# ----------------------------------------------------------------- the scripts' tables


def _gap_or_refusal(row: dict) -> str:
    if row.get("remat refused"):
        return f"refused: {row['remat refused']} of store-all"
    return percent(2)(row.get("remat gap"))


def _first_or_refusal(row: dict) -> str:
    if row.get("refused"):
        return f"refused: {row['refused']}"
    return fixed(3)(row.get("first / budget"))


def _remat_plan_s(row: dict) -> float | None:
    if "remat solve s" not in row:
        return None
    return row["remat extract s"] + row["remat solve s"] + row["remat rewrite s"]


def _bytes_exact(n) -> str:
    return "" if n is None else f"{n:,} B"


def _mib2(n) -> str:
    return "" if n is None else f"{n / 2**20:.2f} MiB"


def solver_pairs(data: list[dict]) -> str:
    """solver_bench's rows, the greedy's and CP-SAT's plan of one graph and budget side by
    side."""
    greedy = {(r["graph"], r["budget"]): r for r in data if r["solver"] == "greedy"}
    rows = [
        {"cpsat": r, "greedy": greedy.get((r["graph"], r["budget"]), {})}
        for r in data
        if r["solver"] == "cpsat"
    ]
    return columns(
        rows,
        [
            ("graph", lambda r: r["cpsat"]["graph"].split(",")[0], plain),
            ("nodes", lambda r: r["cpsat"]["nodes"], count),
            ("budget", lambda r: r["cpsat"]["budget"], plain),
            ("budget bytes", lambda r: r["cpsat"]["budget_bytes"], mib),
            ("greedy s", lambda r: r["greedy"].get("seconds"), fixed(2)),
            ("greedy cost", lambda r: r["greedy"].get("cost"), significant),
            ("cpsat s", lambda r: r["cpsat"]["seconds"], fixed(2)),
            ("status", lambda r: r["cpsat"]["status"], plain),
            ("cpsat cost", lambda r: r["cpsat"].get("cost"), significant),
            ("bound", lambda r: r["cpsat"].get("bound"), significant),
            ("gap", lambda r: r["cpsat"].get("gap"), percent(2)),
            ("vs greedy", lambda r: r["cpsat"].get("overhead"), signed_percent),
        ],
    )


def _test_name(failure: str) -> str:
    """``tests.solvers.test_cpsat::test_x[0.5]`` -> ``test_cpsat::test_x[0.5]``."""
    module, sep, name = failure.partition("::")
    return f"{module.rpartition('.')[2]}{sep}{name}"


def _at_yours(row: dict) -> str:
    """remat's measured peak over the user's program's, or the minimum it refused with."""
    if row.get("remat at yours refused"):
        refused = row["remat at yours refused"]
        return f"refused: needs {refused / row['yours peak']:.3f}"
    return fixed(3)(row["remat at yours peak"] / row["yours peak"])


def _ratio(key: str, of: str) -> Callable[[dict], float | None]:
    """A row's ``key`` over its ``of``; None where the row has no ``key`` (a refusal)."""
    return lambda row: None if row.get(key) is None else row[key] / row[of]


SCRIPT_TABLES: dict[str, list] = {
    "planning_llm_depth": [
        ("layers", "layers", plain),
        ("joint nodes", "torch joint nodes", count),
        ("problem nodes", "remat problem nodes", count),
        ("budget", "budget", plain),
        ("torch partition s", "torch partition s", fixed(1)),
        ("remat extract s", "remat extract s", fixed(1)),
        ("remat solve s", "remat solve s", fixed(1)),
        ("remat rewrite s", "remat rewrite s", fixed(1)),
        ("remat plan s", _remat_plan_s, fixed(1)),
        ("torch first step s", "torch first step s", fixed(1)),
        ("remat first step s", "remat first step s", fixed(1)),
        ("solver", "remat solver", plain),
        ("plan cost", "remat plan cost", significant),
        ("gap", _gap_or_refusal, plain),
        ("predicted peak", "remat predicted peak", mib),
    ],
    "first_step": [
        ("model", "model", plain),
        ("compiler", "compiler", plain),
        ("budget (of eager's peak)", "budget", plain),
        ("eager peak", "eager peak", mib),
        ("first step / budget", _first_or_refusal, plain),
        ("later steps / budget", "later / budget", fixed(3)),
        ("grad error", "grad error", significant),
        ("first step s", "first step s", fixed(1)),
    ],
    "as_given": [
        ("model", "model", plain),
        ("your program: peak", "yours peak", mib),
        ("step s", "yours s", fixed(3)),
        ("torch.compile / yours", _ratio("torch.compile peak", "yours peak"), fixed(3)),
        ("remat at your peak: peak / yours", _at_yours, plain),
        ("step / yours", _ratio("remat at yours seconds", "yours s"), fixed(3)),
        ("solver", "remat at yours solver", plain),
        ("grad error", "remat at yours grad error", significant),
        ("remat at 1.0: peak / yours", _ratio("remat 1.0 peak", "yours peak"), fixed(3)),
        ("first step", _ratio("remat 1.0 first peak", "yours peak"), fixed(3)),
        ("step / yours, at 1.0", _ratio("remat 1.0 seconds", "yours s"), fixed(3)),
        ("grad error, at 1.0", "remat 1.0 grad error", significant),
        ("fake eager step s", "fake eager step s", fixed(2)),
    ],
    "step_time": [
        ("budget", "budget", plain),
        ("op", "op", plain),
        ("measured", "measured_s", seconds),
        ("estimated", "estimated_s", seconds),
        ("error", "error", signed_percent),
    ],
    "page_faults": [
        ("model", "model", plain),
        ("allocator", "allocator", plain),
        ("budget", "budget", plain),
        ("step", "step_s", seconds),
        ("spread", "spread", percent(1)),
        ("page faults / step", "faults per step", fixed(0)),
        ("step (est.)", "estimated_s", seconds),
        ("est. err", "error", signed_percent),
    ],
    "step_with_graph_break": [
        ("fraction of eager", "fraction of eager", plain),
        ("budget", "budget", mib),
        ("step 1 peak", "step 1 peak", mib),
        ("step 1 predicted", "first step predicted", mib),
        ("step 2 peak", "step 2 peak", mib),
        ("predicted", "predicted", mib),
        ("graphs", "graphs", plain),
        ("eager peak", "eager peak", mib),
    ],
    "reversible_depth": [
        ("depth", "depth", plain),
        ("reversible loss", "reversible loss", plain),
        ("ordinary loss", "ordinary loss", plain),
        ("reversible peak", "reversible peak", _mib2),
        ("ordinary peak", "ordinary peak", _mib2),
        ("reversible less grads", "reversible less grads", _mib2),
        ("ordinary less grads", "ordinary less grads", _mib2),
        ("grads", "grads", plain),
        ("remat.optimize(budget=1.0): predicted", "optimize predicted", _bytes_exact),
        ("measured", "optimize measured", _bytes_exact),
    ],
    "plan_cache": [
        ("process", "process", plain),
        ("nodes", "nodes", count),
        ("first step s", "first step s", fixed(1)),
        ("plan s", "plan s", fixed(1)),
        ("extract s", "extract s", fixed(1)),
        ("solve s", "solve s", fixed(1)),
        ("rewrite s", "rewrite s", fixed(1)),
        ("later step s", "later step s", fixed(1)),
        ("compile s", "compile s", fixed(1)),
        ("cache", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["cache"].items())), plain),
    ],
    "ddp": [
        ("step", "step", plain),
        ("rank 0", "rank 0 peak", _bytes_exact),
        ("rank 1", "rank 1 peak", _bytes_exact),
        ("predicted", "predicted", _bytes_exact),
        ("budget", "budget", _bytes_exact),
        ("parameters", "parameters", _bytes_exact),
    ],
    "torch_versions": [
        ("torch", "installed", plain),
        ("torch kept by pip install -e .", lambda r: "yes" if r["torch kept"] else "no", plain),
        ("passed", "passed", count),
        ("failed", "failed", count),
        ("skipped", "skipped", count),
        ("fast tests s", "tests s", fixed(0)),
        ("main job", "main job", plain),
        ("main job s", "main job s", fixed(0)),
        ("failed tests", lambda r: ", ".join(map(_test_name, r["failures"])), plain),
    ],
    "fsdp2": [
        ("budget", "budget", plain),
        (
            "measured peak",
            lambda r: (
                _bytes_exact(r.get("measured peak"))
                or f"refused, naming the step's minimum {r['refused, minimum']:,} B"
            ),
            plain,
        ),
        ("predicted", "predicted", _bytes_exact),
        ("budget bytes", "budget bytes", _bytes_exact),
    ],
    "fsdp2_first_step": [
        ("budget", "budget", plain),
        ("rank 0", "rank 0 peak", _bytes_exact),
        ("rank 1", "rank 1 peak", _bytes_exact),
        ("predicted", "predicted", _bytes_exact),
        ("budget bytes", "budget bytes", _bytes_exact),
        ("held per block", "held per block", _bytes_exact),
    ],
}


def space_time(data: dict) -> str:
    """space_time_curve's rows, one line per depth: each plan's measured peak and the
    forward work it adds (estimated time beyond one forward pass)."""
    methods = ("store-all", "sqrt", "revolve", "auto")
    by_depth: dict[int, dict[str, dict]] = {}
    for r in data["rows"]:
        by_depth.setdefault(r["L"], {})[r["method"]] = r
    headers = ["L", "stages", *(f"peak, {m}" for m in methods)]
    headers += [f"extra time, {m}" for m in methods[1:]]
    headers += ["predicted = measured", "vs eager"]
    body = []
    for depth, rows in sorted(by_depth.items()):
        mine = [rows[m] for m in methods if m in rows]
        auto = rows.get("auto", {})
        body.append(
            [
                str(depth),
                str(mine[0]["stages"]),
                *(_mib2(rows[m]["measured"]) if m in rows else "" for m in methods),
                *(f"{rows[m]['extra time']:+.0%}" if m in rows else "" for m in methods[1:]),
                "yes" if all(r["measured"] == r["predicted"] for r in mine) else "no",
                "exact" if all(r["vs eager"] == "exact" for r in mine) else "differs",
            ]
        )
        if auto and auto.get("solver") != "revolve":
            body[-1][5] += f" ({auto['solver']})"
    return table(headers, body)


def space_time_fits(data: dict) -> str:
    """space_time_curve's fits, one line per plan: the peak's growth with depth, and the
    growth of the peak less the parameters' gradients."""
    fits: dict[str, dict[str, dict]] = {}
    for f in data["fits"]:
        fits.setdefault(f["method"], {})[f["of"]] = f
    body = [
        [
            method,
            f"{of['peak']['log-log slope']:.3f}",
            f"{of['peak']['R^2']:.3f}",
            f"{of['peak - grads']['log-log slope']:.3f}",
            f"{of['peak - grads']['R^2']:.3f}",
            f"{of['peak - grads']['MiB per doubling']:.3f}",
            f"{of['peak - grads']['R^2 (vs log2 L)']:.3f}",
        ]
        for method, of in fits.items()
    ]
    headers = ["method", "log-log slope", "R^2", "less grads: log-log slope", "R^2"]
    headers += ["MiB per doubling of L", "R^2 (vs log2 L)"]
    return table(headers, body)


def hf_zoo(data: list[dict]) -> str:
    """hf_zoo's rows, one line per model, its budgets side by side: the measured peak (or
    the refusal) against the prediction."""
    models: dict[str, dict[float, dict]] = {}
    for r in data:
        models.setdefault(r["model"], {})[r["budget"]] = r
    budgets = list(dict.fromkeys(r["budget"] for r in data))

    def cell(r: dict) -> list[str]:
        if r.get("refused"):
            return [f"refused: {r['refused']} of store-all", "", "", ""]
        same = "= predicted" if r["measured peak"] == r["predicted peak"] else "differs"
        grads = "eager's" if r["grad error"] <= GRAD_TOLERANCE else f"{r['grad error']:.1e}"
        return [
            f"{r['measured peak']:,} B {same}",
            r["solver"],
            grads,
            f"{r['first step s']:.1f} s",
        ]

    headers = ["model", "graphs", "store-all peak"]
    for b in budgets:
        headers += [f"{b:g}: measured peak", "solver", "grads", "first step"]
    body = []
    for model, rows in models.items():
        done = next(r for r in rows.values() if not r.get("refused"))
        line = [model, str(done["graphs"]), f"{done['store-all peak']:,} B"]
        for b in budgets:
            line += cell(rows[b]) if b in rows else ["", "", "", ""]
        body.append(line)
    return table(headers, body)


def reversible_numerics(data: list[dict]) -> str:
    """reversible.py's rows, one line per init and depth, the dtypes side by side."""
    keys = ("inverse", "grad vs ordinary", "ordinary vs float64")
    lines: dict[tuple, dict[str, dict]] = {}
    for r in data:
        lines.setdefault((r["init"], r["depth"]), {})[r["dtype"]] = r
    dtypes = list(dict.fromkeys(r["dtype"] for r in data))
    headers = ["init", "depth", *(f"{k}, {d}" for d in dtypes for k in keys), "growth"]
    body = [
        [
            init,
            str(depth),
            *(f"{rows[d][k]:.2g}" for d in dtypes for k in keys),
            f"{rows[dtypes[0]]['growth']:.2f}",
        ]
        for (init, depth), rows in lines.items()
    ]
    return table(headers, body)


def _kind(data: list[dict], kind: str) -> list[dict]:
    return [r for r in data if r.get("kind") == kind]


def varying_sizes(data: list[dict], view: str | None) -> str:
    """``varying_sizes.py``'s rows: per step (lengths, times, peaks, what remat did), or
    (``summary``) per run."""
    if view == "summary":
        return columns(_kind(data, "summary"), [
            ("run", "run", plain),
            ("total s", "total s", fixed(1)),
            ("median step s", "median step s", fixed(3)),
            ("traces", "traces", plain),
            ("graph plans", "plans", plain),
            ("step plans", "step plans", plain),
            ("worst peak / budget", "worst peak / budget", fixed(3)),
            ("grads equal", "grads equal", plain),
            ("first trace+plan s", "first trace+plan s", fixed(1)),
            ("serve a new size s", "serve a new size s (median)", fixed(3)),
            ("total / (2 traces + 2x eager)", "total / (2 traces + 2x eager)", fixed(2)),
            ("meets the mark", "meets the mark", plain),
        ])  # fmt: skip
    steps = {(r["run"], r["step"]): r for r in _kind(data, "step")}
    rows = []
    for (run, step), r in sorted(steps.items(), key=lambda kv: kv[0][1]):
        if run != "eager":
            continue
        remat, static = steps[("remat", step)], steps[("remat, static shapes", step)]
        declared = steps[("remat, declared maximum", step)]
        rows.append({
            "step": step, "length": r["length"], "eager s": r["seconds"],
            "eager peak": r["peak"], "remat s": remat["seconds"], "remat peak": remat["peak"],
            "remat work": _work(remat), "declared s": declared["seconds"],
            "declared peak": declared["peak"], "declared work": _work(declared),
            "static shapes s": static["seconds"],
        })  # fmt: skip
    return columns(rows, [
        ("step", "step", plain),
        ("length", "length", plain),
        ("eager s", "eager s", fixed(3)),
        ("eager peak", "eager peak", mib),
        ("remat s", "remat s", fixed(3)),
        ("remat peak", "remat peak", mib),
        ("remat did", "remat work", plain),
        ("declared s", "declared s", fixed(3)),
        ("declared peak", "declared peak", mib),
        ("declared did", "declared work", plain),
        ("static shapes s", "static shapes s", fixed(3)),
    ])  # fmt: skip


def _work(row: dict) -> str:
    """What remat did at a step (``varying_sizes.work``, which this script cannot import:
    it runs without torch)."""
    if row["traced"]:
        return "trace+plan"
    if row["planned"]:
        return "plan"
    return "step plan" if row.get("step planned") else ""


def trainer_lengths(data: list[dict], view: str | None) -> str:
    """``trainer_lengths.py``'s rows: the summary, or (``steps``) step by step."""
    if view == "steps":
        return columns(_kind(data, "step"), [
            ("step", "step", plain),
            ("eager s", "eager s", fixed(4)),
            ("remat s", "remat s", fixed(4)),
            ("remat did", "remat work", plain),
            ("loss", "eager loss", fixed(4)),
        ])  # fmt: skip
    return columns(_kind(data, "summary"), [
        ("steps", "steps", plain),
        ("losses equal", "losses equal", plain),
        ("eager median s", "eager median s", fixed(4)),
        ("remat median s", "remat median s", fixed(4)),
        ("median ratio", "median ratio", fixed(2)),
        ("traces", "traces", plain),
        ("steps that planned", "plans", plain),
        ("slowest step not tracing / eager median", "slowest step not tracing / eager median",
         fixed(2)),
    ])  # fmt: skip


def cuda_check(data: dict) -> str:
    """benchmarks/cuda_check.py's result: the device, each bench table as ``remat bench``
    prints it, then every check, and what the deadline left unmeasured."""
    m = data["machine"]
    sizes = ", ".join(f"{k} {v}" for k, v in m["sizes"].items())
    parts = [f"{m['device name']} (CUDA {m['cuda']}), torch {m['torch']}; {sizes}."]
    for b in data["bench"]:
        parts.append(f"`{b['model']}`, {b['dtype']}:\n\n{bench_table(b)}")
    checks = [("bench " + b["model"] + " " + b["dtype"], b["checks"]) for b in data["bench"]]
    checks += [(name, data[name]["checks"]) for name in ("dropout", "reversible") if name in data]
    body = [
        [s, c["check"], "ok" if c["ok"] else "FAILED", c["detail"]] for s, cs in checks for c in cs
    ]
    parts.append(table(["section", "check", "verdict", "detail"], body))
    parts += [f"Not measured: {what}." for what in data.get("not measured", [])]
    return "\n\n".join(parts)


# scripts whose runs are recorded apart (per model, or per compiler), each named SCRIPT_PART
PER_MODEL = ("step_time", "page_faults", "first_step")


def script_table(name: str, view: str | None, data) -> str:
    if name.startswith("varying_sizes"):
        return varying_sizes(data, view)
    if name == "trainer_lengths":
        return trainer_lengths(data, view)
    if name.startswith("solvers_"):
        return solver_pairs(data)
    if name == "space_time":
        return space_time(data) if view is None else space_time_fits(data)
    if name == "hf_zoo":
        return hf_zoo(data)
    if name == "reversible_numerics":
        return reversible_numerics(data)
    if name == "cuda_check":
        return cuda_check(data)
    for script in PER_MODEL:  # the script's table of another model
        if name.startswith(f"{script}_"):
            return columns(data, SCRIPT_TABLES[script])
    return columns(data, SCRIPT_TABLES[name])


# ------------------------------------------------------------------------- the page


def provenance_line(prov: dict) -> str:
    """How a table was made, in one line: command, commit, machine."""
    how = f"Made by `{prov['command']}` at `{prov['commit'][:7]}`, {prov['machine']}."
    if prov.get("carried_over"):
        how += f" Carried over: {prov['carried_over']}"
    return how


def render_table(name: str, view: str | None, results: dict[str, dict]) -> str:
    result = results[name]
    data = result["data"]
    bench = isinstance(data, dict) and "meta" in data and "rows" in data
    if bench:
        body = bench_table(data)
    else:
        body = script_table(name, view, data)
    return f"{body}\n\n{provenance_line(result['provenance'])}"


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def render(text: str, results: dict[str, dict]) -> str:
    """The page: ``text`` with every directive replaced by its table."""
    used: set[str] = set()
    out: list[str] = []
    for line in text.splitlines():
        match = DIRECTIVE.match(line.strip())
        if match is None:
            out.append(line)
            continue
        kind, args = match.group(1), match.group(2).split()
        missing = [a for a in (args if kind == "summary" else args[:1]) if a not in results]
        if missing:
            raise SystemExit(f"{TEXT.name} names results that do not exist: {missing}")
        if kind == "summary":
            out.append(summary(args, results))
        else:
            name, view = args[0], (args[1] if len(args) > 1 else None)
            used.add(name)
            out.append(render_table(name, view, results))
    unused = sorted(set(results) - used)
    if unused:
        raise SystemExit(f"results no table of {TEXT.name} shows: {unused}")
    return "\n".join(out).rstrip("\n") + "\n"


def build(out: Path = PAGE) -> None:
    out.write_text(render(TEXT.read_text(), load_results()))


# ------------------------------------------------------------------- recording a run


def machine(note: str | None = None) -> str:
    """This machine, as a provenance line names it: CPU model, cores, torch (and
    transformers where installed)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"CPU, {os.cpu_count()} cores ({model})"]
    for package in ("torch", "transformers"):
        try:
            parts.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    if note:
        parts.append(note)
    return ", ".join(parts)


def record(name: str, raw: Path, command: str, note: str | None) -> Path:
    """Write ``results/NAME.json``: the run's JSON with its provenance around it."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    provenance = {
        "command": command,
        "commit": commit,
        "machine": machine(note),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(raw.read_text())
    path.write_text(json.dumps({"provenance": provenance, "data": data}, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        parser = argparse.ArgumentParser(prog=f"{COMMAND} record")
        parser.add_argument("name", help="the result's name: benchmarks/results/NAME.json")
        parser.add_argument("raw", type=Path, help="the JSON the benchmark wrote")
        parser.add_argument("--command", required=True, help="the command that wrote it")
        parser.add_argument("--machine-note", help="appended to the machine (e.g. its load)")
        args = parser.parse_args(argv[1:])
        print(record(args.name, args.raw, args.command, args.machine_note))
        return 0
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PAGE, help="default: docs/benchmarks.md")
    args = parser.parse_args(argv)
    build(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
