"""remat inside the training pipelines people run: mixed precision, gradient accumulation,
and the example scripts a user copies (``examples/``), each run small."""

from __future__ import annotations

import contextlib
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remat
from remat import memory
from remat.tools import examples

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(layers=2, d_model=64, heads=4, seq=64, batch=4, vocab=256, dropout=0.0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", ["autocast", "bf16 weights"])
def test_mixed_precision_with_accumulation_keeps_budget_and_eagers_gradients(precision):
    """bfloat16 by autocast or in the weights: every micro-batch of an accumulated step
    peaks at its prediction, within the budget, and the summed gradients are eager's under
    the same precision (to the bit here: the same kernels in the same order)."""
    model, _ = examples.load("gpt", **SIZES)
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=0.7)

    batches = {seed: examples.load("gpt", seed=seed, **SIZES)[1] for seed in range(4)}

    def step(m, seed):
        x, y = batches[seed]
        cast = precision == "autocast"
        with torch.autocast("cpu", dtype=torch.bfloat16) if cast else contextlib.nullcontext():
            loss = m(x, y) / 3
        loss.backward()

    step(optimized, 0)  # plans
    model.zero_grad(set_to_none=True)
    peaks = [memory.peak(step, optimized, seed).peak_bytes for seed in (1, 2, 3)]
    for seed in (1, 2, 3):
        step(reference, seed)
    report = optimized.remat.report()
    budget = report.steps[-1].budget
    # the 8 bytes: the wrapped scalar of ``/ 3`` (docs/guide.md, "What the budget covers")
    assert report.predicted_peak <= budget
    assert all(p <= budget and abs(p - report.predicted_peak) <= 8 for p in peaks), peaks
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == q.grad.dtype
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def _run(*command: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_amp_example_trains():
    out = _run("examples/train_amp.py", "--steps", "2", "--micro", "2")
    losses = [float(m) for m in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    assert "predicted peak" in out
