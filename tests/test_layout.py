"""The layout's rules, checked on the source (docs/architecture.md states them):

- the core (``remat``, ``remat.passes``, ``remat.solvers``) never imports the tools;
- each package imports only what its row in ``MAY_IMPORT`` allows (passes neither the
  cost model nor the runtime; solvers only themselves), and only the wiring imports the
  runtime (compile time never depends on run time);
- no import cycle among the core's modules, counting imports inside functions;
- private torch APIs are reached only through ``passes/_torch_compat.py``;
- a module over 500 lines says in its docstring why it is one file.

(``solvers`` importing no torch at all is ``tests/solvers/test_no_torch.py``.)
"""

from __future__ import annotations

import ast
import textwrap
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


def _imports_of(name: str, path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports anywhere in
    ``tree``, relative imports resolved; ``from package import module`` names the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if full in known:
                    found.add(full)
                elif module in known:
                    found.add(module)
    return found - {name}


def _import_graph(modules: list[tuple[str, Path]]) -> dict[str, set[str]]:
    known = {name for name, _ in modules}
    return {
        name: _imports_of(name, path, ast.parse(path.read_text()), known) for name, path in modules
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# Per package (the longest prefix that matches a module decides), the core packages its
# modules may import besides their own: docs/architecture.md, "Layout".
MAY_IMPORT = {
    "remat.solvers": (),
    "remat.passes": ("remat.solvers",),
    "remat.costs": ("remat.passes", "remat.solvers", "remat.errors", "remat.memory"),
    "remat.runtime": ("remat",),
    "remat": ("remat",),
}
# Run time builds on compile time: besides the runtime itself, only the wiring imports it.
RUNTIME_USERS = {"remat", "remat.api", "remat.backends", "remat.report"}


def _forbidden(graph: dict[str, set[str]]) -> list[str]:
    """Each import that breaks ``MAY_IMPORT`` or ``RUNTIME_USERS``, as 'a -> b'."""
    bad = []
    for name, imported in sorted(graph.items()):
        package = max((p for p in MAY_IMPORT if _in(name, p)), key=len)
        for target in sorted(imported):
            allowed = _in(target, package) or any(_in(target, p) for p in MAY_IMPORT[package])
            runtime = _in(target, "remat.runtime") and not (
                _in(name, "remat.runtime") or name in RUNTIME_USERS
            )
            if not allowed or runtime:
                bad.append(f"{name} -> {target}")
    return bad


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
    private = sorted({m for m in _imported(tree) + _torch_attribute_chains(tree) if _private(m)})
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


def test_each_package_imports_only_what_its_rules_allow():
    bad = _forbidden(_import_graph(CORE))
    assert not bad, (
        "imports against docs/architecture.md's rules (passes: torch and solvers; solvers: "
        f"none; compile time never imports the runtime): {bad}"
    )


def test_no_import_cycle_in_the_core():
    cycles = _cycles(_import_graph(CORE))
    assert not cycles, f"import cycles (a local import hides one, it does not untie it): {cycles}"


def _one_module(tmp_path: Path, name: str, source: str) -> tuple[str, Path]:
    path = tmp_path / (name.rpartition(".")[2] + ".py")
    path.write_text(textwrap.dedent(source))
    return name, path


def test_the_rules_catch_a_forbidden_import(tmp_path):
    """The checks above can fail: a pass importing the cost model or the runtime, a
    solver importing a pass, compile time's records importing the runtime, and a cycle."""
    known = [*CORE]
    cases = {
        "remat.passes.probe": "from remat.costs.measured import output_strides\n",
        "remat.solvers.probe": "from remat.passes.extract import extract\n",
        "remat.costs.probe": "def f():\n    from remat.runtime import StepRunner\n",
    }
    for name, source in cases.items():
        probe = _one_module(tmp_path, name, source)
        assert _forbidden(_import_graph([*known, probe])), name
    compiled = next(p for n, p in CORE if n == "remat.compiled")
    patched = _one_module(
        tmp_path, "remat.compiled", compiled.read_text() + "\nfrom remat.runtime import joint\n"
    )
    graph = _import_graph([*(m for m in known if m[0] != "remat.compiled"), patched])
    assert "remat.compiled -> remat.runtime.joint" in _forbidden(graph)
    assert _cycles(graph), "compile time's records importing the runtime closes a cycle"


def test_every_package_folder_is_in_the_wheel():
    """``pyproject.toml`` lists packages by hand (``passes`` and ``solvers`` live outside
    ``remat/``), and an editable install finds a folder missing from that list anyway: only a
    wheel, what users install, lacks it. So each folder holding an ``__init__.py`` is listed."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(setuptools["packages"])
    found = {
        ".".join((package, *init.parent.relative_to(folder).parts))
        for package, folder in PACKAGES.items()
        for init in folder.rglob("__init__.py")
    }
    assert found <= declared, f"add to pyproject's packages: {sorted(found - declared)}"
