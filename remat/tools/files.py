"""The files the ``remat`` commands write beside what they print: the graphs as DOT
(``--dot``), the report as JSON (``--json``) and the step's memory over time as a plot
with its numbers (``--timeline``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from remat.tools.output import dot
from remat.tools.plotting import write_timeline_plot

__all__ = ["write_dot", "write_report_json", "write_timeline"]


def write_dot(args, graphs, *, with_plan: bool, progress: Callable[[str], None]) -> None:
    """``--dot FILE``: the graphs (and their plans) as Graphviz DOT."""
    if args.dot:
        path = Path(args.dot)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dot(graphs, with_plan=with_plan))
        progress(f"wrote {path} (render: dot -Tsvg {path} -o graph.svg)")


def write_report_json(args, report, progress: Callable[[str], None]) -> None:
    """``--json FILE|-``: ``PlanReport.to_dict()`` with the model and budget asked for."""
    data = {"model": args.model, "budget": str(args.budget), **report.to_dict()}
    text = json.dumps(data, indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
        return
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    progress(f"wrote {path}")


def write_timeline(args, report, measured, progress: Callable[[str], None]) -> None:
    """``--timeline FILE.png``: the step's predicted memory over time against storing
    everything, with the budget (and ``measured``, a ``memory.MemoryTrace``, if any); the
    plotted numbers go to FILE.json beside it."""
    if not args.timeline:
        return
    timeline = report.timeline()
    data = {"model": args.model, "budget": str(args.budget), **timeline.to_dict()}
    if measured is not None:
        data["measured"] = {
            "seconds": list(measured.seconds),
            "bytes": list(measured.live_bytes),
            "peak_bytes": measured.peak_bytes,
        }
    title = f"{args.model}, budget {args.budget}: memory over the step"
    beside = write_timeline_plot(data, args.timeline, title=title)
    progress(f"wrote {args.timeline} and its data, {beside}")
