"""The ``remat`` command line, run in-process on a tiny MLP (one trace is 1-2 s on 2 cores)."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import remat
from remat.costs import COMPILERS, COST_MODELS
from remat.solvers import SOLVERS, format_bytes
from remat.tools.cli import main
from remat.tools.examples import EXAMPLES
from remat.tools.helptext import COMPILER_TEXT, COST_MODEL_TEXT
from remat.tools.output import INSPECT_COLUMNS

# Small enough to trace in a second or two, big enough that half the store-all peak is
# feasible (the smallest peak remat reaches here is ~48% of store-all).
MLP = ["mlp", "--size", "layers=8", "--size", "width=32", "--size", "batch=256"]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def parse_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def parse_seconds(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"s": 1, "ms": 1e-3, "µs": 1e-6}[unit]


def key_values(out: str) -> dict[str, str]:
    """Rows of a two-column table printed as 'label   value' (two or more spaces apart)."""
    rows = {}
    for line in out.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) >= 2:
            rows[parts[0]] = parts[1:]
    return rows


def assert_usage_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one clear line, no traceback
    for needle in needles:
        assert needle in lines[0], lines[0]


# ----------------------------------------------------------------------------- inspect


def test_inspect_table_sorted_by_bytes(capsys):
    code, out, err = run(capsys, "inspect", *MLP, "--sort", "bytes", "--limit", "6")
    assert code == 0, err
    assert "tracing mlp" in err  # progress goes to stderr
    lines = out.splitlines()
    header = lines[1].split()
    for column in INSPECT_COLUMNS:
        assert column.split()[0] in header
    rows = [line for line in lines[3:] if re.match(r"^\d+\s", line)]
    assert len(rows) == 6
    sizes = [parse_bytes(" ".join(re.split(r"\s{2,}", row)[5].split()[:2])) for row in rows]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 256 * 32 * 4
    assert "[256, 32]" in rows[0] and "float32" in rows[0]
    summary = re.search(
        r"graph0: (\d+) nodes \((\d+) fwd, (\d+) bwd\), activation bytes .* \((\d+) B", out
    )
    assert summary, out
    total, fwd, bwd, act = map(int, summary.groups())
    assert total == fwd + bwd and total > 6 and act >= 16 * 256 * 32 * 4
    assert f"showing 6 of {total} rows" in out


def test_inspect_lists_every_node_in_order_and_views(capsys):
    code, out, _ = run(capsys, "inspect", *MLP, "-q")
    assert code == 0
    indices = [int(m.group(1)) for m in re.finditer(r"^(\d+)\s", out, re.MULTILINE)]
    total = int(re.search(r"graph0: (\d+) nodes", out).group(1))
    assert indices == list(range(total))
    assert re.search(r"\bt_\d+\s.*\bt\b.*(fwd|bwd)\s+yes\s+\S+", out)  # a transpose is a view


def test_inspect_bad_graph_index(capsys):
    code, _, err = run(capsys, "inspect", *MLP, "--graph", "3", "-q")
    assert_usage_error(code, err, "--graph 3", "1 graph")


def test_plan_writes_the_graph_and_plan_as_dot(capsys, tmp_path):
    path = tmp_path / "out" / "plan.dot"
    code, out, err = run(capsys, "plan", *MLP, "--budget", "60%", "--dot", str(path))
    assert code == 0, err
    text = path.read_text()
    assert text.startswith("digraph remat {") and text.rstrip().endswith("}")
    boxes = re.findall(r'g0n(\d+) \[label="([^"]*)", fillcolor="([^"]*)"\]', text)
    edges = re.findall(r"g0n(\d+) -> g0n(\d+);", text)
    fills = {fill for _, _, fill in boxes}
    # a plan at 60% of an MLP's store-all peak saves some values and recomputes others
    assert {"#9ecae1", "#fdae6b", "#d9d9d9"} <= fills
    ids = {int(i) for i, _, _ in boxes}
    assert ids == set(range(len(ids))) and edges
    assert all(int(a) < int(b) and int(a) in ids for a, b in edges)  # reads run earlier
    assert "addmm" in text and "wrote" in err
    # a legend in the file explains every fill it uses, and the box's lines
    legend = re.findall(r'legend_(\w+) \[label="([^"]*)", fillcolor="([^"]*)"\]', text)
    assert {fill for _, _, fill in legend} == fills
    meaning = {role: label for role, label, _ in legend}
    assert meaning["saved"].startswith("saved") and meaning["recomputed"].startswith("recomp")
    assert "module path" in text


def test_inspect_dot_legend_has_no_plan(capsys, tmp_path):
    path = tmp_path / "graph.dot"
    code, _, err = run(capsys, "inspect", *MLP, "-q", "--dot", str(path))
    assert code == 0, err
    legend = re.findall(r'legend_(\w+) \[label="[^"]*", fillcolor', path.read_text())
    assert legend == ["fwd", "bwd"]


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize("budget", ["60%", "0.6"])
def test_plan_fraction(capsys, budget):
    code, out, err = run(capsys, "plan", *MLP, "--budget", budget)
    assert code == 0, err
    rows = key_values(out)
    predicted = parse_bytes(rows["predicted peak"][0])
    store_all = parse_bytes(rows["store-all peak"][0])
    limit = parse_bytes(rows["budget"][0])
    assert predicted <= limit <= 0.6 * store_all + 1024
    assert int(rows["saved values"][0]) > 0 and int(rows["recomputed values"][0]) > 0
    assert parse_bytes(rows["recomputed bytes"][0]) > 0
    assert float(rows["peak / store-all"][0].rstrip("%")) <= 60.0
    assert re.fullmatch(r"\+\d+\.\d% of forward", rows["recompute overhead"][0])
    # auto: the pattern plan where its bound proves it, else CP-SAT's; both with a bound
    assert rows["solver"][0] in ("repeated", "cpsat")
    assert rows["status"][0] in ("feasible", "optimal")
    assert rows["gap"][0].endswith("%") and rows["lower bound"][0] != "-"
    assert re.fullmatch(r"\d+\.\d{3} s", rows["solve time"][0])
    assert re.search(rf"budget {re.escape(budget)}: predicted peak .* \((\d+) B\)", out)


def _predicted_bytes(out: str) -> int:
    return int(re.search(r": predicted peak .* \((\d+) B\), .* \((\d+) B\)", out).group(1))


def test_plan_values_by_module(capsys):
    code, out, err = run(capsys, "plan", *MLP, "--budget", "60%", "--values", "-q")
    assert code == 0, err
    table = out[out.index("value (module: op)") :]
    rows = key_values(table)
    kinds = {row[0] for row in rows.values() if row[0] in ("saved", "recomputed")}
    assert kinds == {"saved", "recomputed"}
    # the MLP's layers are blocks.0.0 (Linear), blocks.0.1 (GELU), ...: its values are
    # named by them
    assert re.search(r"^blocks\.\d+\.1: gelu\s+recomputed", table, re.MULTILINE), table
    summary = re.search(r"values of the step's joint plan: (\d+) saved .*, (\d+) recomputed", out)
    plan = key_values(out)
    assert summary and summary.groups() == (plan["saved values"][0], plan["recomputed values"][0])


def test_plan_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", *MLP, "--budget", "60%", "--json", str(path), "-q")
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["model"] == "mlp" and data["budget"] == "60%"
    assert data["predicted_peak_bytes"] == _predicted_bytes(out)  # to the byte
    (graph,) = data["graphs"]
    assert type(graph["saved_bytes"]) is int and type(graph["step_seconds"]) is float
    assert graph["recomputed_values"] == int(key_values(out)["recomputed values"][0])
    assert any(v["module"].startswith("blocks.") for v in data["steps"][0]["values"])

    code, out, err = run(capsys, "plan", *MLP, "--budget", "60%", "--json", "-", "-q")
    assert code == 0, err
    printed = json.loads(out)  # stdout holds the JSON alone
    assert set(printed) == set(data)
    assert printed["predicted_peak_bytes"] == data["predicted_peak_bytes"]


def test_plan_timeline(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    path = tmp_path / "out" / "memory.png"
    code, out, err = run(capsys, "plan", *MLP, "--budget", "60%", "--timeline", str(path))
    assert code == 0, err
    assert path.read_bytes().startswith(b"\x89PNG") and "memory.json" in err
    data = json.loads(path.with_suffix(".json").read_text())
    assert max(data["predicted"]["bytes"]) == _predicted_bytes(out)  # to the byte
    store_all = int(re.search(r"store-all peak .* \((\d+) B\)$", out, re.MULTILINE).group(1))
    assert max(data["store_all"]["bytes"]) == store_all
    assert data["predicted"]["peak_bytes"] <= data["limit_bytes"] < store_all
    assert "measured" not in data  # nothing ran


def test_timeline_without_matplotlib_is_refused_before_tracing(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    for command in ("plan", "train"):
        code, out, err = run(capsys, command, *MLP, "--budget", "60%", "--timeline", "t.png")
        assert_usage_error(code, err, "--timeline needs matplotlib", "'plot' extra")
        assert out == ""


def test_plan_absolute_budget_and_store_all(capsys):
    code, out, err = run(capsys, "plan", *MLP, "--budget", "1MiB", "--solver", "store-all")
    assert code == 0, err
    rows = key_values(out)
    assert rows["budget"][0] == "1.0 MiB"
    assert rows["solver"][0] == "store-all"
    # nothing recomputed: the values it moves to the backward are computed there once
    assert rows["recomputed bytes"][0] == "0 B" and rows["recompute (est.)"][0] == "0"
    assert rows["recompute overhead"][0] == "+0.0% of forward"
    assert rows["predicted peak"][0] == rows["store-all peak"][0]


def test_plan_infeasible_budget_names_the_minimum(capsys):
    code, out, err = run(capsys, "plan", *MLP, "--budget", "10%")
    assert_usage_error(code, err.strip().splitlines()[-1], "lowest peak", "at least")
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("budget", ["1", "abc", "150%"])
def test_a_bad_budget_reads_the_same_on_the_command_line_and_in_python(capsys, budget):
    code, _, err = run(capsys, "plan", *MLP, "--budget", budget)
    with pytest.raises(remat.InvalidOption) as python:
        remat.optimize(torch.nn.Linear(2, 2), budget=budget)
    assert_usage_error(code, err, str(python.value))


def test_plan_fixed_solver_over_budget(capsys):
    code, _, err = run(capsys, "plan", *MLP, "--budget", "50%", "--solver", "store-all", "-q")
    assert_usage_error(code, err, "store-all", "does not adapt")


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["plan", *MLP, "--budget", "lots"], ["--budget", "cannot read budget"]),
        (["plan", *MLP, "--budget", "150%"], ["--budget", "fraction"]),
        (["plan", *MLP, "--budget", "12 parsecs"], ["unknown unit"]),
        (["plan", *MLP, "--budget", "64"], ["ambiguous", '"64KiB"']),
        (["bench", *MLP, "--budgets", "0.5,min"], ["--budgets", "remat pareto"]),
        (["plan", *MLP, "--budget", "0.5", "--solver", "magic"], ["invalid choice", "greedy"]),
        (["plan", *MLP], ["--budget"]),
        (["train", *MLP, "--steps", "0"], ["--steps", "positive"]),
        (["inspect", *MLP, "--sort", "size"], ["invalid choice"]),
        (["inspect", "mlp", "--size", "layers"], ["key=value"]),
        (["train", *MLP, "--size", "dtype=bfloat", "--budget", "0.9", "-q"], ["bfloat16"]),
        (["frobnicate"], ["invalid choice"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, needles):
    code, out, err = run(capsys, *argv)
    assert_usage_error(code, err, *needles)
    assert out == ""


def test_unknown_model_lists_builtins(capsys):
    code, _, err = run(capsys, "inspect", "resnet9000", "-q")
    assert_usage_error(
        code,
        err,
        "unknown model 'resnet9000'",
        "cnn, gpt, hf-gpt2, hf-gpt2-labels, hf-llama, mlp, unet",
    )


def test_unknown_size_key(capsys):
    code, _, err = run(capsys, "plan", "mlp", "--size", "depth=3", "--budget", "0.5", "-q")
    assert_usage_error(code, err, "depth")


def test_unimportable_factory(capsys):
    code, _, err = run(capsys, "inspect", "no_such_module_xyz:make", "-q")
    assert_usage_error(code, err, "cannot import module 'no_such_module_xyz'")


def test_user_factory_module(capsys, tmp_path, monkeypatch):
    (tmp_path / "tiny_models.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Net(torch.nn.Module):
                def __init__(self, width):
                    super().__init__()
                    self.a = torch.nn.Linear(width, width)
                    self.b = torch.nn.Linear(width, 1)

                def forward(self, x):
                    return self.b(torch.tanh(self.a(x))).pow(2).mean()

            def make(width=8, batch=4):
                return Net(width), (torch.randn(batch, width),)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "inspect", "tiny_models:make", "--size", "width=16", "-q")
    assert code == 0, err
    assert "tanh" in out and "[4, 16]" in out
    assert err == ""  # --quiet


def test_factory_module_in_the_current_folder(capsys, tmp_path, monkeypatch):
    """``remat`` finds ``module:factory`` in the current folder, as ``python -m`` would,
    though the console script's ``sys.path`` does not hold it."""
    (tmp_path / "models_here.py").write_text(
        "import torch\n\n"
        "def make():\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())\n"
        "    return net, (torch.randn(4, 8),)\n"
    )
    monkeypatch.chdir(tmp_path)
    here = {"", ".", str(tmp_path)}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in here])
    monkeypatch.delitem(sys.modules, "models_here", raising=False)
    code, out, err = run(capsys, "inspect", "models_here:make", "-q")
    assert code == 0, err
    assert "tanh" in out


# ----------------------------------------------------------------------------- train


def test_train_eager_vs_remat(capsys):
    code, out, err = run(capsys, "train", *MLP, "--budget", "60%", "--steps", "2", "--repeat", "2")
    assert code == 0, err
    assert "step 2/2" in err and "compiling mlp" in err
    assert "predicted peak" in out and "recompute overhead" in out  # the plan comes first
    rows = key_values(out)
    eager_peak, remat_peak = map(parse_bytes, rows["peak memory (measured, fwd+bwd)"])
    assert 0 < remat_peak < eager_peak
    predicted = parse_bytes(rows["predicted peak"][1])
    assert remat_peak <= 1.05 * predicted + 4096
    # a fraction says what it is of: store-all, or torch's partition where that is lower
    assert re.fullmatch(r"60% of (store-all|torch's partition) [\d.]+ \w+ = .+", rows["budget"][1])
    time = r"[\d.]+ (s|ms|µs)"
    spreads = [re.fullmatch(rf"({time}) \(({time}) - ({time})\)", t)
               for t in rows["step time (median of 2, min-max)"]]  # fmt: skip
    assert all(spreads), rows
    for spread in spreads:
        median, low, high = (parse_seconds(spread.group(k)) for k in (1, 3, 5))
        assert low <= median <= high
    ratio = re.search(r"step time: remat ([\d.]+)x eager's \(median over 2 rounds, "
                      r"([\d.]+)x - ([\d.]+)x\)", out)  # fmt: skip
    assert ratio, out
    median, low, high = map(float, ratio.groups())
    assert low <= median <= high
    for step in (1, 2):
        eager_loss, remat_loss = map(float, rows[f"loss step {step}"])
        assert eager_loss == pytest.approx(remat_loss, rel=1e-5)
    assert "within the budget: yes" in out
    assert re.search(r"losses: remat's (match|equal) eager's", out)


def test_train_in_bfloat16(capsys):
    argv = ["train", *MLP, "--budget", "60%", "--steps", "1", "-q"]
    code, out, err = run(capsys, *argv, "--size", "dtype=bfloat16")
    assert code == 0, err
    rows = key_values(out)
    eager_peak, remat_peak = map(parse_bytes, rows["peak memory (measured, fwd+bwd)"])
    assert remat_peak == parse_bytes(rows["predicted peak"][1]) < eager_peak
    assert "within the budget: yes" in out
    assert re.search(r"losses: remat's (match|equal) eager's", out)
    _, float32_out, _ = run(capsys, *argv)
    float32_peak = parse_bytes(key_values(float32_out)["peak memory (measured, fwd+bwd)"][0])
    assert eager_peak < 0.75 * float32_peak  # activations and gradients in two bytes, not four


def test_train_timeline_has_the_measured_memory(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    path = tmp_path / "train.png"
    argv = ["train", *MLP, "--budget", "60%", "--steps", "1", "--repeat", "1", "-q"]
    code, out, err = run(capsys, *argv, "--timeline", str(path))
    assert code == 0, err
    assert path.read_bytes().startswith(b"\x89PNG")
    data = json.loads(path.with_suffix(".json").read_text())
    measured = data["measured"]
    assert max(measured["bytes"]) == measured["peak_bytes"]
    assert len(measured["seconds"]) == len(measured["bytes"])
    # the measured peak is the one the table prints
    rows = key_values(out)
    assert format_bytes(measured["peak_bytes"]) == rows["peak memory (measured, fwd+bwd)"][1]
    assert max(data["predicted"]["bytes"]) == _predicted_bytes(out)


def test_train_infeasible_budget(capsys):
    code, out, err = run(capsys, "train", *MLP, "--budget", "5%", "--steps", "1", "-q")
    assert_usage_error(code, err, "lowest peak")


@pytest.mark.slow
def test_train_gpt_with_dropout(capsys):
    gpt = ["gpt", "--size", "layers=2", "--size", "d_model=32", "--size", "seq=32"]
    code, out, err = run(capsys, "train", *gpt, "--steps", "2", "--repeat", "1", "--budget", "0.75")
    assert code == 0, err
    rows = key_values(out)
    eager_peak, remat_peak = map(parse_bytes, rows["peak memory (measured, fwd+bwd)"])
    assert remat_peak < eager_peak
    assert "within the budget: yes" in out
    # remat replays eager's dropout masks, so the losses match step by step
    assert re.search(r"losses: remat's (match|equal) eager's", out)


def test_train_passes_compiler_and_solver(capsys, monkeypatch):
    import remat

    seen = {}
    real = remat.optimize

    def spy(model, budget, **kwargs):
        seen.update(kwargs, budget=budget)
        return real(model, budget, **{**kwargs, "compiler": "eager"})

    monkeypatch.setattr(remat, "optimize", spy)
    argv = ["train", *MLP, "--steps", "1", "--repeat", "1", "--budget", "300KiB"]
    code, out, err = run(capsys, *argv, "--compiler", "inductor", "--solver", "greedy", "-q")
    assert code == 0, err
    assert seen == {
        "budget": remat.Budget.parse(300 * 1024),  # parsed once, passed down
        "solver": "greedy",
        "compiler": "inductor",
        "cost_model": "roofline",
    }
    assert "compiler inductor" in out


# ----------------------------------------------------------------------------- entry points


def test_python_dash_m_help():
    result = subprocess.run(
        [sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for command in ("inspect", "plan", "train"):
        assert command in result.stdout
    assert result.stdout.startswith("usage: remat")


def test_help_and_version_in_process(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0 and "--budget" in out and "--compiler" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("remat ")


def help_text(capsys, monkeypatch, *argv: str) -> str:
    """``remat ARGV --help`` on stdout, its whitespace (argparse's wrapping) made single."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run(capsys, *argv, "--help")
    assert code == 0, err
    return " ".join(out.split())


def first_sentence(obj) -> str:
    text = " ".join(inspect.getdoc(obj).split()).replace("``", "")
    return re.match(r".+?\.(?=\s|$)", text).group(0)


def test_plan_help_describes_every_solver_by_its_docstring(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "plan")
    assert f"planning algorithm (default {next(iter(SOLVERS))}):" in text
    for name, solver in SOLVERS.items():
        assert f"{name}: {first_sentence(solver)}" in text, name


@pytest.mark.parametrize("command", ["inspect", "plan", "train", "bench", "pareto"])
def test_help_describes_every_example_cost_model_and_compiler(capsys, monkeypatch, command):
    text = help_text(capsys, monkeypatch, command)
    for name, factory in EXAMPLES.items():
        assert f"{name}: {first_sentence(factory)}" in text, name
    for name in COST_MODELS:  # a KeyError: a cost model the help does not describe
        assert f"{name}: {COST_MODEL_TEXT[name]}" in text, name
    if command in ("train", "bench", "pareto"):
        for name in COMPILERS:
            assert f"{name}: {COMPILER_TEXT[name]}" in text, name


@pytest.mark.parametrize("command", ["inspect", "plan", "train", "pareto"])
def test_every_command_takes_one_cost_model_and_bench_a_list(command):
    """``bench``'s list-valued --cost-model once stripped the option from the shared one:
    the commands after it refused --cost-model and listed it as a positional."""
    from remat.tools.cli import build_parser

    parser = build_parser()
    argv = [command, "mlp", *(["--budget", "50%"] if command == "plan" else [])]
    assert parser.parse_args([*argv, "--cost-model", "profile"]).cost_model == "profile"
    assert parser.parse_args(argv).cost_model == "roofline"
    bench = parser.parse_args(["bench", "mlp", "--cost-model", "roofline,profile"])
    assert bench.cost_model == ["roofline", "profile"]
