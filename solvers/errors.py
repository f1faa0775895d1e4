"""Errors that are verdicts on a user's request, not bugs in remat.

Every one is a ``RematError``: front ends (the CLI, the bench) report one by type as one
line and treat anything else as a bug. Each also derives from the builtin a caller would
expect (``ValueError`` for a bad value), so ``except ValueError`` keeps working.
``remat.errors`` re-exports these beside the ones that need torch.
"""

from __future__ import annotations

from .units import format_apart, format_bytes


class RematError(Exception):
    """A request remat refuses, with a message that says what to do instead."""


class InvalidOption(RematError, ValueError):
    """An option remat cannot read: an unknown solver, cost model or compiler name, or a
    budget it cannot parse."""


class InfeasibleBudget(RematError, ValueError):
    """The budget is below the lowest peak remat can reach; ``minimum`` names it.

    ``minimum`` depends on what was planned, never on the budget asked: the lowest peak
    remat's search found (``solvers.lowest_peak``), a budget a retry meets.
    ``lowest_proven``: CP-SAT proved no plan that recomputes each value at most once peaks
    below it. ``proven``: CP-SAT proved no such plan fits this budget (not only that none
    was found). ``graph``: what was planned (a graph's name, or ``step (...)`` for the
    graphs of a step planned together). ``reference``: what a fraction budget is of, where
    not ``store_all`` (the user's own checkpointed program, where it peaks lower).
    ``note``: said last.
    """

    def __init__(
        self,
        limit: int,
        minimum: int,
        store_all: int,
        graph: str = "",
        proven: bool = False,
        note: str = "",
        *,
        lowest_proven: bool = False,
        reference: int | None = None,
    ) -> None:
        self.limit, self.minimum, self.store_all = limit, minimum, store_all
        self.graph, self.proven, self.lowest_proven = graph, proven, lowest_proven
        self.reference = store_all if reference is None else reference
        self.note = note
        where = f" for {graph}" if graph.startswith("step") else f" for graph {graph}"
        asked, lowest = format_apart(limit, minimum)
        if lowest_proven:
            what = "the proven lowest peak"
            proof = " CP-SAT proved that no plan recomputing each value at most once peaks lower."
        else:
            what = "the lowest peak remat found"
            proof = (
                " No plan that recomputes each value at most once fits this budget (proven "
                "by CP-SAT)." if proven else ""
            )  # fmt: skip
        fraction = needed_fraction(minimum, self.reference)
        as_fraction = "" if fraction is None else f", or {fraction} as a fraction"
        super().__init__(
            f"budget {asked} is below {what}{where if graph else ''}: {lowest} ({minimum} "
            f"bytes, {minimum / max(store_all, 1):.1%} of the store-all peak "
            f"{format_bytes(store_all)}).{proof} Raise the budget to at least {minimum} "
            f'bytes (budget="{minimum}B"{as_fraction}), or pass budget="min" for the lowest '
            "peak." + (f" {note}" if note else "")
        )


def needed_fraction(minimum: int, reference: int) -> float | None:
    """The smallest fraction, in thousandths, whose budget against ``reference`` bytes is at
    least ``minimum`` (``Budget.resolve`` rounds down); None above 1."""
    thousandths = -(-minimum * 1000 // max(reference, 1))
    while int(thousandths / 1000 * reference) < minimum:
        thousandths += 1
    return thousandths / 1000 if thousandths <= 1000 else None


class SolverOverBudget(RematError, ValueError):
    """A solver's plan peaks over a budget that some plan meets: a fixed strategy
    (``store-all``, ``recompute-all``) or a user's solver that does not adapt to it."""
