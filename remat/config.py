"""Options a caller did not pass: from ``remat.configure(...)``, else ``REMAT_*`` variables.

Pipelines that build the model or compile it for the user (Hugging Face's Trainer, a
launcher script, ``torch.compile(backend="remat")`` without ``options``) leave no place for
remat's arguments; these two do. An argument given in the call always wins.
"""

from __future__ import annotations

import os

from remat.errors import InvalidOption
from remat.solvers.budget import Budget, BudgetLike

# option -> (environment variable, built-in default; None: the option must be given)
OPTIONS: dict[str, tuple[str, object]] = {
    "budget": ("REMAT_BUDGET", None),
    "solver": ("REMAT_SOLVER", "auto"),
    "compiler": ("REMAT_COMPILER", "eager"),
    "cost_model": ("REMAT_COST_MODEL", "roofline"),
}

_configured: dict[str, object] = {}


def configure(**options: object) -> None:
    """Set defaults for every later ``optimize``, ``backend`` and ``torch.compile(...,
    backend="remat")`` in this process: ``budget``, ``solver``, ``compiler``,
    ``cost_model``. ``None`` forgets one (back to its ``REMAT_*`` variable)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise InvalidOption(
            f"remat.configure got unknown options {unknown}; it takes {sorted(OPTIONS)}"
        )
    for name, value in options.items():
        if value is None:
            _configured.pop(name, None)
        else:
            _configured[name] = value


def option(name: str, given: object = None) -> object:
    """``given``, else the configured value, else ``REMAT_<NAME>``, else the built-in
    default; ``InvalidOption`` saying where to set it when there is none."""
    return _option_and_source(name, given)[0]


def budget(given: BudgetLike | None = None) -> Budget:
    """The budget ``option`` finds, parsed once (``Budget.parse``); an error in one read
    from ``REMAT_BUDGET`` names the variable."""
    value, source = _option_and_source("budget", given)
    try:
        return Budget.parse(value)
    except InvalidOption as e:
        if source != "environment":
            raise
        raise InvalidOption(f"{OPTIONS['budget'][0]}={value}: {e}") from None


def _option_and_source(name: str, given: object) -> tuple[object, str]:
    """``option``'s value and where it came from: "call", "configure", "environment" or
    "default"."""
    variable, default = OPTIONS[name]
    found = (
        (given, "call"),
        (_configured.get(name), "configure"),
        (os.environ.get(variable) or None, "environment"),
        (default, "default"),
    )
    for value, source in found:
        if value is not None:
            return value, source
    raise InvalidOption(
        f"remat needs a {name}: pass {name}=... (e.g. {name}=0.5, half of the store-all "
        f'peak, or "2GiB"), call remat.configure({name}=...), or set {variable}'
    )
