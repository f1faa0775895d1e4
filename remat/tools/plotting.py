"""Plots the commands write (matplotlib, the optional 'plot' extra): a step's memory over
time (``--timeline``), with its data as JSON beside the PNG so the numbers can be checked
and replotted without matplotlib."""

from __future__ import annotations

import json
from pathlib import Path

from remat.solvers import format_bytes

__all__ = ["pyplot", "write_timeline_plot"]

UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def pyplot(option: str):
    """``matplotlib.pyplot`` on the file-only Agg backend, or an ImportError telling how to
    install it (``option`` is what asked for a plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f"{option} needs matplotlib: install the 'plot' extra (pip install -e '.[plot]', "
            "or pip install matplotlib)"
        ) from e
    return plt


def write_timeline_plot(data: dict, path: str | Path, *, title: str = "") -> Path:
    """Plot ``data`` (``StepTimeline.to_dict()``, with ``measured`` where a step was
    measured) to ``path`` (a PNG) and write ``data`` beside it as JSON; the JSON's path."""
    plt = pyplot("--timeline")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    beside = path.with_suffix(".json")
    beside.write_text(json.dumps(data, indent=2) + "\n")

    measured = data.get("measured")
    top = max(data["store_all"]["peak_bytes"], (measured or {}).get("peak_bytes", 0))
    unit, scale = next((u, s) for u, s in UNITS if top >= s or s == 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label, style in (("store_all", "store all", "--"), ("predicted", "remat plan", "-")):
        series = data[key]
        ax.plot(
            _progress(len(series["bytes"])),
            [b / scale for b in series["bytes"]],
            style,
            label=f"{label}, predicted (peak {format_bytes(series['peak_bytes'])})",
        )
    if measured:  # by event, not time: a pause (dynamo's guards) would squash the rest
        ax.plot(
            _progress(len(measured["bytes"])),
            [b / scale for b in measured["bytes"]],
            "-",
            alpha=0.7,
            label=f"remat, measured (peak {format_bytes(measured['peak_bytes'])})",
        )
    ax.axhline(
        data["limit_bytes"] / scale,
        color="red",
        linestyle=":",
        label=f"budget ({format_bytes(data['limit_bytes'])})",
    )
    predicted = data["predicted"]
    start = predicted["backward_starts_at"] / max(len(predicted["bytes"]) - 1, 1)
    ax.axvline(start, color="grey", linestyle=":", linewidth=1)
    ax.annotate(
        "remat's backward", (start, 0), xytext=(4, 4), textcoords="offset points", fontsize=8
    )
    ax.set_xlabel("progress through the step (predicted: ops run; measured: allocations and frees)")
    ax.set_ylabel(f"live memory ({unit} above what the step starts with)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return beside


def _progress(n: int) -> list[float]:
    """``n`` points spread evenly over [0, 1]."""
    return [i / max(n - 1, 1) for i in range(n)]
