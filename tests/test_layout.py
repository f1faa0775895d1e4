"""The layout's rules, checked on the source (docs/architecture.md states them):

- the core (``remat``, ``remat.passes``, ``remat.solvers``) never imports the tools;
- private torch APIs are reached only through ``passes/_torch_compat.py``;
- a module over 500 lines says in its docstring why it is one file.

(``solvers`` importing no torch at all is ``tests/solvers/test_no_torch.py``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "remat": ROOT / "remat",
    "remat.passes": ROOT / "passes",
    "remat.solvers": ROOT / "solvers",
}
COMPAT = ROOT / "passes" / "_torch_compat.py"
SCRIPTS = [*sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "examples").glob("*.py"))]
MAX_LINES = 500


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found.append((name, path))
    return found


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts
    )


def _torch_attribute_chains(tree: ast.AST) -> list[str]:
    """``torch.a.b`` chains written in the code (``torch._dynamo.reset``)."""
    chains = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch":
                chains.append(".".join(["torch", *reversed(parts)]))
    return chains


# ``python -m remat`` is the command line's launcher: the one core file that names the tools
CORE = [
    (name, path)
    for name, path in _modules()
    if not name.startswith("remat.tools") and name != "remat.__main__"
]


@pytest.mark.parametrize(("name", "path"), CORE, ids=[n for n, _ in CORE])
def test_the_core_never_imports_the_tools(name, path):
    tree = ast.parse(path.read_text())
    tools = [m for m in _imported(tree) if m == "remat.tools" or m.startswith("remat.tools.")]
    assert not tools, f"{name} imports {tools}: the tools build on the core, not the reverse"


SOURCES = [p for _, p in _modules() if p != COMPAT] + SCRIPTS


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_private_torch_only_through_the_compat_module(path):
    tree = ast.parse(path.read_text())
    private = sorted(
        {m for m in _imported(tree) + _torch_attribute_chains(tree) if _private(m)}
    )
    assert not private, (
        f"{path.relative_to(ROOT)} reaches {private}: add a wrapper to "
        "passes/_torch_compat.py and use that"
    )


def test_the_compat_module_is_where_private_torch_is():
    tree = ast.parse(COMPAT.read_text())
    assert any(_private(m) for m in _imported(tree)), "the scan above would find nothing"


LONG = [(n, p) for n, p in _modules() if len(p.read_text().splitlines()) > MAX_LINES]


@pytest.mark.parametrize(("name", "path"), LONG, ids=[n for n, _ in LONG])
def test_a_long_module_says_why_it_is_one_file(name, path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "One file because" in doc, (
        f"{name} has {len(path.read_text().splitlines())} lines: split it by job, or say "
        "'One file because ...' in its docstring"
    )
