"""The synthetic graphs the solver tests use (``tests/solvers/synthetic.py``: chains,
random joints, transformer-like stacks), for benchmark scripts.

They are a test utility, not part of the library; this puts their folder on
``sys.path`` (last, so none of its modules shadows an installed one) and re-exports
them: ``from _test_graphs import layered``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_FOLDER = Path(__file__).resolve().parent.parent / "tests" / "solvers"
if str(_FOLDER) not in sys.path:
    sys.path.append(str(_FOLDER))

from synthetic import chain, layered, random_joint  # noqa: E402

__all__ = ["chain", "layered", "random_joint"]
