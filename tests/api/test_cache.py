"""The plan cache on disk (``remat.cache``): what its keys hold, entries reused across
processes, and entries that are corrupt, foreign or wrong ignored and planned again."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import remat
from remat import cache, keys
from remat.solvers import evaluate, solve, store_all

# the solvers' test graphs (tests/solvers/synthetic.py), appended so they shadow nothing
_SOLVER_TESTS = str(Path(__file__).resolve().parents[1] / "solvers")
if _SOLVER_TESTS not in sys.path:
    sys.path.append(_SOLVER_TESTS)
from synthetic import chain  # noqa: E402


@pytest.fixture
def plans(tmp_path) -> cache.PlanCache:
    return cache.PlanCache(tmp_path / "plans")


def _entries(folder: Path, kind: str) -> list[Path]:
    return sorted(folder.glob(f"{kind}-*.json"))


# ----------------------------------------------------------------------------- switches


def test_where_it_lives_and_how_it_is_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv("REMAT_CACHE", raising=False)
    monkeypatch.delenv("REMAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.open_cache().directory == tmp_path / "xdg" / "remat"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.open_cache().directory == Path.home() / ".cache" / "remat"
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "env"))
    assert cache.open_cache().directory == tmp_path / "env"
    assert cache.open_cache(tmp_path / "given").directory == tmp_path / "given"
    assert cache.open_cache(False) is None
    monkeypatch.setenv("REMAT_CACHE", "0")
    assert cache.open_cache() is None
    assert cache.open_cache(True) is not None  # the call wins over the variable
    assert remat.backend(0.5).cache is None
    assert remat.backend(0.5, cache=tmp_path).cache.directory == tmp_path


# ----------------------------------------------------------------------------- keys


def _linear_joint(shape, dtype=torch.float32, transpose=False):
    """A joint graph of a linear layer, as the planner receives it."""
    captured = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured["joint"], captured["n"] = joint, num_fwd_outputs
        from torch._functorch.partitioners import default_partition

        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    w = torch.randn(shape[-1], 8, dtype=dtype, requires_grad=True)
    x = torch.randn(*shape, dtype=dtype)
    if transpose:
        x = x.t().contiguous().t()

    def f(x):
        return (x @ w).tanh().sum()

    backend = aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition)
    torch.compile(f, backend=backend, dynamic=False)(x).backward()
    torch._dynamo.reset()
    return captured["joint"], captured["n"]


def test_problem_keys_follow_shapes_dtypes_strides_and_cost_model():
    cpu = torch.device("cpu")
    base = keys.problem_key(*_linear_joint((4, 6)), "roofline", cpu)
    assert base == keys.problem_key(*_linear_joint((4, 6)), "roofline", cpu)
    others = {
        keys.problem_key(*_linear_joint((4, 7)), "roofline", cpu),
        keys.problem_key(*_linear_joint((4, 6), dtype=torch.float64), "roofline", cpu),
        keys.problem_key(*_linear_joint((4, 6)), "profile", cpu),
    }
    assert base not in others and len(others) == 3
    square = keys.problem_key(*_linear_joint((6, 6)), "roofline", cpu)
    assert square != keys.problem_key(*_linear_joint((6, 6), transpose=True), "roofline", cpu)


def test_plan_keys_follow_problem_budget_and_solver():
    p = chain(6)
    key = keys.plan_key(p, 1000, "auto")
    assert key == keys.plan_key(chain(6), 1000, "auto")
    assert key == keys.plan_key(chain(6).__class__(p.nodes, p.outputs, p.grads, name="x"), 1000,
                                "auto")  # fmt: skip
    assert len({key, keys.plan_key(p, 1001, "auto"), keys.plan_key(p, 1000, "greedy"),
                keys.plan_key(chain(7), 1000, "auto")}) == 4  # fmt: skip


def test_solver_keys_name_options_and_refuse_unnamed_solvers():
    from remat.solvers.cpsat import cpsat

    assert keys.solver_key("greedy") == "greedy"
    assert keys.solver_key(cpsat) == "remat.solvers.cpsat.cpsat"
    limited = keys.solver_key(functools.partial(cpsat, time_limit=3))
    assert limited == "remat.solvers.cpsat.cpsat(time_limit=3)"
    assert limited != keys.solver_key(functools.partial(cpsat, time_limit=4))
    assert keys.solver_key(lambda p, b: None) is None
    assert keys.solver_key(functools.partial(cpsat, hint=object())) is None


# ----------------------------------------------------------------------------- plans


def test_a_plan_is_stored_reused_and_checked(plans):
    problem = chain(8)
    limit = store_all(problem).peak * 6 // 10
    calls = []

    def greedy_watched(p, budget):
        calls.append(budget)
        return solve(p, budget, "greedy")

    greedy_watched.__module__, greedy_watched.__qualname__ = __name__, "greedy_watched"
    first = solve(problem, limit, plans.solver(greedy_watched))
    again = solve(problem, limit, plans.solver(greedy_watched))
    assert calls == [limit] and plans.counts["plan hit"] == 1
    assert (again.saved, again.peak, again.recompute_cost) == (
        first.saved, first.peak, first.recompute_cost)  # fmt: skip
    assert again.schedule == first.schedule and again.solver == first.solver


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not json", "other format", "other key", "peak changed", "unknown node",
     "over budget"],
)  # fmt: skip
def test_a_bad_plan_entry_is_ignored_and_planned_again(plans, damage, caplog):
    problem = chain(8)
    limit = store_all(problem).peak * 6 // 10
    first = solve(problem, limit, plans.solver("greedy"))
    (path,) = _entries(plans.directory, "plan")
    text = path.read_text()
    entry = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_bytes(b"\x00\xff garbage")
    else:
        if damage == "other format":
            entry["format"] = cache.FORMAT + 1
        elif damage == "other key":
            entry["key"] = "0" * 32
        elif damage == "peak changed":
            entry["peak"] += 1
        elif damage == "unknown node":
            entry["saved"] = [len(problem) + 5]
        else:  # a plan that stores everything: consistent, and over the budget
            full = store_all(problem)
            entry.update(saved=sorted(full.saved), peak=full.peak,
                         recompute_cost=full.recompute_cost)  # fmt: skip
        path.write_text(json.dumps(entry))
    with caplog.at_level(logging.DEBUG, logger="remat"):
        again = solve(problem, limit, plans.solver("greedy"))
    assert plans.counts["plan bad"] == 1 and plans.counts["plan hit"] == 0
    assert "ignored and planned again" in caplog.text
    assert again.peak <= limit and again.saved == first.saved
    assert json.loads(path.read_text()) == json.loads(text)  # rewritten whole


def test_an_unwritable_cache_does_not_fail_planning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    plans = cache.PlanCache(blocker / "plans")
    plan = solve(chain(4), 10**9, plans.solver("greedy"))
    assert plan.peak == evaluate(chain(4), plan.saved, solver="greedy").peak


# ----------------------------------------------------------------------------- problems


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 1),
    )  # fmt: skip
    return model, torch.randn(8, 16)


def _train(model, x, **options):
    torch._dynamo.reset()
    optimized = remat.optimize(model, **options)
    for _ in range(2):
        optimized(x).sum().backward()
    return optimized.remat


def test_a_corrupt_problem_entry_is_measured_again(tmp_path):
    model, x = _mlp()
    first = _train(model, x, budget=1.0, solver="greedy", cache=tmp_path)
    assert first.cache.counts["problem miss"] == 1
    (path,) = _entries(tmp_path, "problem")
    good = path.read_text()
    hit = _train(model, x, budget=1.0, solver="greedy", cache=tmp_path)
    assert hit.cache.counts["problem hit"] == 1
    assert hit.graphs[0].extracted.problem == first.graphs[0].extracted.problem
    entry = json.loads(good)
    entry["problem"]["nodes"][0][0] = "renamed"  # another graph's nodes
    for damaged in (good[:100], json.dumps(entry)):
        path.write_text(damaged)
        again = _train(model, x, budget=1.0, solver="greedy", cache=tmp_path)
        assert again.cache.counts["problem bad"] == 1
        assert again.graphs[0].extracted.problem == first.graphs[0].extracted.problem
        assert path.read_text() == good


# ----------------------------------------------------------------------------- processes

_PLAN_ONCE = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    import remat
    from remat.tools.examples import load

    barrier, together = Path(sys.argv[1]), int(sys.argv[2])
    (barrier / f"ready-{os.getpid()}").touch()
    while len(list(barrier.glob("ready-*"))) < together:  # all plan at the same moment
        time.sleep(0.01)
    model, inputs = load("gpt", layers=2, d_model=32, heads=2, seq=16, batch=2, vocab=64)
    optimized = remat.optimize(model, budget=0.8)
    for _ in range(2):
        optimized(*inputs).backward()
    report = optimized.remat.report()
    print(json.dumps({"counts": optimized.remat.cache.counts,
                      "saved": sorted(report.graphs[0].plan.saved),
                      "peak": report.predicted_peak}))
    """
)


def _processes(n: int, folder: Path, barrier: Path) -> list[dict]:
    env = {**os.environ, "REMAT_CACHE_DIR": str(folder), "REMAT_CACHE": "1"}
    barrier.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", _PLAN_ONCE, str(barrier), str(n)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.slow
def test_processes_planning_at_once_leave_one_entry_a_restart_reuses(tmp_path):
    """Two processes plan the same model at once: at least one finds no entry and plans
    (the other too, unless the first wrote before it looked: a race the barrier narrows but
    cannot close under load), and one whole entry of each kind remains; a third process
    reads both and plans nothing, arriving at the same plan."""
    entries = tmp_path / "cache"
    together = _processes(2, entries, tmp_path / "barrier1")
    for run in together:
        counts = run["counts"]
        assert counts.get("problem miss", 0) + counts.get("problem hit", 0) == 1, counts
        assert not any(k.endswith("bad") for k in counts), counts
    assert any(run["counts"].get("problem miss") == 1 for run in together)
    assert len(_entries(entries, "problem")) == 1
    assert len(_entries(entries, "plan")) >= 1
    assert not list(entries.glob(".*.tmp"))  # no temporary file left behind
    for path in entries.glob("*.json"):
        assert json.loads(path.read_text())["format"] == cache.FORMAT
    (restarted,) = _processes(1, entries, tmp_path / "barrier2")
    counts = restarted["counts"]
    assert counts.get("problem hit") == 1 and counts.get("plan hit", 0) >= 1
    assert not any(k.endswith(("miss", "bad")) for k in counts), counts
    assert (restarted["saved"], restarted["peak"]) in [(t["saved"], t["peak"]) for t in together]


def test_keys_follow_remats_source(monkeypatch):
    joint, n = _linear_joint((4, 6))
    cpu = torch.device("cpu")
    assert keys.source_digest() == keys.source_digest()  # stable within a process
    before = keys.problem_key(joint, n, "roofline", cpu), keys.plan_key(chain(6), 1000, "auto")
    monkeypatch.setattr(keys, "source_digest", lambda: "an edited checkout")
    after = keys.problem_key(joint, n, "roofline", cpu), keys.plan_key(chain(6), 1000, "auto")
    assert before[0] != after[0] and before[1] != after[1]
