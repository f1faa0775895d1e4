"""examples/reversible_transformer.py runs small: the reversible model trains on the
gradients autograd gives the same couplings, its peak stays flat in depth where its
ordinary twin's grows, and remat.optimize predicts its peak to the byte."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reversible_transformer.py"


def load_example():
    spec = importlib.util.spec_from_file_location("reversible_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_reversible_transformer_example(tmp_path):
    small = ["--seq", "16", "--d-model", "32", "--heads", "2", "--steps", "2"]
    rows = load_example().main(
        ["--depths", "2,4", "--optimize", "2", "--out", str(tmp_path), *small]
    )
    two, four, optimized = rows
    assert float(two["grads"]) < 1e-5 and float(four["grads"]) < 1e-5
    assert four["reversible less grads"] == two["reversible less grads"]
    assert four["ordinary less grads"] > 1.5 * two["ordinary less grads"]
    assert optimized["optimize predicted"] == optimized["optimize measured"]
    assert (tmp_path / "reversible_transformer.csv").exists()
