"""What a user may write as a budget, and what it means in bytes."""

from __future__ import annotations

import re

from .plan import format_bytes

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")

Budget = int | float | str


def parse_budget(budget: Budget) -> int | float:
    """Normalise a budget: bytes as ``int``, a fraction of the store-all peak as ``float``.

    Accepts ``int`` bytes, ``float`` fractions in (0, 1], ``"40%"``, ``"0.4"``,
    ``"512MiB"``, ``"2GB"``, ``"1073741824"``.
    """
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int), a fraction (float) or a string like '2GiB'")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(
                f"a float budget is a fraction of the store-all peak in (0, 1], got {budget};"
                " give bytes as an int or a string like '512MiB'"
            )
        return budget
    if isinstance(budget, str):
        if m := _PERCENT.match(budget):
            return parse_budget(float(m.group(1)) / 100)
        if m := _SIZE.match(budget):
            number, unit = m.group(1), m.group(2).lower()
            if unit not in _UNITS:
                raise ValueError(
                    f"unknown unit {m.group(2)!r} in budget {budget!r}; use {_units()}"
                )
            if unit == "" and "." in number:
                return parse_budget(float(number))
            return parse_budget(int(float(number) * _UNITS[unit]))
        raise ValueError(f"cannot read budget {budget!r}; write e.g. '512MiB', '2GB', '40%' or 0.4")
    raise TypeError(f"budget must be int, float or str, got {type(budget).__name__}")


def resolve_budget(budget: Budget, store_all_peak: int) -> int:
    """Bytes for ``budget``; fractions scale the store-all peak of the same graph."""
    value = parse_budget(budget)
    if isinstance(value, float):
        return int(value * store_all_peak)
    return value


class InfeasibleBudget(ValueError):
    """The budget is below the smallest peak remat can reach; ``minimum`` names it.

    ``proven``: a solver proved that no plan at all fits the budget (not only that it
    found none). ``graph``: what was planned (a graph's name, or ``step (...)`` for the
    graphs of a step planned together). ``note``: said last.
    """

    def __init__(
        self,
        budget: int,
        minimum: int,
        store_all: int,
        graph: str = "",
        proven: bool = False,
        note: str = "",
    ) -> None:
        self.budget, self.minimum, self.store_all = budget, minimum, store_all
        self.proven = proven
        where = f" for {graph}" if graph.startswith("step") else f" for graph {graph}"
        proof = " No plan fits this budget (proven by CP-SAT)." if proven else ""
        super().__init__(
            f"budget {format_bytes(budget)} is below the smallest peak remat can reach"
            f"{where if graph else ''}: {format_bytes(minimum)} ({minimum} bytes, "
            f"{minimum / max(store_all, 1):.1%} of the store-all peak {format_bytes(store_all)})."
            f"{proof} Raise the budget to at least {minimum} bytes." + (f" {note}" if note else "")
        )


def _units() -> str:
    return ", ".join(u for u in ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"))
