"""What a user may write as a budget, read once into a ``Budget``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .errors import InvalidOption
from .units import format_bytes

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

@dataclass(frozen=True)
class Budget:
    """A budget read once: ``nbytes`` absolute, or ``fraction`` of the store-all peak of
    the graph (or step) it is applied to. Exactly one is set; build it with ``parse``.
    ``written``: the text it was read from, which messages repeat as the user wrote it."""

    nbytes: int | None = None
    fraction: float | None = None
    written: str = field(default="", compare=False)

    @classmethod
    def parse(cls, budget: BudgetLike) -> Budget:
        """Read ``int`` bytes, a ``float`` fraction in (0, 1], ``"40%"``, ``"0.4"``,
        ``"512MiB"``, ``"2GB"`` or ``"1073741824"``; a ``Budget`` is returned as is.

        Example:
            >>> Budget.parse("40%").resolve(store_all_peak=1000)
            400
            >>> Budget.parse("2GiB").resolve(store_all_peak=1000)  # bytes, whatever the peak
            2147483648
            >>> print(Budget.parse(" 512MiB "))  # as written, for messages
            512MiB
        """
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool):
            raise TypeError(
                "budget must be bytes (int), a fraction (float) or a string like '2GiB'"
            )
        if isinstance(budget, int):
            if budget <= 0:
                raise InvalidOption(f"budget must be positive, got {budget} bytes")
            return cls(nbytes=budget)
        if isinstance(budget, float):
            if not 0.0 < budget <= 1.0:
                raise InvalidOption(
                    f"a float budget is a fraction of the store-all peak in (0, 1], got "
                    f"{budget}; give bytes as an int or a string like '512MiB'"
                )
            return cls(fraction=budget)
        if isinstance(budget, str):
            return replace(cls.parse(_number(budget)), written=budget.strip())
        raise TypeError(f"budget must be int, float or str, got {type(budget).__name__}")

    def resolve(self, store_all_peak: int) -> int:
        """Bytes this budget allows where storing everything peaks at ``store_all_peak``."""
        if self.fraction is not None:
            return int(self.fraction * store_all_peak)
        return self.nbytes

    def __str__(self) -> str:
        if self.written:
            return self.written
        if self.fraction is not None:
            return f"{self.fraction:.4g} of store-all"
        return format_bytes(self.nbytes)


BudgetLike = int | float | str | Budget  # what a user may pass


def _number(text: str) -> int | float:
    """A budget string as the ``int`` bytes or ``float`` fraction it stands for."""
    if m := _PERCENT.match(text):
        return float(m.group(1)) / 100
    if m := _SIZE.match(text):
        number, unit = m.group(1), m.group(2).lower()
        if unit not in _UNITS:
            raise InvalidOption(f"unknown unit {m.group(2)!r} in budget {text!r}; use {_units()}")
        if unit == "" and "." in number:
            return float(number)
        return int(float(number) * _UNITS[unit])
    raise InvalidOption(f"cannot read budget {text!r}; write e.g. '512MiB', '2GB', '40%' or 0.4")


def _units() -> str:
    return ", ".join(u for u in ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"))
