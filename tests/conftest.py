"""Every test plans afresh: the plan cache on disk (``remat.cache``) is off unless a test
turns it on, so no test passes on a plan another test or run stored."""

import pytest


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "0")
