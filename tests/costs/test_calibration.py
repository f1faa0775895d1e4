"""The roofline's figures measured on this machine (``remat.costs.calibration``): what is
measured, how it is kept per machine, and what the report says of estimates made without
it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dispatch.python import enable_python_dispatcher

import remat
from remat.cache import PlanCache
from remat.costs import DeviceSpec, calibration

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def figures():
    return calibration.measure(CPU, [torch.float32, torch.bfloat16])


def test_every_figure_is_measured_and_positive(figures):
    assert set(figures["matmul"]) == {"float32", "bfloat16"}
    for rates in figures["matmul"].values():
        sides = [n for n, _ in rates]
        assert sides == sorted(sides) and all(rate > 0 for _, rate in rates)
    assert set(figures["batched"]) == {"float32", "bfloat16"}
    assert all(rate > 0 for rate in figures["batched"].values())
    rates = ("pointwise", "read", "random", "mixed", "select", "cast", "transcendental", "tanh")
    rates += ("replay", "softmax mask")
    assert all(figures[name] > 0 for name in rates)
    assert 0 < figures["launch"] < 1e-3  # a tiny op on CPU: microseconds, not milliseconds
    moved = [n for n, _ in figures["stream"]]
    assert moved == sorted(moved) and all(rate > 0 for _, rate in figures["stream"])


def test_a_spec_streams_at_its_measured_rates_between_and_past_its_sizes():
    spec = DeviceSpec("t", 1.0, bandwidth=5.0, launch_overhead=0.0, stream=((4, 10.0), (16, 30.0)))
    assert spec.stream_rate(1) == 10.0  # flat below the smallest size measured
    assert spec.stream_rate(4) == 10.0
    assert spec.stream_rate(8) == pytest.approx(20.0)  # halfway in log size
    assert spec.stream_rate(1 << 20) == 30.0  # flat past the largest
    assert DeviceSpec("t", 1.0, bandwidth=5.0, launch_overhead=0.0).stream_rate(8) == 5.0


@pytest.fixture
def fresh_process():
    """No figures memoised by an earlier test, nor left for a later one."""
    calibration._figures.cache_clear()
    yield
    calibration._figures.cache_clear()


def test_the_figures_are_kept_per_machine_in_the_plan_cache(tmp_path, monkeypatch, fresh_process):
    measured = []

    def measure(device, dtypes):
        measured.append(device)
        return {
            "matmul": {"float32": [[64, 5e10], [512, 2e11]]},
            "batched": {"float32": 4e10},
            "pointwise": 1e10,
            "stream": [[1 << 20, 5e10], [1 << 28, 7e9]],
            "read": 3e10,
            "mixed": 9e9,
            "select": 8e9,
            "cast": 7e9,
            "transcendental": 1e9,
            "tanh": 4e8,
            "replay": 1e9,
            "softmax mask": 5e8,
            "launch": 3e-6,
            "random": 1.7e8,
            "seconds": 0.8,
        }

    monkeypatch.setattr(calibration, "measure", measure)
    first = calibration.calibrated(CPU, {torch.float32}, PlanCache(tmp_path).figures)
    calibration._figures.cache_clear()  # a new process
    again = PlanCache(tmp_path)
    second = calibration.calibrated(CPU, {torch.float32}, again.figures)
    assert len(measured) == 1 and again.counts["calibration hit"] == 1
    assert first == second
    assert first.matmul_peak(torch.float32) == 2e11 and first.bandwidth == 3e10
    assert first.matmul_rate(torch.float32, 64) == 5e10  # a thin matmul at its own rate
    assert 5e10 < first.matmul_rate(torch.float32, 128) < 2e11
    # a batched matmul (attention's) at the single one's rate as scaled at its side
    assert first.matmul_rate(torch.float32, 64, batched=True) == pytest.approx(4e10)
    assert first.matmul_rate(torch.float32, 512, batched=True) == pytest.approx(1.6e11)
    assert first.stream_rate(1 << 30) == 7e9 and first.name.endswith("calibrated")


def test_the_figures_are_measured_free_of_the_callers_dispatch_modes(monkeypatch, fresh_process):
    """The first compile calibrates from inside dynamo, under the Python dispatcher: the
    figures are measured with it off, on the caller's thread (whose allocator arena the
    step uses)."""
    seen = {}

    def measure(device, dtypes):
        included = torch._C._dispatch_tls_local_include_set()
        seen["python dispatcher"] = included.has(torch._C.DispatchKey.PythonDispatcher)
        seen["threads"] = torch.get_num_threads()
        seen["thread"] = threading.get_ident()
        raise RuntimeError("measured")

    monkeypatch.setattr(calibration, "measure", measure)
    threads = torch.get_num_threads()
    with enable_python_dispatcher(), pytest.raises(RuntimeError, match="measured"):
        calibration.calibrated(CPU, {torch.float32})
    assert seen == {"python dispatcher": False, "threads": threads, "thread": threading.get_ident()}


def runs(monkeypatch, faults: list[int]) -> list[float]:
    """Fake runs in turn: a run that faults pages in takes 10 ms, one that does not 1 ms."""
    pending, counter, taken = list(faults), [0], []

    def timed_runs(run, device, repeat, warmup):
        seconds = []
        for _ in range(repeat):
            paged = pending.pop(0)
            counter[0] += paged
            seconds.append(0.010 if paged else 0.001)
        taken.extend(seconds)
        return seconds

    monkeypatch.setattr(calibration, "timed_runs", timed_runs)
    monkeypatch.setattr(calibration, "_minor_faults", lambda: counter[0])
    return taken


def test_runs_that_fault_pages_in_are_left_out(monkeypatch):
    """Whether an output lands on fresh pages is the allocator's history, not the kernel:
    the figure is the median of runs that faulted nothing, more runs taken where some did."""
    taken = runs(monkeypatch, [2048, 2048, 0, 2048, 0, 0, 0, 0] + [0] * 8)
    assert calibration._typical_seconds(lambda: None, CPU) == 0.001
    assert len(taken) == 8  # five clean runs, and the three that faulted among them


def test_a_kernel_that_faults_every_run_is_timed_with_its_faults(monkeypatch):
    taken = runs(monkeypatch, [2048] * 20)
    assert calibration._typical_seconds(lambda: None, CPU) == 0.010
    assert len(taken) == calibration.RUNS + calibration.RETRIES
    taken = runs(monkeypatch, [2048] * 6)
    assert calibration._typical_seconds(lambda: None, CPU, fresh_output=True) == 0.010
    assert len(taken) == calibration.RUNS  # an output mapped afresh: no runs more


def test_a_slow_round_is_outvoted(monkeypatch):
    """A slow spell of a shared machine moves every figure timed in it: each figure is
    the median of its rounds, so one slow round of three leaves it as the others had it."""
    rounds = iter(
        [
            {"matmul": {"float32": [[64, 95e9]]}, "stream": [[2**18, 30e9]], "random": None},
            {"matmul": {"float32": [[64, 70e9]]}, "stream": [[2**18, 18e9]], "random": None},
            {"matmul": {"float32": [[64, 93e9]]}, "stream": [[2**18, 33e9]], "random": None},
        ]
    )
    monkeypatch.setattr(calibration, "ROUNDS", 3)
    monkeypatch.setattr(calibration, "_round", lambda pool, dtypes: next(rounds))
    figures = calibration.measure(CPU, [torch.float32])
    assert figures["matmul"] == {"float32": [[64, 93e9]]}
    assert figures["stream"] == [[2**18, 30e9]] and figures["random"] is None
    assert figures["seconds"] >= 0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return F.mse_loss(self.b(torch.tanh(self.a(x))), x)


@pytest.mark.parametrize("calibrate", ["1", "0"])
def test_an_estimate_from_the_datasheet_says_so(calibrate, monkeypatch):
    monkeypatch.setenv("REMAT_CALIBRATE", calibrate)
    report = remat.plan(Tiny(), (torch.randn(8, 16),), budget=1.0)
    figures = "calibrated" if calibrate == "1" else "datasheet"
    assert report.graphs[0].figures == figures
    assert report.to_dict()["graphs"][0]["step_seconds_figures"] == figures
    assert ("(datasheet)" in str(report)) == (calibrate == "0")
