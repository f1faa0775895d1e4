"""``remat.solvers`` never imports torch: checked in the source and in a clean interpreter,
where a standalone copy of the folder plans a problem the test graphs (``synthetic.py``,
which imports ``remat.solvers`` only) build on it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import remat.solvers

SOLVERS_DIR = Path(remat.solvers.__file__).resolve().parent
SOURCES = sorted(SOLVERS_DIR.rglob("*.py"))
GRAPHS = Path(__file__).resolve().parent / "synthetic.py"  # a test utility, not the library's


def _is_torch(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


def torch_imports(tree: ast.AST) -> list[str]:
    """Every way the file names torch as a module: import, from-import, dynamic import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}" for a in node.names if _is_torch(a.name)
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _is_torch(node.module):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            arg = node.args[0]
            if (
                name in ("__import__", "import_module")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and _is_torch(arg.value)
            ):
                found.append(f"line {node.lineno}: {name}({arg.value!r})")
    return found


def test_the_solvers_folder_is_the_one_we_think():
    assert SOLVERS_DIR.name == "solvers"
    names = {p.name for p in SOURCES}
    assert {"__init__.py", "problem.py", "schedule.py", "simulate.py", "solve.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_torch_import_in_source(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    assert torch_imports(tree) == [], f"{path.name} imports torch"


@pytest.mark.parametrize(
    "source",
    [
        "import torch",
        "import torch.fx as fx",
        "import os, torch",
        "from torch import fx",
        "from torch.utils import checkpoint",
        "def f():\n    import torch",
        "importlib.import_module('torch')",
        "__import__('torch.nn')",
    ],
)
def test_the_checker_catches_torch_imports(source):
    assert torch_imports(ast.parse(source))


@pytest.mark.parametrize(
    "source", ["import torchvision_free", "from .torch_like import x", "from . import problem"]
)
def test_the_checker_ignores_lookalikes(source):
    assert torch_imports(ast.parse(source)) == []


STANDALONE = r"""
import importlib.util, json, sys
folder, graphs = sys.argv[1], sys.argv[2]


def load(name, path, **where):
    spec = importlib.util.spec_from_file_location(name, path, **where)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pkg = load("standalone_solvers", folder + "/__init__.py", submodule_search_locations=[folder])
# the test graphs import ``remat.solvers``: here that name is the standalone copy, so
# nothing of remat's core (nor torch) can load through them
sys.modules["remat.solvers"] = pkg
synthetic = load("synthetic", graphs)
problem = synthetic.chain(6)
full = pkg.store_all(problem)
plan = pkg.solve(problem, pkg.Budget.parse(0.7).resolve(full.peak))
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "remat": sorted(
        m for m in sys.modules
        if (m == "remat" or m.startswith("remat.")) and sys.modules[m] is not pkg
    ),
    "problem": type(problem).__module__,
    "store_all_peak": full.peak,
    "peak": plan.peak,
    "limit": plan.limit,
    "module": pkg.solve.__module__,
}))
"""


def test_solvers_run_standalone_without_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-I", "-c", STANDALONE, str(SOLVERS_DIR), str(GRAPHS)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["torch"] == []
    assert out["remat"] == []
    assert out["module"] == "standalone_solvers.solve"
    assert out["problem"] == "standalone_solvers.problem"  # the test graphs', too
    assert out["limit"] == int(0.7 * out["store_all_peak"])
    assert 0 < out["peak"] <= out["limit"]
