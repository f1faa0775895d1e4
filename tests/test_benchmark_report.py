"""docs/benchmarks.md is what ``python benchmarks/report.py`` writes from
benchmarks/results/*.json and benchmarks/report_text.md, so its figures cannot drift from
the results; every table says how it was made; every link into it lands on a heading."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
PROVENANCE = {"command", "commit", "machine", "date"}


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_report_writes(report, tmp_path):
    out = tmp_path / "benchmarks.md"
    report.build(out)
    assert out.read_text() == PAGE.read_text(), (
        "docs/benchmarks.md is not what `python benchmarks/report.py` writes from "
        "benchmarks/results/ and benchmarks/report_text.md: edit those and rerun it"
    )


def test_the_page_says_it_is_generated_and_how():
    head = "\n".join(PAGE.read_text().splitlines()[:8])
    assert "python benchmarks/report.py" in head


def test_every_result_has_its_provenance_line_on_the_page(report):
    page = PAGE.read_text()
    results = report.load_results()
    assert results
    for name, result in results.items():
        provenance = result["provenance"]
        assert PROVENANCE <= provenance.keys(), f"{name}: provenance lacks {PROVENANCE}"
        assert re.fullmatch(r"[0-9a-f]{40}", provenance["commit"]), name
        assert provenance["command"], f"{name}: the command that produced it"
        assert report.provenance_line(provenance) in page, f"{name}: no provenance line"


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered)."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        anchor = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        anchors.add(anchor if n == 0 else f"{anchor}-{n}")
    return anchors


def _sources() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("remat", "passes", "solvers", "benchmarks", "examples"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return found


def test_links_into_the_page_land_on_its_headings():
    anchors = _anchors(PAGE.read_text())
    links = [
        (path.relative_to(ROOT), anchor)
        for path in _sources()
        for anchor in re.findall(r"benchmarks\.md#([\w-]+)", path.read_text())
    ]
    links += [(PAGE.relative_to(ROOT), a) for a in re.findall(r"\]\(#([\w-]+)\)", PAGE.read_text())]
    broken = [f"{path}: #{anchor}" for path, anchor in links if anchor not in anchors]
    assert not broken, f"links to headings docs/benchmarks.md does not have: {broken}"


def test_a_cuda_check_renders_its_tables_checks_and_what_it_left(report):
    row = {"method": "remat", "budget": 0.5, "solver": "auto", "peak_bytes": 3 << 20}
    check = {"check": "remat auto @ 0.5 within its budget", "ok": False, "detail": "over"}
    data = {
        "machine": {"device name": "GPU", "cuda": "13.0", "torch": "2.11.0", "sizes": {}},
        "bench": [{"model": "gpt", "dtype": "bfloat16", "rows": [row], "checks": [check]}],
        "dropout": {
            "checks": [{"check": "gradients bit for bit eager's", "ok": True, "detail": ""}]
        },
        "not measured": ["bench hf-gpt2 float32: past the deadline"],
    }
    page = report.script_table("cuda_check", None, data)
    assert "GPU (CUDA 13.0), torch 2.11.0" in page and "`gpt`, bfloat16:" in page
    assert "| remat | 0.5 | auto | 3.0 MiB |" in page
    assert "| bench gpt bfloat16 | remat auto @ 0.5 within its budget | FAILED | over |" in page
    assert "| dropout | gradients bit for bit eager's | ok |  |" in page
    assert page.endswith("Not measured: bench hf-gpt2 float32: past the deadline.")


def test_torch_versions_rows_name_their_failed_tests(report):
    row = {"installed": "2.15.0+cu132", "torch kept": True, "passed": 700, "failed": 1}
    row |= {"main job": "ok", "failures": ["tests.solvers.test_cpsat::test_x[0.5]"]}
    page = report.script_table("torch_versions", None, [row])
    assert "| 2.15.0+cu132 | yes | 700 | 1 |" in page and "test_cpsat::test_x[0.5] |" in page
