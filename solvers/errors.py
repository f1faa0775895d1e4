"""Errors that are verdicts on a user's request, not bugs in remat.

Every one is a ``RematError``: front ends (the CLI, the bench) report one by type as one
line and treat anything else as a bug. Each also derives from the builtin a caller would
expect (``ValueError`` for a bad value), so ``except ValueError`` keeps working.
``remat.errors`` re-exports these beside the ones that need torch.
"""

from __future__ import annotations

from .units import format_bytes


class RematError(Exception):
    """A request remat refuses, with a message that says what to do instead."""


class InvalidOption(RematError, ValueError):
    """An option remat cannot read: an unknown solver, cost model or compiler name, or a
    budget it cannot parse."""


class InfeasibleBudget(RematError, ValueError):
    """The budget is below the smallest peak remat can reach; ``minimum`` names it.

    ``proven``: a solver proved that no plan at all fits the budget (not only that it
    found none). ``graph``: what was planned (a graph's name, or ``step (...)`` for the
    graphs of a step planned together). ``note``: said last.
    """

    def __init__(
        self,
        limit: int,
        minimum: int,
        store_all: int,
        graph: str = "",
        proven: bool = False,
        note: str = "",
    ) -> None:
        self.limit, self.minimum, self.store_all = limit, minimum, store_all
        self.graph, self.proven = graph, proven
        where = f" for {graph}" if graph.startswith("step") else f" for graph {graph}"
        proof = (
            " No plan that recomputes each value at most once fits this budget (proven by "
            "CP-SAT)." if proven else ""
        )
        super().__init__(
            f"budget {format_bytes(limit)} is below the smallest peak remat can reach"
            f"{where if graph else ''}: {format_bytes(minimum)} ({minimum} bytes, "
            f"{minimum / max(store_all, 1):.1%} of the store-all peak {format_bytes(store_all)})."
            f"{proof} Raise the budget to at least {minimum} bytes." + (f" {note}" if note else "")
        )


class SolverOverBudget(RematError, ValueError):
    """A solver's plan peaks over a budget that some plan meets: a fixed strategy
    (``store-all``, ``recompute-all``) or a user's solver that does not adapt to it."""
