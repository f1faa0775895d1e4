"""Argument types of the ``remat`` command line: text to a value, or one line saying what
was expected (argparse prints it as a usage error)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from remat.costs import COST_MODELS
from remat.tools.helptext import solver_names

__all__ = [
    "cost_model_list",
    "non_negative",
    "number",
    "points",
    "positive",
    "positive_float",
    "size_option",
    "solver_list",
]


def size_option(text: str) -> tuple[str, Any]:
    """An argparse type for ``--size key=value`` (the benchmark scripts take it too)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value (e.g. layers=4), got {text!r}")
    return key.strip(), _literal(value.strip())


def _literal(value: str) -> Any:
    """'4' -> 4, '0.1' -> 0.1, 'true' -> True, 'none' -> None, anything else stays a string."""
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


def number(cast, accept, expected: str):
    """An argparse type: ``cast`` the text, keep it if ``accept``, else say what was expected."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive = number(int, lambda v: v >= 1, "a positive integer")
non_negative = number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = number(float, lambda v: v > 0, "a positive number")


def cost_model_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    bad = [n for n in names if n not in COST_MODELS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown cost model(s) {', '.join(map(repr, bad))}; choose from "
            f"{', '.join(COST_MODELS)}"
        )
    return list(dict.fromkeys(names))


def solver_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    for name in names:
        if name not in solver_names():
            raise argparse.ArgumentTypeError(
                f"unknown solver {name!r}; choose from {', '.join(solver_names())}"
            )
    return list(dict.fromkeys(names))


def points(text: str) -> int:
    value = positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 points, got {text!r}")
    return value
