"""``remat.tools.bench`` and the ``remat bench`` / ``remat pareto`` commands, on small models."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from torch import nn

import remat
from remat.tools import bench, commands, examples
from remat.tools.bench import run_bench
from remat.tools.cli import main
from remat.tools.rows import (
    GRAD_TOLERANCE,
    Row,
    dominates,
    fastest_within,
    frontier,
    plot_rows,
    rounds_faster,
    rows_table,
)

# Tiny MLP (as in test_cli): compiles in about a second; remat's minimum is ~48% of store-all.
MLP_SIZE = {"layers": 8, "width": 32, "batch": 256}
MLP = ["mlp", "--size", "layers=8", "--size", "width=32", "--size", "batch=256"]
HF_SIZE = {"layers": 2, "d_model": 64, "heads": 4, "seq": 64, "batch": 2}
BUDGETS = [1.0, 0.75, 0.55, 0.2]  # 0.2 is below remat's minimum: an error row


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [line for line in err.strip().splitlines() if "USDT" not in line]
    assert len(lines) == 1, err  # one line, no traceback
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def check_remat_rows(rows: list[Row]) -> None:
    """Measured peak within 10% of the budget, and monotone in the budget."""
    done = [r for r in rows if r.method == "remat" and r.error is None]
    assert done
    for r in done:
        assert r.budget_bytes is not None and r.predicted_peak is not None
        assert r.predicted_peak <= r.budget_bytes
        assert r.predicted_s is not None and r.predicted_s > 0  # the step time estimated
        assert r.peak_bytes <= 1.10 * r.budget_bytes, r
    for curve in {(r.solver, r.cost_model) for r in done}:
        by_budget = sorted(
            (r for r in done if (r.solver, r.cost_model) == curve), key=lambda r: r.budget_bytes
        )
        peaks = [r.peak_bytes for r in by_budget]
        assert peaks == sorted(peaks), [(r.budget, r.peak_bytes) for r in by_budget]


@pytest.fixture(scope="module")
def mlp_rows() -> list[Row]:
    messages: list[str] = []
    rows = run_bench(
        "mlp", BUDGETS, repeat=2, size_kwargs=MLP_SIZE, progress=messages.append, threads=1
    )
    rows_progress[:] = messages
    return rows


rows_progress: list[str] = []


# ----------------------------------------------------------------------------- run_bench


def test_every_configuration_has_a_row(mlp_rows):
    labels = [r.label for r in mlp_rows]
    assert labels == [
        "eager",
        "checkpoint",
        *(f"torch min-cut @ {b:g}" for b in BUDGETS),
        *(f"remat auto @ {b:g}" for b in BUDGETS),
    ]
    assert any(m.startswith("[1/10] eager") for m in rows_progress)  # one line per config
    assert any(m.startswith("timing round 2/2") for m in rows_progress)


def test_measured_rows(mlp_rows):
    eager = mlp_rows[0]
    assert eager.overhead == 0.0
    for r in mlp_rows:
        if r.error is None:
            assert r.peak_bytes > 0 and r.step_s > 0, r
            assert len(r.times) == 2 and r.compile_s >= 0
            assert r.overhead == pytest.approx(r.step_s / eager.step_s - 1)
            assert r.spread == pytest.approx(bench._spread(r.times)) and r.spread >= 0
    torch_rows = [r for r in mlp_rows if r.method == "torch"]
    assert all(r.error is None for r in torch_rows)  # torch takes any fraction
    # No random ops: every program computes eager's gradients, up to float reordering.
    assert eager.grad_error == 0.0
    assert all(r.grads_ok and r.grad_error is not None for r in mlp_rows if r.error is None)
    for r in mlp_rows:
        if r.method == "remat" and r.error is None:
            # auto's plans carry a bound (the patterns' LP or CP-SAT's): a gap in [0, 1]
            assert r.status in ("optimal", "feasible") and 0.0 <= r.gap <= 1.0
            assert r.graphs == 1 and r.plan_s > 0


def test_remat_peak_within_budget_and_monotone(mlp_rows):
    check_remat_rows(mlp_rows)
    failed = [r for r in mlp_rows if r.method == "remat" and r.error is not None]
    assert [r.budget for r in failed] == [0.2]  # every budget above remat's minimum fits
    (infeasible,) = failed
    assert infeasible.error.startswith("infeasible: budget") and "minimum" in infeasible.error
    assert infeasible.peak_bytes is None and infeasible.step_s is None
    assert "infeasible" in rows_table(mlp_rows)


def test_checkpoint_row_without_blocks(monkeypatch):
    def flat(seed=0, device="cpu"):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Flatten(0))
        return _SumLoss(model).to(device), (torch.randn(4, 8, device=device),)

    monkeypatch.setitem(examples.EXAMPLES, "flat", flat)
    rows = run_bench("flat", [1.0], methods=("eager", "checkpoint"), repeat=1)
    assert rows[0].error is None and rows[0].peak_bytes > 0
    assert rows[1].method == "checkpoint" and "no `blocks`" in rows[1].error


class _SumLoss(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).sum()


def test_run_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown method"):
        run_bench("mlp", [1.0], methods=("eager", "magic"))
    with pytest.raises(ValueError, match="repeat"):
        run_bench("mlp", [1.0], repeat=0)
    with pytest.raises(ValueError, match="budgets"):
        run_bench("mlp", [-0.5])
    with pytest.raises(ValueError, match="compiler"):
        run_bench("mlp", [1.0], compiler="tvm")
    with pytest.raises(ValueError, match="cost models"):
        run_bench("mlp", [1.0], cost_model=("roofline", "guess"))


def test_spread_is_half_the_interquartile_range_over_the_median():
    assert bench._spread([2.0]) is None  # one step: no spread to report
    # quartiles of 1..5 (inclusive) are 2 and 4, the median 3: (4 - 2) / 2 / 3
    assert bench._spread([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx(1 / 3)
    assert bench._spread([1.5, 1.5, 1.5]) == 0.0


def test_timing_rounds_shuffle_the_order_reproducibly():
    configs = [bench._Config(Row("remat", budget=b / 10)) for b in range(1, 11)]
    assert bench._round_order(configs, 0) == configs  # the first round in table order
    later = [bench._round_order(configs, r) for r in range(1, 4)]
    assert all(sorted(map(id, o)) == sorted(map(id, configs)) for o in later)
    assert any(o != configs for o in later)
    assert later == [bench._round_order(configs, r) for r in range(1, 4)]  # same seeds


def test_dominates_and_frontier():
    def row(method, peak, step, budget=None):
        return Row(method, budget=budget, solver="auto", peak_bytes=peak, step_s=step)

    t1, t2 = row("torch", 100, 1.0, 1.0), row("torch", 60, 1.3, 0.5)
    r1, r2 = row("remat", 100, 1.01, 1.0), row("remat", 70, 1.1, 0.6)
    verdicts = dict((t.budget, r) for t, r in dominates([t1, t2, r1, r2]))
    assert verdicts[1.0] is r1  # 1.01 <= 1.02 x 1.0
    assert verdicts[0.5] is None  # nothing at peak <= 60
    assert fastest_within([t1, r1, r2], 100) is r1 and fastest_within([r2], 60) is None
    t4, r4 = row("torch", 80, 1.0, 0.7), row("remat", 75, 1.05, 0.65)
    t4.spread, r4.spread = 0.01, 0.04
    assert dominates([t4, r4]) == [(t4, None)]  # 1.05x: a miss, within the noise
    assert commands._nearest_text([t4, r4], t4) == (
        "torch min-cut @ 0.7 (nearest: remat auto @ 0.65 at 1.050x its time, +-4.0%)"
    )
    assert "no remat point" in commands._nearest_text([t4], t4)
    t4.times, r4.times = [1.0, 1.2, 0.9, 1.0], [1.0, 1.1, 1.0, 0.95]  # rounds, in order
    assert rounds_faster(r4, t4) == (2, 4) and rounds_faster(t4, r4) == (1, 4)
    assert commands._nearest_text([t4, r4], t4) == (
        "torch min-cut @ 0.7 (nearest: remat auto @ 0.65 at 1.050x its time, "
        "faster in 2/4 rounds, +-4.0%)"
    )
    assert frontier([t1, t2, r1, r2]) == [t1, t2, r2]
    # Wrong gradients: such a torch point needs no dominating, such a remat point cannot.
    t3 = row("torch", 10, 1.0, 0.1)
    t3.grad_error = 0.1
    r3 = row("remat", 50, 1.0, 0.4)
    r3.grad_error = 0.1
    verdicts = dominates([t1, t2, t3, r1, r2, r3])
    assert [t for t, _ in verdicts] == [t1, t2] and verdicts[1][1] is None  # r3 is not used


@pytest.mark.slow
def test_bench_flags_wrong_gradients_of_recomputed_dropout():
    """torch's memory-budget partition recomputes dropout with a new mask on CPU
    (pytorch#190758); remat replays the mask. The bench tells them apart."""
    size = dict(layers=3, d_model=64, heads=4, seq=128, batch=4, vocab=128, dropout=0.1)
    rows = run_bench("gpt", [0.5], methods=("eager", "torch", "remat"), repeat=1, size_kwargs=size)
    eager, torch_row, remat_row = rows
    assert torch_row.grad_error > GRAD_TOLERANCE and not torch_row.grads_ok
    assert remat_row.error is None and remat_row.grads_ok, remat_row
    table = rows_table(rows)
    assert "WRONG" in table and "= eager" in table


def test_bench_in_bfloat16_checks_compiled_rows_against_plain_torch_compile():
    """Below float32 the compiled graph rounds its decomposed ops otherwise than eager, so
    torch's and remat's rows are compared with a plain torch.compile step's gradients."""
    rows = run_bench(
        "mlp",
        [0.75],
        methods=("eager", "torch", "remat"),
        repeat=1,
        size_kwargs={**MLP_SIZE, "dtype": "bfloat16"},
        threads=1,
    )
    assert [r.error for r in rows] == [None] * 3, rows
    assert [r.grad_reference for r in rows] == ["eager", "torch.compile", "torch.compile"]
    assert all(r.grads_ok for r in rows), rows
    check_remat_rows(rows)


@pytest.mark.slow
def test_bench_under_inductor_compiles_each_budget_and_checks_gradients(monkeypatch):
    """Every torch budget is compiled (dynamo reused the first budget's step for all of
    them with the shared "inductor" backend), and on a model with dropout torch's rows
    are checked against plain torch.compile's gradients (inductor draws its own masks,
    so against eager's they compared as WRONG), remat's against eager's (its programs
    draw the masks from eager's generator)."""
    from torch._inductor import compile_fx as module

    compiled, real = [], module.compile_fx

    def spy(gm, example_inputs, **kwargs):
        compiled.append(gm)
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(module, "compile_fx", spy)
    size = dict(layers=1, d_model=32, heads=2, seq=32, batch=2, vocab=64, dropout=0.1)
    rows = run_bench(
        "gpt", [1.0, 0.8], methods=("eager", "torch", "remat"), compiler="inductor",
        solvers=("greedy",), repeat=1, size_kwargs=size,
    )  # fmt: skip
    assert [r.error for r in rows] == [None] * 5, rows
    assert all(r.grad_error is not None and r.grads_ok for r in rows), rows
    references = ["eager"] + ["torch.compile"] * 2 + ["eager"] * 2
    assert [r.grad_reference for r in rows] == references
    # the reference, torch at 1 and 0.8 (remat compiles its programs apart)
    assert len({id(gm) for gm in compiled}) == 3


@pytest.mark.slow
def test_remat_with_inductor_drawing_from_eagers_generator_matches_eager():
    """With ``fallback_random`` dropout reaches remat's partitioner under inductor: the
    rewrite failed on generator states torch's extractor copied into the backward."""
    from torch._inductor import config

    size = dict(layers=1, d_model=32, heads=2, seq=32, batch=2, vocab=64, dropout=0.1)
    model, inputs = examples.load("gpt", **size)
    reference, _ = examples.load("gpt", **size)
    optimized = remat.optimize(model, budget=0.8, compiler="inductor", solver="greedy")
    with config.patch(fallback_random=True):
        torch.manual_seed(0)
        optimized(*inputs).backward()
    torch.manual_seed(0)
    reference(*inputs).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- CLI


def test_bench_cli_writes_json_and_csv(capsys, tmp_path):
    js, cs = tmp_path / "out" / "b.json", tmp_path / "b.csv"
    code, out, err = run(
        capsys,
        "bench",
        *MLP,
        "--budgets",
        "1,0.6",
        "--repeat",
        "1",
        "--cost-model",
        "roofline,profile",
        "--json",
        str(js),
        "--csv",
        str(cs),
    )
    assert code == 0, err
    assert "[1/8] eager" in err and "timing round 1/1" in err
    assert "remat auto, profile @ 0.6" in err  # each cost model plans its own rows
    table = out.split("\n\n")[0]  # the verdict after it may name "torch min-cut @ 0.6"
    assert "torch min-cut" not in table  # the table says "torch" with a budget column
    for header in ("method", "peak", "overhead", "predicted", "gap"):
        assert header in out
    assert "torch points" in out  # the dominance verdict
    data = json.loads(js.read_text())
    assert data["meta"]["model"] == "mlp" and data["meta"]["budgets"] == [1.0, 0.6]
    assert [r["method"] for r in data["rows"]] == ["eager", "checkpoint"] + ["torch"] * 2 + [
        "remat"
    ] * 4
    assert [r["cost_model"] for r in data["rows"][4:]] == ["roofline"] * 2 + ["profile"] * 2
    with cs.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8 and all(int(r["peak_bytes"]) > 0 for r in table)
    assert all(len(r["times"]) == 1 for r in data["rows"])  # each timed step, for the spread
    check_remat_rows([Row(**{k: v for k, v in r.items() if k != "label"}) for r in data["rows"]])


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--budgets", "1,abc"], ["--budgets", "abc"]),
        (["--budgets", "1,-0.5"], ["--budgets", "-0.5"]),
        (["--budgets", "1,,0.5"], ["empty budget"]),
        (["--solvers", "auto,nope"], ["unknown solver 'nope'"]),
        (["--repeat", "0"], ["--repeat"]),
        (["--threads", "-1"], ["--threads"]),
        (["--device", "tpu"], ["cpu or cuda"]),
        (["--compiler", "tvm"], ["--compiler"]),
        (["--cost-model", "roofline,guess"], ["unknown cost model(s) 'guess'"]),
        (["--size", "bogus=1"], ["bogus"]),
        (["--time-limit", "0"], ["--time-limit", "positive"]),
        (["--solvers", "greedy", "--time-limit", "1"], ["auto, cpsat and repeated, not greedy"]),
    ],
)
def test_bench_cli_usage_errors(capsys, argv, needles):
    code, _out, err = run(capsys, "bench", *MLP, "-q", *argv)
    assert_usage_error(code, err, *needles)


def test_bench_cli_unknown_model(capsys):
    code, _out, err = run(capsys, "bench", "no-such-model", "-q")
    assert_usage_error(code, err, "unknown model 'no-such-model'")


def test_pareto_cli_usage_errors(capsys):
    code, _out, err = run(capsys, "pareto", *MLP, "-q", "--points", "1")
    assert_usage_error(code, err, "at least 2 points")
    code, _out, err = run(capsys, "pareto", *MLP, "-q", "--solver", "greedy", "--time-limit", "1")
    assert_usage_error(code, err, "auto, cpsat and repeated, not greedy")


def test_time_limit_reaches_cpsat_in_every_command(capsys, monkeypatch):
    """plan, train, bench and pareto take --time-limit; it is CP-SAT's, so only the rows
    of solvers that run CP-SAT get it (bench with --solvers cpsat,greedy). ``--solver
    cpsat``: ``auto`` may keep a pattern plan its bound proves without searching."""
    from remat.solvers import cpsat as module

    limits, real = [], module.cpsat

    def spy(problem, budget=None, **kwargs):
        limits.append(kwargs.get("time_limit"))
        return real(problem, budget, **kwargs)

    monkeypatch.setattr(module, "cpsat", spy)
    small = ["mlp", "--size", "layers=2", "--size", "width=16", "--size", "batch=8", "-q"]
    fast = ["--repeat", "1", "--time-limit", "0.5"]
    commands = [
        ["plan", *small, "--budget", "0.95", "--solver", "cpsat", "--time-limit", "0.5"],
        ["train", *small, "--budget", "0.95", "--solver", "cpsat", "--steps", "1", *fast],
        ["bench", *small, "--budgets", "0.95", "--solvers", "cpsat,greedy", *fast],
        ["pareto", *small, "--points", "2", "--solver", "cpsat", *fast],
    ]
    for argv in commands:
        limits.clear()
        code, _out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        assert limits and set(limits) == {0.5}, (argv, limits)


def test_plot_without_matplotlib_is_a_usage_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    code, _out, err = run(capsys, "bench", *MLP, "-q", "--plot", str(tmp_path / "p.png"))
    assert_usage_error(code, err, "matplotlib", "'plot' extra")


def test_plot_writes_png(tmp_path, mlp_rows):
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    plot_rows(mlp_rows, tmp_path / "p.png", title="mlp")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_pareto_cli_sweeps_store_all_down_to_the_minimum(capsys, tmp_path):
    js = tmp_path / "p.json"
    code, out, err = run(
        capsys, "pareto", *MLP, "--points", "3", "--repeat", "1", "--json", str(js)
    )
    assert code == 0, err
    assert "remat frontier" in out
    data = json.loads(js.read_text())
    rows = [Row(**{k: v for k, v in r.items() if k != "label"}) for r in data["rows"]]
    assert [r.method for r in rows] == ["eager", "remat", "remat", "remat"]
    assert all(r.error is None for r in rows)  # the minimum itself is feasible
    assert rows[1].budget == data["meta"]["store_all"]
    assert rows[-1].budget == data["meta"]["minimum"]
    check_remat_rows(rows)


# ----------------------------------------------------------------------------- transformers


def test_hf_examples_name_the_extra_when_transformers_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"'transformers' extra"):
        examples.load("hf-gpt2")
    code, _out, err = run(capsys, "bench", "hf-llama", "-q")
    assert_usage_error(code, err, "transformers")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_hf_bench(name):
    pytest.importorskip("transformers", reason="the 'transformers' extra is not installed")
    rows = run_bench(
        name,
        [1.0, 0.7],
        methods=("eager", "checkpoint", "remat"),
        repeat=1,
        size_kwargs=HF_SIZE,
    )
    assert [r.label for r in rows] == ["eager", "checkpoint", "remat auto @ 1", "remat auto @ 0.7"]
    assert all(r.error is None and r.peak_bytes > 0 for r in rows), rows
    assert rows[1].peak_bytes < rows[0].peak_bytes  # checkpointing HF blocks saves memory
    check_remat_rows(rows)


def test_at_torch_peaks_adds_a_remat_row_at_each_torch_points_peak():
    rows = run_bench(
        "mlp", [1.0], methods=("torch", "remat"), repeat=1, size_kwargs=MLP_SIZE,
        at_torch_peaks=True,
    )  # fmt: skip
    (torch_row,) = [r for r in rows if r.method == "torch"]
    matched = [r for r in rows if r.method == "remat" and r.budget == torch_row.peak_bytes]
    assert len(matched) == 1 and matched[0].error is None
    assert matched[0].predicted_peak <= torch_row.peak_bytes
    assert matched[0].step_s is not None  # timed with the others
