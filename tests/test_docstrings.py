"""The public entry points' examples run as written (doctest)."""

from __future__ import annotations

import doctest

import pytest

import remat.api

ENTRY_POINTS = {remat.api: ("optimize", "plan")}


@pytest.mark.parametrize("module", list(ENTRY_POINTS), ids=lambda m: m.__name__)
def test_examples_run(module):
    finder = doctest.DocTestFinder()
    tests = {t.name.rpartition(".")[2]: t for t in finder.find(module) if t.examples}
    missing = [name for name in ENTRY_POINTS[module] if name not in tests]
    assert not missing, f"{module.__name__}: no Example in {missing}"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests.values():
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} failing examples in {module.__name__}"
