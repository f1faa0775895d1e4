"""The ``remat`` command line's help texts, built from the registries they describe
(``SOLVERS``, ``COST_MODELS``, ``COMPILERS``, ``EXAMPLES``), so that a solver or model added
there is described everywhere at once, in its own docstring's words."""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap
from collections.abc import Sequence

from remat.solvers import SOLVERS
from remat.solvers.cpsat import DEFAULT_LIMIT, EXTRA_LIMIT, GAP_LIMIT, NODES_PER_LIMIT_SECOND
from remat.solvers.solve import CPSAT_SOLVERS

__all__ = [
    "COMPILER_TEXT",
    "COST_MODEL_TEXT",
    "HelpFormatter",
    "choice_lines",
    "listed",
    "model_help",
    "solver_help",
    "solver_names",
    "time_limit_help",
]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, except that an option's help keeps its own line breaks: one line
    per choice (``choice_lines``), each wrapped by itself (an indented line's continuation
    indented further), and no name broken at its hyphens (store-all, recompute-all)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines = []
        for line in text.splitlines():
            indent = line[: len(line) - len(line.lstrip())]
            wrapped = textwrap.wrap(
                " ".join(line.split()),
                width,
                initial_indent=indent,
                subsequent_indent=indent + "  " if indent else "",
                break_on_hyphens=False,
            )
            lines += wrapped or [""]
        return lines


# What each name in the registries ``remat.costs.COST_MODELS`` and ``COMPILERS`` stands for
# (the registries name them only); tests/tools/test_cli.py checks that every name has one.
COST_MODEL_TEXT = {
    "roofline": "estimated from each op's flops and bytes",
    "profile": "each distinct op timed on the device (slower to plan)",
}
COMPILER_TEXT = {
    "eager": "plain fx run as Python, op by op in the program's order",
    "inductor": "inductor's fused kernels (experimental with remat)",
}


def solver_names() -> list[str]:
    """``SOLVERS``' names: its first (the default) first, the others sorted."""
    default, *others = SOLVERS
    return [default, *sorted(others)]


def first_sentence(obj) -> str:
    """The first sentence of ``obj``'s docstring, literals unquoted: what help says of it."""
    text = " ".join((inspect.getdoc(obj) or "").split()).replace("``", "")
    match = re.match(r".+?[.!?](?=\s|$)", text)
    return match.group(0) if match else text


def choice_lines(heading: str, texts: dict[str, str], names: Sequence[str], default: str) -> str:
    """``heading (default D):`` (``heading`` as argparse takes it: %% for %), then one line
    per name in ``names``, ``name: what it is`` from ``texts``, escaped for argparse."""
    lines = [f"  {name}: {texts.get(name, '')}".rstrip().replace("%", "%%") for name in names]
    return "\n".join([f"{heading} (default {default}):", *lines])


def solver_help() -> str:
    """--solver's help: each solver with its docstring's first sentence."""
    texts = {name: first_sentence(SOLVERS[name]) for name in SOLVERS}
    names = solver_names()
    return choice_lines("planning algorithm", texts, names, names[0])


def time_limit_help() -> str:
    """--time-limit's help: CP-SAT's default limits, and the solvers that run CP-SAT."""
    text = (
        f"CP-SAT's whole limit per graph, in its deterministic seconds (default "
        f"{DEFAULT_LIMIT:g}; beyond {DEFAULT_LIMIT * NODES_PER_LIMIT_SECOND:,.0f} nodes, "
        f"nodes / {NODES_PER_LIMIT_SECOND:,}; and up to {EXTRA_LIMIT:g} more where the plan "
        f"is not proven within {GAP_LIMIT:.0%} by then); for the solvers "
        f"{listed(CPSAT_SOLVERS)}. Wall times and gaps: docs/benchmarks.md#solvers-at-scale"
    )
    return text.replace("%", "%%")


def listed(names: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    if len(names) < 2:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"


def model_help() -> str:
    """MODEL's help: each built-in example with its factory's docstring's first sentence."""
    from remat.tools.examples import EXAMPLES

    texts = {name: first_sentence(factory) for name, factory in EXAMPLES.items()}
    lines = [f"  {name}: {texts[name]}".replace("%", "%%") for name in sorted(EXAMPLES)]
    heading = (
        "a built-in example or package.module:factory (importable, or in the current "
        "folder), a function returning (model, example_inputs) whose model(*example_inputs) "
        "is a scalar loss; the built-ins:"
    )
    return "\n".join([heading, *lines])
