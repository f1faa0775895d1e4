"""``benchmarks/cuda_check.py``, the CUDA check, on the CPU: its dry run passes every
check, and a machine that lacks something hears what before anything is measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cuda_check.py"
DRY_RUN = ["--device", "cpu", "--small", "--budgets", "0.5", "--repeat", "1"]


@pytest.fixture(scope="module")
def cuda_check():
    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sections(result: dict) -> dict[str, list[dict]]:
    found = {f"bench {b['model']} {b['dtype']}": b["checks"] for b in result["bench"]}
    return {
        **found,
        "dropout": result["dropout"]["checks"],
        "reversible": result["reversible"]["checks"],
    }


@pytest.mark.slow
def test_dry_run_passes_every_check(tmp_path):
    out = tmp_path / "cuda_check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *DRY_RUN, "--dtypes", "bfloat16", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["device"] == "cpu" and result["not measured"] == []
    found = sections(result)
    assert sorted(found) == [
        "bench gpt bfloat16",
        "bench hf-gpt2 bfloat16",
        "dropout",
        "reversible",
    ]
    for section, checks in found.items():
        assert checks and all(c["ok"] for c in checks), (section, checks)
    for table in result["bench"]:
        methods = [r["method"] for r in table["rows"]]
        assert methods[:4] == ["eager", "checkpoint", "torch", "remat"], methods
        remat = [r for r in table["rows"] if r["method"] == "remat" and r["peak_bytes"]]
        assert remat and all(r["grad_reference"] == "torch.compile" for r in remat)
    assert result["dropout"]["masks replayed"] > 0
    assert "in all" in done.stdout and "FAIL" not in done.stdout


def test_a_machine_lacking_ortools_and_cuda_hears_both_before_anything_runs(
    cuda_check, monkeypatch, capsys, tmp_path
):
    monkeypatch.setitem(sys.modules, "ortools.sat.python.cp_model", None)  # not importable
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "cuda_check.json"
    assert cuda_check.main(["--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ortools: import of ortools.sat.python.cp_model halted" in err
    assert "--find-links WHEELS ortools" in err
    assert "a CUDA device" in err and "sees none" in err
    assert not out.exists()  # nothing measured


def test_tables_measure_each_model_and_dtype_first(cuda_check):
    order = cuda_check.tables(["gpt", "hf-gpt2"], ["float32", "bfloat16"])
    assert order == [
        ("gpt", "float32"),
        ("hf-gpt2", "bfloat16"),
        ("gpt", "bfloat16"),
        ("hf-gpt2", "float32"),
    ]
    assert cuda_check.tables(["gpt"], ["bfloat16"]) == [("gpt", "bfloat16")]


def test_past_the_deadline_no_table_starts_and_each_is_named(cuda_check, tmp_path, capsys):
    out = tmp_path / "cuda_check.json"
    assert cuda_check.main([*DRY_RUN, "--deadline", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == []
    assert result["not measured"] == [
        f"bench {m} {d}: past the deadline"
        for m, d in cuda_check.tables(["gpt", "hf-gpt2"], ["float32", "bfloat16"])
    ]
    assert all(c["ok"] for c in result["dropout"]["checks"] + result["reversible"]["checks"])
    assert "not measured: bench gpt float32" in capsys.readouterr().out
