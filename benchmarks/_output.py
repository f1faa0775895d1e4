"""A benchmark script's rows (a list of flat dicts): chosen by name, shown as they come,
written as JSON and CSV; the parser and models of a script over transformers; and the
parser and warmed-up model of a script that times an example's steps under remat."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate

import remat
from remat.tools.arguments import size_option
from remat.tools.examples import load


def write_rows(rows: list[dict], json_path: Path | None, csv_path: Path | None) -> None:
    """Write ``rows`` to whichever of the two paths is given (creating folders)."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows, indent=2))
    if csv_path and rows:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as f:
            fields = list(dict.fromkeys(k for row in rows for k in row))  # a refusal's too
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


def chosen(parser: argparse.ArgumentParser, text: str, known) -> list[str]:
    """The comma-separated names in ``text``; a usage error naming any not in ``known``."""
    names = text.split(",")
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(known)}")
    return names


def shown(rows: list[dict], row: dict) -> None:
    """Keep ``row`` and print it at once, so a long run shows its progress."""
    rows.append(row)
    print(tabulate([row], headers="keys", floatfmt=".3g"), flush=True)


def finished(rows: list[dict], json_path: Path | None, csv_path: Path | None) -> None:
    """Print every row as one table and write them."""
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    write_rows(rows, json_path, csv_path)


def transformers_models(build: Callable) -> dict | None:
    """``build(transformers)``: a script's models by name; None, having said which extra
    installs transformers, where it is missing."""
    try:
        import transformers
    except ImportError:
        print("needs the transformers extra: pip install -e '.[transformers]'", file=sys.stderr)
        return None
    return build(transformers)


def model_parser(doc: str, known) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first line, ``--models`` (comma-separated, of
    ``known``, all of them by default), ``--json`` and ``--csv``; the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", default=",".join(known),
                        help="comma-separated, of: " + ", ".join(known))  # fmt: skip
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    return parser


def step_parser(doc: str, model: str, budgets: str, steps: int) -> argparse.ArgumentParser:
    """A parser for a script that times an example model's steps under remat: MODEL
    (default ``model``), ``--size``, ``--budgets``, ``--threads``, ``--steps``, ``--json``
    and ``--csv``; the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model", nargs="?", default=model)
    parser.add_argument("--size", action="append", default=[], type=size_option)
    parser.add_argument("--budgets", default=budgets)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    return parser


def warmed_up(model_spec: str, size: dict, budget: float) -> tuple:
    """``(model, inputs, optimized)``: the example seeded, under ``remat.optimize`` at
    ``budget`` with the plan cache off (planning runs), after two untimed steps, so that
    the steps a script times next are a training loop's steady state."""
    torch.manual_seed(0)
    model, inputs = load(model_spec, **size)
    optimized = remat.optimize(model, budget=budget, cache=False)
    for _ in range(2):
        optimized(*inputs).backward()
        model.zero_grad(set_to_none=True)
    return model, inputs, optimized
