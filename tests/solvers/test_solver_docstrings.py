"""The solvers' documented examples run as written (doctest), and the entry points have
one. (The basename differs from ``tests/test_docstrings.py``'s, the public API's: test
basenames are unique across the folders.)"""

from __future__ import annotations

import doctest
import importlib
import textwrap
import types

import pytest

# module -> the objects whose docstring must hold an Example
EXAMPLES = {
    "remat.solvers.solve": ("solve", "Solver.__call__"),
    "remat.solvers.budget": ("Budget.parse",),
}


def example_problems(module: types.ModuleType, required: tuple[str, ...]) -> list[str]:
    """What is wrong with ``module``'s examples: each object in ``required`` without one,
    and each example that does not print what it shows."""
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    found = {t.name.removeprefix(f"{module.__name__}.") for t in tests}
    problems = [f"no Example in {name}" for name in required if name not in found]
    for test in tests:
        runner = doctest.DocTestRunner(verbose=False)
        runner.run(test, out=lambda _: None)
        if runner.failures:
            problems.append(f"{test.name}: {runner.failures} of {runner.tries} lines fail")
    return problems


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_examples_run(name):
    # imported by name: ``remat.solvers.solve`` as an attribute is the function
    module = importlib.import_module(name)
    assert example_problems(module, EXAMPLES[name]) == []


def test_a_missing_or_failing_example_is_reported():
    module = types.ModuleType("fake")
    source = """
        def right():
            '''
            >>> 1 + 1
            2
            '''

        def wrong():
            '''
            >>> 1 + 1
            3
            '''
    """
    exec(textwrap.dedent(source), module.__dict__)
    assert example_problems(module, ("right", "absent")) == [
        "no Example in absent",
        "fake.wrong: 1 of 1 lines fail",
    ]
