"""Every test plans afresh: the plan cache on disk (``remat.cache``) is off unless a test
turns it on, so no test passes on a plan another test or run stored or made. Times come from the
datasheet's figures (``REMAT_CALIBRATE=0``) unless a test turns calibration on: a plan
must not depend on how loaded the machine was when a worker calibrated
(``costs/test_calibration.py`` checks the calibrated path).

The folders follow the library's parts: ``solvers/`` (pure, no torch), ``passes/`` (the fx
passes), ``costs/`` (the cost model), ``runtime/`` (the step runner, memory measurement),
``api/`` (the whole pass through the public API, the plan cache), ``pipelines/`` (remat
inside training pipelines, on several ranks, the scripts in ``examples/``), ``tools/``
(CLI, bench, example models); checks over the whole source tree sit at the top. Each
folder's ``conftest.py`` says what goes there. A test file's basename must be unique
across the folders (pytest's default import mode, no ``__init__.py``)."""

import gc

import pytest
import torch

from remat.candidates import forget_made


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "0")
    monkeypatch.setenv("REMAT_CALIBRATE", "0")
    forget_made()  # nor on a plan another test made in this process (``made_under``)


def _set_aside_heap() -> None:
    """What the process holds now is set aside from later garbage collections: a recorded
    step's full collection (``Recording.backward_starts``) then costs what it does in a
    small program, not more with every module imported and model compiled before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _imports_set_aside():
    _set_aside_heap()


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches empty before and after the test: a file that compiles the same
    model in several tests marks itself with it (``pytestmark``)."""
    torch._dynamo.reset()
    _set_aside_heap()
    yield
    torch._dynamo.reset()
