"""Options a caller did not pass: from ``remat.configure(...)``, else ``REMAT_*`` variables.

Pipelines that build the model or compile it for the user (Hugging Face's Trainer, a
launcher script, ``torch.compile(backend="remat")`` without ``options``) leave no place for
remat's arguments; these two do. An argument given in the call always wins.
"""

from __future__ import annotations

import os

from remat.errors import InvalidOption

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
    variable, default = OPTIONS[name]
    for value in (given, _configured.get(name), os.environ.get(variable) or None, default):
        if value is not None:
            return value
    raise InvalidOption(
        f"remat needs a {name}: pass {name}=... (e.g. {name}=0.5, half of the store-all "
        f'peak, or "2GiB"), call remat.configure({name}=...), or set {variable}'
    )
