"""remat inside the training pipelines people run: mixed precision, gradient accumulation,
and the example scripts a user copies (``examples/``), each run small."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import signal
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


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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
    budget = report.steps[-1].limit
    # the 8 bytes: the wrapped scalar of ``/ 3`` (docs/guide.md, "What the budget covers")
    assert report.predicted_peak <= budget
    assert all(p <= budget and abs(p - report.predicted_peak) <= 8 for p in peaks), peaks
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == q.grad.dtype
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def _run(*command: str, timeout: int = 300, quiet: bool = False) -> str:
    """The command's stdout. Past ``timeout`` every process it started dumps its Python
    stacks (faulthandler on SIGABRT) and the test fails with them: a hung rank says where.
    With ``quiet``, its stderr must hold nothing that reads like a failure
    (``reads_like_a_failure``)."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(
        [sys.executable, *command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGABRT)
            stdout, stderr = process.communicate()
            pytest.fail(f"timed out after {timeout}s; stacks:\n{stderr[-20000:]}\n{stdout[-2000:]}")
    assert process.returncode == 0, stderr[-3000:]
    if quiet:
        assert not reads_like_a_failure(stderr), stderr[-3000:]
    return stdout


# What a normal run must not print: remat's own messages (each starts "remat "), warnings
# (Python's, and torch's logs at W), "error", "exceed", "fail".
_ALARMING = re.compile(r"^remat |Warning|^\S*W\d{4} |error|exceed|fail", re.I | re.M)


def reads_like_a_failure(text: str) -> list[str]:
    """The lines of ``text`` a user would read as something gone wrong."""
    return [line for line in text.splitlines() if _ALARMING.search(line)]


@pytest.mark.slow
def test_the_amp_example_trains():
    out = _run("examples/train_amp.py", "--steps", "2", "--micro", "2")
    losses = [float(m) for m in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    assert "predicted peak" in out


@pytest.mark.slow
def test_hf_trainer_trains_on_lengths_that_vary_within_the_budget(tmp_path):
    """``Trainer(model=remat.optimize(model, ...))`` on batches padded to their longest row
    (the example's data: 24 steps, lengths 16..128): each dynamo frame traced at most twice;
    a step plans without tracing only at a length longer than any before (no plan per
    length); every step that neither traces nor plans peaks within the budget; the losses
    and the trained weights are the uncompiled Trainer's."""
    from transformers import Trainer

    sys.path.insert(0, str(ROOT / "examples"))
    import hf_trainer

    class Measured(Trainer):
        """Per training step: its length, peak, and what remat did in it."""

        steps: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            rb = getattr(model, "remat", None)
            if rb is None or len(self.steps) < 2:  # the two traces plan outside a profiler
                self.steps.append((inputs["input_ids"].shape[1], None, True, True, None))
                return super().training_step(model, inputs, num_items_in_batch)
            before = (len({g.compile_id for g in rb.graphs}), len(rb.graphs))
            m = memory.peak(super().training_step, model, inputs, num_items_in_batch)
            traced = len({g.compile_id for g in rb.graphs}) > before[0]
            planned = len(rb.graphs) > before[1]
            limit = rb.steps.plans[-1].limit
            self.steps.append((inputs["input_ids"].shape[1], m.peak_bytes, traced, planned, limit))
            return m.result

    def train(optimized: bool):
        model, args = hf_trainer.model_and_args(24, str(tmp_path))
        given = remat.optimize(model, budget=0.6) if optimized else model
        trainer = Measured(model=given, args=args, train_dataset=hf_trainer.dataset(96),
                           data_collator=hf_trainer.collate)  # fmt: skip
        trainer.steps = []
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return model, given, trainer.steps, losses

    eager, _, _, eager_losses = train(optimized=False)
    model, optimized, steps, losses = train(optimized=True)
    assert losses == eager_losses and len(steps) == 24
    frames = [g.compile_id.frame_id for g in optimized.remat.graphs]
    compiles = {f: {g.compile_id for g in optimized.remat.graphs if g.compile_id.frame_id == f}
                for f in frames}  # fmt: skip
    assert all(len(c) <= 2 for c in compiles.values()), compiles
    assert len({length for length, *_ in steps}) > 8  # more than dynamo's recompile limit
    assert not any(traced for _, _, traced, _, _ in steps[2:])
    longest = 0
    for length, peak, traced, planned, limit in steps:
        if planned and not traced:
            assert length > longest, (length, longest)  # a plan only for a longer batch
        if not (traced or planned):
            assert peak <= limit, (length, peak, limit)
        longest = max(longest, length)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_hf_trainer_example_trains(capsys, caplog):
    """It trains and prints its plan, and nothing that reads like a failure (it printed
    "no plan fits what is left of the budget" for the loss graph before)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_trainer

    with caplog.at_level(logging.INFO, logger="remat"):
        hf_trainer.main(["--steps", "4"])
    out, err = capsys.readouterr()
    assert "predicted peak" in out and re.search(r"4 steps: \d+ traces, \d+ graph plans", out)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not reads_like_a_failure(err)


@pytest.mark.slow
def test_the_torchrun_ddp_example_trains():
    """Two ranks under torchrun; rank 0 prints its losses and the step's plan."""
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "examples/ddp_torchrun.py", quiet=True)  # fmt: skip
    losses = [float(m) for m in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    assert "graph0, graph1" in out  # the bucket graphs, one step


@pytest.mark.slow
def test_the_readmes_quick_start_prints_nothing_that_reads_like_a_failure(tmp_path):
    """The README's first example, run verbatim: it prints the report, and no warning."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    out = _run(str(script), quiet=True)
    assert "predicted peak" in out


def test_reads_like_a_failure_sees_remats_and_torchs_warnings():
    assert reads_like_a_failure("remat graph0: its first step runs at its lowest peak")
    assert reads_like_a_failure("[rank0]:W1205 01:38:19.330000 1633 torch/_logging ...")
    assert reads_like_a_failure("x.py:3: FutureWarning: isinstance(treespec, LeafSpec)")
    assert not reads_like_a_failure("step 1: loss 6.2580\nOMP_NUM_THREADS set to 1")


def test_a_bad_budget_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("REMAT_BUDGET", "abc")
    with pytest.raises(remat.InvalidOption, match=r"^REMAT_BUDGET=abc: cannot read budget 'abc'"):
        remat.backend()
    with pytest.raises(remat.InvalidOption, match=r"^cannot read budget 'xyz'"):
        remat.backend(budget="xyz")  # given in the call: no variable to name


def test_options_come_from_the_call_configure_or_the_environment(monkeypatch):
    """Where a pipeline gives remat no arguments (the Trainer, torch.compile's backend
    name), ``remat.configure`` and ``REMAT_*`` variables do; the call wins over both."""
    monkeypatch.delenv("REMAT_BUDGET", raising=False)
    with pytest.raises(remat.InvalidOption, match="REMAT_BUDGET"):
        remat.backend()
    monkeypatch.setenv("REMAT_BUDGET", "0.5")
    monkeypatch.setenv("REMAT_SOLVER", "greedy")
    assert remat.backend().planner.budget == remat.Budget.parse(0.5)
    assert remat.backend().planner.solver == "greedy"
    try:
        remat.configure(budget="3MiB", compiler="eager")
        assert remat.backend().planner.budget == remat.Budget.parse("3MiB")
        assert remat.backend(budget=0.9).planner.budget == remat.Budget.parse(0.9)
        with pytest.raises(remat.InvalidOption, match="unknown options"):
            remat.configure(budgett=1)
    finally:
        remat.configure(budget=None, compiler=None)
    assert remat.backend().planner.budget == remat.Budget.parse(0.5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    monkeypatch.delenv("REMAT_BUDGET")
    with pytest.raises(Exception) as refused:  # noqa: B017 (dynamo wraps it)
        torch.compile(model, backend="remat", dynamic=False)(x)
    assert isinstance(remat.errors.user_error(refused.value), remat.InvalidOption)
    torch._dynamo.reset()
    monkeypatch.setenv("REMAT_BUDGET", "1.0")
    compiled = torch.compile(model, backend="remat", dynamic=False)  # no options: from env
    compiled(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
