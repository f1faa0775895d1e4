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

# Below this an int without a unit is refused as ambiguous: one float32 activation of a
# 32x32 layer is 4 KiB, so no training step peaks lower, while 1 is what torch's
# ``activation_memory_budget=1`` users type meaning "all of it".
AMBIGUOUS_BELOW = 4096

LOWEST = "min"  # the budget that asks for the lowest peak remat can reach
DEVICE = "device"  # the budget that is what the CUDA device has free at the first step


@dataclass(frozen=True)
class Budget:
    """A budget read once. Exactly one of: ``nbytes`` absolute; ``fraction`` of the
    store-all peak of the graph (or step) it is applied to, or of the user's own
    checkpointed program or torch's partition where that peaks lower; ``lowest``, the
    lowest peak remat can reach; ``device``, what the CUDA device has free at the first
    step (less a margin: ``remat.device_budget``), made bytes there. Build it with
    ``parse``. ``written``: the text it was read from, which messages repeat as the user
    wrote it."""

    nbytes: int | None = None
    fraction: float | None = None
    lowest: bool = False
    device: bool = False
    written: str = field(default="", compare=False)

    @classmethod
    def parse(cls, budget: BudgetLike) -> Budget:
        """Read ``int`` bytes (4096 or more; ``"1B"`` for fewer), a ``float`` fraction in
        (0, 1], ``"40%"``, ``"0.4"``, ``"512MiB"``, ``"2GB"``, ``"1073741824"``, ``"min"``
        or ``"device"``; a ``Budget`` is returned as is.

        Example:
            >>> Budget.parse("40%").resolve(store_all_peak=1000)
            400
            >>> Budget.parse("2GiB").resolve(store_all_peak=1000)  # bytes, whatever the peak
            2147483648
            >>> Budget.parse("min").resolve(store_all_peak=1000, lowest_peak=612)
            612
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
            if budget < AMBIGUOUS_BELOW:
                raise InvalidOption(_ambiguous(budget))
            return cls(nbytes=budget)
        if isinstance(budget, float):
            if not 0.0 < budget <= 1.0:
                raise InvalidOption(
                    f"a float budget is a fraction of the store-all peak in (0, 1], got "
                    f"{budget}; give bytes as an int or a string like '512MiB'"
                )
            return cls(fraction=budget)
        if isinstance(budget, str):
            word = budget.strip().lower()
            if word in (LOWEST, DEVICE):
                return cls(lowest=word == LOWEST, device=word == DEVICE, written=word)
            value = _number(budget)  # refuses a small one without a unit
            if isinstance(value, int) and value > 0:  # bytes, a unit given or not ambiguous
                return cls(nbytes=value, written=budget.strip())
            return replace(cls.parse(value), written=budget.strip())
        raise TypeError(f"budget must be int, float or str, got {type(budget).__name__}")

    def resolve(self, store_all_peak: int, lowest_peak: int | None = None) -> int:
        """Bytes this budget allows where storing everything peaks at ``store_all_peak``
        (or the user's own program, where lower) and the lowest peak remat reaches is
        ``lowest_peak`` (needed for ``"min"`` only)."""
        if self.fraction is not None:
            return int(self.fraction * store_all_peak)
        if self.lowest:
            if lowest_peak is None:
                raise ValueError("a 'min' budget resolves against the lowest peak: pass it")
            return lowest_peak
        if self.device:
            raise ValueError(
                "a 'device' budget becomes bytes on the device at the first step "
                "(remat.device_budget.on_device) before it is resolved"
            )
        return self.nbytes

    def __str__(self) -> str:
        if self.written:
            return self.written
        if self.fraction is not None:
            return f"{self.fraction:.4g} of store-all"
        if self.lowest or self.device:
            return LOWEST if self.lowest else DEVICE
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
        nbytes = int(float(number) * _UNITS[unit])
        if unit == "" and 0 < nbytes < AMBIGUOUS_BELOW:
            raise InvalidOption(_ambiguous(text.strip()))
        return nbytes
    raise InvalidOption(
        f"cannot read budget {text!r}; write e.g. '512MiB', '2GB', '40%', 0.4, 'min' or 'device'"
    )


def _ambiguous(written: int | str) -> str:
    quoted = f'"{written}"' if isinstance(written, str) else str(written)
    return (
        f"budget {quoted} is ambiguous: without a unit it reads as {written} bytes, below "
        f"any training step's peak. Write 1.0 for the whole store-all peak (a float is a "
        f'fraction of it: 0.5 is half), "{written}B" or "{written}KiB" if bytes were meant, '
        'or "min" for the lowest peak remat can reach'
    )


def _units() -> str:
    return ", ".join(u for u in ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"))
