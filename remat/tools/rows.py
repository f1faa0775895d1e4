"""A benchmark's rows: what one configuration measured, how rows compare (who dominates
whom, the frontier), and the table, CSV, JSON and plot they are shown as."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from remat.solvers import format_bytes
from remat.tools.plotting import pyplot

__all__ = [
    "Row",
    "dominates",
    "fastest_within",
    "frontier",
    "plot_rows",
    "rounds_faster",
    "rows_table",
    "write_csv",
    "write_json",
]

# Above this relative difference from eager's gradients a configuration trains on other
# gradients (a wrong dropout mask gives ~0.1); reordered float sums stay near 1e-6.
GRAD_TOLERANCE = 1e-3


@dataclass
class Row:
    """One configuration's measurements. Bytes are ints, times seconds; ``None`` where a
    column does not apply (or the configuration failed: then ``error`` says why)."""

    method: str
    budget: float | int | None = None
    solver: str | None = None
    cost_model: str | None = None  # remat: "roofline" or "profile"
    compiler: str | None = None
    peak_bytes: int | None = None
    step_s: float | None = None
    spread: float | None = None  # half the step times' interquartile range / step_s
    overhead: float | None = None  # step_s / eager's step_s - 1
    compile_s: float | None = None
    plan_s: float | None = None  # remat: planning time of all graphs
    budget_bytes: int | None = None  # remat: the budget in bytes (fractions resolved)
    predicted_peak: int | None = None  # remat: the plan's predicted peak
    predicted_s: float | None = None  # remat: the plans' estimated step time (cost model)
    gap: float | None = None  # remat: solver's optimality gap (None: heuristic, no bound)
    status: str | None = None  # remat: plan status (optimal / feasible / heuristic)
    graphs: int | None = None
    grad_error: float | None = None  # max |grad - reference's| / max |reference's|, same seed
    grad_reference: str | None = None  # "eager", or "torch.compile" (``bench._first_step``)
    error: str | None = None
    times: list[float] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        if self.method == "remat":
            return f"remat {_solver_text(self)} @ {_budget_text(self.budget)}"
        if self.method == "torch":
            return f"torch min-cut @ {_budget_text(self.budget)}"
        return self.method

    @property
    def grads_ok(self) -> bool:
        """Gradients equal eager's (within float reordering), or were not compared."""
        return self.grad_error is None or self.grad_error <= GRAD_TOLERANCE

    def record(self) -> dict[str, Any]:
        """The row as plain data (JSON), with the individual step times (``times``)."""
        out = asdict(self)
        out["label"] = self.label
        return out


def dominates(rows: Sequence[Row], *, slack: float = 1.02) -> list[tuple[Row, Row | None]]:
    """For each measured torch row whose gradients are eager's, the remat row (gradients
    eager's too) with peak <= its peak and time <= slack x its time (the fastest such), or
    None when no remat row does. Rows with wrong gradients are not points of a curve."""
    out = []
    for t in rows:
        if t.method != "torch" or t.step_s is None or not t.grads_ok:
            continue
        best = fastest_within(rows, t.peak_bytes)
        out.append((t, best if best is not None and best.step_s <= slack * t.step_s else None))
    return out


def fastest_within(rows: Sequence[Row], peak_bytes: int) -> Row | None:
    """The fastest measured remat row (gradients eager's) whose peak is <= ``peak_bytes``."""
    ok = [
        r
        for r in rows
        if r.method == "remat"
        and r.step_s is not None
        and r.grads_ok
        and r.peak_bytes <= peak_bytes
    ]
    return min(ok, key=lambda r: r.step_s, default=None)


def rounds_faster(a: Row, b: Row) -> tuple[int, int]:
    """In how many timed rounds ``a``'s step was faster than ``b``'s, out of how many.

    Each round runs every configuration once, so a round pairs two steps taken close in
    time and drift of the machine between rounds cancels: a second reading where two
    medians differ by less than their spread (8 of 15 is a tie, 15 of 15 is not)."""
    pairs = list(zip(a.times, b.times, strict=True))
    return sum(x < y for x, y in pairs), len(pairs)


def frontier(rows: Sequence[Row]) -> list[Row]:
    """Measured rows no other row beats on both peak and time (ties kept)."""
    done = [r for r in rows if r.step_s is not None and r.peak_bytes is not None]
    return [
        r
        for r in done
        if not any(
            o is not r
            and o.peak_bytes <= r.peak_bytes
            and o.step_s <= r.step_s
            and (o.peak_bytes < r.peak_bytes or o.step_s < r.step_s)
            for o in done
        )
    ]


def _budget_text(b) -> str:
    if b is None:
        return "-"
    if isinstance(b, int) and b > 1:
        return format_bytes(b)
    return f"{b:g}"


def _seconds(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


TABLE_HEADERS = (
    "method",
    "budget",
    "solver",
    "peak",
    "vs eager",
    "step",
    "+-",
    "step (est.)",
    "est. err",
    "overhead",
    "compile",
    "predicted",
    "budget bytes",
    "gap",
    "grads",
    "note",
)


def rows_table(rows: Sequence[Row], *, tablefmt: str = "simple") -> str:
    """The benchmark as a tabulate table (``tablefmt="github"`` for markdown)."""
    from tabulate import tabulate

    eager = next((r.peak_bytes for r in rows if r.method == "eager" and r.peak_bytes), None)
    body = []
    for r in rows:
        gap = ""
        if r.method == "remat" and r.error is None:
            gap = "-" if r.gap is None else f"{r.gap:.1%}"
        body.append(
            [
                r.method,
                _budget_text(r.budget),
                _solver_text(r),
                format_bytes(r.peak_bytes) if r.peak_bytes is not None else "",
                f"{r.peak_bytes / eager:.2f}x" if r.peak_bytes is not None and eager else "",
                _seconds(r.step_s),
                f"{r.spread:.1%}" if r.spread is not None else "",
                _seconds(r.predicted_s),
                _estimate_error(r),
                f"{r.overhead:+.1%}" if r.overhead is not None else "",
                f"{r.compile_s:.1f} s" if r.compile_s is not None else "",
                format_bytes(r.predicted_peak) if r.predicted_peak is not None else "",
                format_bytes(r.budget_bytes) if r.budget_bytes is not None else "",
                gap,
                _grads_text(r),
                _note(r.error),
            ]
        )
    return tabulate(body, headers=TABLE_HEADERS, tablefmt=tablefmt, disable_numparse=True)


def _estimate_error(row: Row) -> str:
    """How far the estimated step is from the measured median, signed."""
    if row.predicted_s is None or not row.step_s:
        return ""
    return f"{row.predicted_s / row.step_s - 1:+.0%}"


def _solver_text(row: Row) -> str:
    """The solver, with the cost model when it is not the default roofline."""
    if row.solver is None:
        return ""
    if row.cost_model in (None, "roofline"):
        return row.solver
    return f"{row.solver}, {row.cost_model}"


def _grads_text(row: Row) -> str:
    if row.grad_error is None:
        return ""
    if not row.grads_ok:
        return f"WRONG ({row.grad_error:.1e})"
    return f"= {row.grad_reference or 'eager'}"


def _note(error: str | None) -> str:
    if error is None:
        return ""
    return error if len(error) <= 90 else error[:87] + "..."


def write_json(rows: Sequence[Row], path: str | Path, meta: dict[str, Any] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta or {}, "rows": [r.record() for r in rows]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_csv(rows: Sequence[Row], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = ["label"] + [f.name for f in fields(Row) if f.name != "times"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in rows:
            rec = r.record()
            rec.pop("times")
            writer.writerow({k: "" if rec[k] is None else rec[k] for k in names})


def plot_rows(rows: Sequence[Row], path: str | Path, *, title: str = "") -> None:
    """Peak memory against step time, one curve per method (and remat solver), as a PNG."""
    plt = pyplot("--plot")
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r.step_s is None or r.peak_bytes is None:
            continue
        key = f"remat ({_solver_text(r)})" if r.method == "remat" else r.method
        key = "torch min-cut" if r.method == "torch" else key
        groups.setdefault(key, []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, group in groups.items():
        group = sorted(group, key=lambda r: r.peak_bytes)
        xs = [r.step_s * 1e3 for r in group]
        ys = [r.peak_bytes / 2**20 for r in group]
        style = "o-" if len(group) > 1 else "s"
        ax.plot(xs, ys, style, label=name)
        for r, x, y in zip(group, xs, ys, strict=True):
            if r.budget is not None:
                ax.annotate(_budget_text(r.budget), (x, y), fontsize=7, alpha=0.7)
    ax.set_xlabel("step time (ms, forward + backward, median)")
    ax.set_ylabel("peak memory (MiB, measured)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
