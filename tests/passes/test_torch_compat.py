"""``passes/_torch_compat.py``: a torch that lacks what remat needs is named, with what it
lacks, when remat is imported or the call needing it runs; the range it names is the one
remat declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from remat.passes import _torch_compat as compat

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_name_is_said_with_the_release_and_the_range():
    release = re.escape(f"remat cannot run on torch {torch.__version__}: ")
    supported = re.escape(f"; remat runs on torch{compat.SUPPORTED}")
    with pytest.raises(
        ImportError, match=rf"^{release}cannot import name 'nothing_here'.*{supported}$"
    ):
        with compat.needed():
            from torch.fx import nothing_here  # noqa: F401
    with pytest.raises(ImportError, match=rf"^{release}No module named 'torch._gone'{supported}$"):
        with compat.needed():
            import torch._gone as gone  # noqa: F401


def test_what_the_installed_torch_has_imports_as_usual():
    with compat.needed():
        from torch._functorch.partitioners import _extract_fwd_bwd_modules
    assert compat._extract_fwd_bwd_modules is _extract_fwd_bwd_modules
    with pytest.raises(ValueError, match="not an import error"):  # other errors pass through
        with compat.needed():
            raise ValueError("not an import error")


def test_the_range_named_is_the_one_declared():
    assert f'"torch{compat.SUPPORTED}"' in (ROOT / "pyproject.toml").read_text()
