"""The solvers (``remat.solvers``: pure, no torch), on hand-made and thousands of random
problems. A test goes in the file of the module it checks (``test_cpsat.py`` for
``cpsat.py`` and its model); what every plan keeps (valid schedules, exact memory,
budgets met) is ``test_properties.py``, whose strategies the other files draw from.

Two helper modules, not tests, importable whatever pytest's import mode (this puts the
folder on ``sys.path``): ``oracle.py``, an independent re-implementation of the memory
model written from the docstrings, and ``synthetic.py``, the test graphs (chains, random
joints, transformer-like stacks), which the benchmark scripts use too."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
