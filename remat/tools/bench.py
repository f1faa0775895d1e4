"""Side-by-side benchmark: remat against torch's partitioner, checkpointing by hand, and eager.

``run_bench`` builds a fresh model (the factory's own seed, so the same weights) for every
configuration and measures one training step (forward + backward) of each, in one process
(``remat.tools.methods`` makes each method's model):

- ``eager``: plain PyTorch, which stores everything the backward needs;
- ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)``
  around each of ``model.blocks`` (the sqrt(n) rule by hand), when the model has blocks;
- ``torch``: ``torch.compile`` through AOTAutograd with torch's own
  ``min_cut_rematerialization_partition``, with ``torch._functorch.config.
  activation_memory_budget`` set to each budget while it compiles (with
  ``compiler="eager"`` the partitioned programs run as plain fx, like remat's; with
  ``"inductor"`` it is the stock inductor pipeline);
- ``remat``: ``remat.optimize(model, budget, solver=..., compiler=..., cost_model=...)`` for
  each budget, solver and cost model. A budget below remat's minimum is a row carrying the
  ``InfeasibleBudget`` message.

The two budgets do not mean the same thing: torch's is a fraction of the bytes its
partitioner would save, remat's a fraction of the store-all plan's peak. Compare the
(peak, time) curves, not rows with equal budgets.

Per configuration: one warm-up step (it compiles; its wall time minus the median step time
is ``compile_s``), then the peak of one step (``remat.memory.peak``: profiler on CPU, the
allocator's counters on CUDA), gradients set to ``None`` first so allocating them counts.
The warm-up step runs from a fixed seed and its gradients are compared with eager's from the
same seed (``grad_error``, the largest difference relative to eager's largest gradient):
a partition that recomputes dropout with a fresh mask trains on wrong gradients, and such a
point does not count as a point of the curve (``dominates``). Inductor draws random numbers
its own way, and below float32 (``--size dtype=bfloat16``) the compiled graph rounds its
decomposed ops otherwise than eager, so with ``compiler="inductor"`` on a random step
(eager's gradients depend on the seed) torch's rows, and on any step in low precision
torch's and remat's, are compared with plain ``torch.compile``'s instead
(``grad_reference``; ``remat.tools.grads``).
Then ``repeat`` timed rounds, each running one step of every configuration in turn (the
first round in table order, later ones shuffled with a fixed seed), so that drift of the
machine hits all alike and no configuration always follows the same one; a row's
``step_s`` is its median, ``spread`` half the interquartile range of its times over
that median (the table's ``+-``): on a shared machine, differences below it are noise.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat import memory
from remat.cache import open_cache
from remat.costs import COMPILERS, COST_MODELS, calibration
from remat.errors import InfeasibleBudget, user_error
from remat.passes._torch_compat import compile_caches_off, dynamo_config
from remat.solvers import format_bytes
from remat.solvers.solve import with_time_limit
from remat.tools import examples
from remat.tools.grads import (
    GRAD_SEED,
    grad_error,
    gradients,
    reference_for,
    reference_gradients,
)
from remat.tools.methods import Skip, model_for
from remat.tools.models import floating_dtype
from remat.tools.rows import Row

__all__ = ["METHODS", "pareto_budgets", "run_bench"]

METHODS = ("eager", "checkpoint", "torch", "remat")

Progress = Callable[[str], None]


@dataclass
class _Config:
    """One configuration: its row, and what its steps call and on what."""

    row: Row
    model: nn.Module | None = None  # what is called
    params: nn.Module | None = None  # whose gradients are reset between steps
    inputs: tuple = ()
    report: Any = None  # remat's backend, for its plans
    solver: Any = None  # remat: what ``remat.optimize`` gets (``row.solver`` names it)

    @property
    def ok(self) -> bool:
        return self.row.error is None and self.model is not None


# ----------------------------------------------------------------------------- running


def run_bench(
    model_spec: str,
    budgets: Sequence[float | int],
    *,
    device: str | torch.device | None = "cpu",
    compiler: str = "eager",
    solvers: Sequence[str] = ("auto",),
    repeat: int = 5,
    size_kwargs: dict[str, Any] | None = None,
    methods: Iterable[str] = METHODS,
    threads: int | None = 1,
    cost_model: str | Sequence[str] = "roofline",
    time_limit: float | None = None,
    at_torch_peaks: bool = False,
    progress: Progress | None = None,
) -> list[Row]:
    """Measure every configuration of ``methods`` on ``model_spec`` (see the module doc).

    ``budgets`` are fractions in [0, 1] (torch takes only fractions; remat also takes
    absolute bytes as ints, and rejects 0 with an error row). ``threads`` sets
    ``torch.set_num_threads`` on CPU for the run (``None``: leave it). Rows come in the order
    eager, checkpoint, torch by budget, remat by cost model, solver, then budget (one
    ``cost_model`` name or several: each plans its own remat rows). ``time_limit``: CP-SAT's
    limit (deterministic seconds) for the rows of solvers that run it (``CPSAT_SOLVERS``),
    else its default.
    ``at_torch_peaks``: also a remat row (first solver and cost model) at each measured peak
    of a torch row with eager's gradients, as an absolute budget: the two curves at equal
    memory, where fraction budgets mean different things.
    ``device`` is passed to the factory as ``device=...``; ``None`` passes nothing and
    measures where the factory's model lives.
    """
    methods, cost_models = tuple(methods), _cost_model_names(cost_model)
    _check_arguments(methods, budgets, repeat, compiler, cost_model, time_limit)
    say = progress or (lambda _message: None)
    kwargs, dev = _factory_kwargs(model_spec, size_kwargs, device)
    configs = _configs(methods, budgets, solvers, compiler, cost_models, time_limit)
    # Every configuration compiles the same forward code object; keep them all cached.
    limits = {"recompile_limit": 4 * len(configs) + 8, "accumulated_recompile_limit": 4096}
    with _measuring(dev, threads):
        _calibrate_first(dev, kwargs)
        references = reference_gradients(model_spec, kwargs, compiler, methods, say)
        with dynamo_config.patch(**limits):
            _prepare_all(configs, model_spec, kwargs, dev, references, say)
            if at_torch_peaks:
                peaks = _torch_peaks(configs)
                more = _configs(
                    ("remat",), peaks, solvers[:1], compiler, cost_models[:1], time_limit
                )
                _prepare_all(more, model_spec, kwargs, dev, references, say, "at torch's peaks ")
                configs += more
            _time_rounds([c for c in configs if c.ok], repeat, dev, say)
    _summarise([c.row for c in configs])
    return [c.row for c in configs]


def _cost_model_names(cost_model: str | Sequence[str]) -> tuple[str, ...]:
    """One cost model's name or several, as a tuple."""
    return (cost_model,) if isinstance(cost_model, str) else tuple(cost_model)


def _check_arguments(methods, budgets, repeat, compiler, cost_model, time_limit) -> None:
    """``ValueError`` for an argument no configuration could run with, before minutes of
    measuring."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    cost_models = _cost_model_names(cost_model)
    bad = [c for c in cost_models if c not in COST_MODELS]
    if bad or not cost_models:
        raise ValueError(f"cost models must be some of {list(COST_MODELS)}, got {cost_model!r}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0:
            raise ValueError(f"budgets must be numbers >= 0 (fractions or bytes), got {b!r}")


def _factory_kwargs(spec, size_kwargs, device) -> tuple[dict[str, Any], torch.device]:
    """The factory's keyword arguments (``device`` among them unless it is ``None``) and
    the device the steps run on: ``device``, or where the factory's model lives (a
    factory need not take ``device``)."""
    kwargs = dict(size_kwargs or {})
    if device is not None:
        dev = kwargs["device"] = torch.device(device)
    else:
        dev = _device_of(examples.load(spec, **kwargs)[0])
    return kwargs, dev


@contextlib.contextmanager
def _measuring(dev: torch.device, threads: int | None) -> Iterator[None]:
    """``threads`` CPU threads while measuring (stable timings), the old count after; and
    dynamo's caches emptied before and after, so no step compiled elsewhere is reused."""
    old_threads = torch.get_num_threads()
    if threads is not None and dev.type == "cpu":
        torch.set_num_threads(threads)
    torch.compiler.reset()
    try:
        yield
    finally:
        torch.compiler.reset()
        if threads is not None and dev.type == "cpu":
            torch.set_num_threads(old_threads)


def _calibrate_first(dev: torch.device, kwargs: dict[str, Any]) -> None:
    """The machine's figures (``costs.calibration``), measured before any configuration
    runs, as a training process measures them at its first compile, not in the allocator's
    state other configurations' steps left (docs/cost-model.md, "Calibration")."""
    if not calibration.enabled():
        return
    cache = open_cache()
    dtype = floating_dtype(kwargs.get("dtype", torch.float32))
    calibration.calibrated(dev, {dtype}, None if cache is None else cache.figures)


def _prepare_all(configs, spec, kwargs, dev, references, say: Progress, where: str = "") -> None:
    """``_prepare`` each configuration in turn, its progress lines tagged ``[where k/n]``."""
    for k, cfg in enumerate(configs, 1):
        _prepare(cfg, spec, kwargs, dev, references, say, f"[{where}{k}/{len(configs)}]")


def _time_rounds(live: list[_Config], repeat: int, dev: torch.device, say: Progress) -> None:
    """``repeat`` rounds of one timed step of every configuration (``_round_order``), so
    that drift of the machine hits all alike; each step's seconds go to its row's
    ``times``. Each timed step follows an untimed one of the same configuration, as a
    training step follows a step of the same model, not another model's caches and free
    blocks (docs/cost-model.md, "The estimate against the clock")."""
    for r in range(repeat):
        say(f"timing round {r + 1}/{repeat} ({len(live)} configurations)...")
        for cfg in _round_order(live, r):
            _timed_step(cfg, dev)
            cfg.row.times.append(_timed_step(cfg, dev))


def _summarise(rows: list[Row]) -> None:
    """Each timed row's median step time and spread, its first step's time less one
    step's (the compiling), and its overhead against eager's median."""
    for row in rows:
        if not row.times:
            continue
        row.step_s = statistics.median(row.times)
        row.spread = _spread(row.times)
        if row.compile_s is not None:
            row.compile_s = max(row.compile_s - row.step_s, 0.0)
    eager_time = next((r.step_s for r in rows if r.method == "eager"), None)
    for row in rows:
        if row.step_s is not None and eager_time:
            row.overhead = row.step_s / eager_time - 1


def _torch_peaks(configs: list[_Config]) -> list[int]:
    """The measured peaks of the torch rows that count as points (eager's gradients)."""
    rows = [c.row for c in configs if c.ok and c.row.method == "torch" and c.row.grads_ok]
    return sorted({r.peak_bytes for r in rows if r.peak_bytes}, reverse=True)


def _spread(times: list[float]) -> float | None:
    """Half the interquartile range of a row's step times over their median: the
    noise a difference between two rows' ``step_s`` has to beat to mean anything."""
    if len(times) < 2:
        return None
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / 2 / statistics.median(times)


def _round_order(configs: list[_Config], round_index: int) -> list[_Config]:
    """Round 0 in table order, later rounds shuffled (seeded by the round: the same on
    every run), so no configuration always runs right after the same one: what a step
    leaves behind (pages the allocator gave back, evicted caches) would otherwise bias
    the step after it in every round."""
    order = list(configs)
    if round_index:
        random.Random(round_index).shuffle(order)
    return order


def _configs(
    methods, budgets, solvers, compiler, cost_models=("roofline",), time_limit=None
) -> list[_Config]:
    out = []
    if "eager" in methods:
        out.append(_Config(Row("eager")))
    if "checkpoint" in methods:
        out.append(_Config(Row("checkpoint")))
    if "torch" in methods:
        for b in budgets:
            out.append(_Config(Row("torch", budget=b, compiler=compiler)))
    if "remat" in methods:
        for c in cost_models:
            for s in solvers:
                for b in budgets:
                    row = Row("remat", budget=b, solver=s, cost_model=c, compiler=compiler)
                    out.append(_Config(row, solver=with_time_limit(s, time_limit)))
    return out


def _prepare(cfg: _Config, spec, kwargs, dev, references, say: Progress, tag: str) -> None:
    """Build, compile (warm-up step, its gradients compared with a reference's: eager's, or
    plain ``torch.compile``'s for compiled rows when there is one) and measure the peak of
    one configuration. One that fails is a row saying why, and is not timed."""
    row = cfg.row
    say(f"{tag} {row.label}: building and compiling...")
    try:
        _build(cfg, spec, kwargs)
        _first_step(cfg, dev, references)
        _peak_step(cfg, dev)
        if cfg.report is not None:
            _remat_columns(row, cfg.report.report())
    except Exception as e:  # a failed configuration is a row, not the end of the benchmark
        row.error = _failure(e, say)
    if row.error is not None:
        cfg.model = None
        say(f"{tag} {row.label}: not run: {row.error}")
        return
    extra = ""
    if row.predicted_peak is not None:
        extra = f", predicted {format_bytes(row.predicted_peak)}"
    say(
        f"{tag} {row.label}: peak {format_bytes(row.peak_bytes)}{extra}, "
        f"first step {row.compile_s:.2f}s"
    )


def _build(cfg: _Config, spec, kwargs) -> None:
    """A fresh model from the factory (its own seed: every configuration starts from the
    same weights), made into what the configuration's method calls."""
    model, inputs = examples.load(spec, **kwargs)
    cfg.params, cfg.inputs = model, inputs
    cfg.model = model_for(cfg.row, model, cfg.solver)
    if cfg.row.method == "remat":
        cfg.report = cfg.model.remat


def _first_step(cfg: _Config, dev: torch.device, references) -> None:
    """The warm-up step, which compiles: its wall time (``compile_s``; ``_summarise``
    takes a step off) and its gradients against the reference's from the same seed
    (``grad_error``)."""
    row = cfg.row
    start = time.perf_counter()
    torch.manual_seed(GRAD_SEED)
    with compile_caches_off(row.budget if row.method == "torch" else None):
        _step(cfg)
    _sync(dev)
    row.compile_s = time.perf_counter() - start
    row.grad_reference = reference_for(row.method, references)
    row.grad_error = grad_error(gradients(cfg.params), references[row.grad_reference])
    _zero_grad(cfg)


def _peak_step(cfg: _Config, dev: torch.device) -> None:
    """The peak of one step (``remat.memory.peak``), its gradients unset before and after,
    so allocating them counts."""
    cfg.row.peak_bytes = memory.peak(_step, cfg, device=dev).peak_bytes
    _zero_grad(cfg)


def _failure(e: Exception, say: Progress) -> str:
    """A failed configuration's error column: why it was skipped, remat's minimum for an
    infeasible budget, a user error's message, or a bug's type and message (its last
    frames go to ``say``)."""
    if isinstance(e, Skip):
        return str(e)
    user = e if isinstance(e, InfeasibleBudget) else user_error(e)
    if isinstance(user, InfeasibleBudget):
        return _infeasible(user)
    if user is not None:
        return " ".join(str(user).split())
    say("".join(traceback.format_exception(e, limit=-3)).rstrip())
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _infeasible(e: InfeasibleBudget) -> str:
    return (
        f"infeasible: budget {format_bytes(e.limit)} < remat's minimum "
        f"{format_bytes(e.minimum)} ({e.minimum / max(e.store_all, 1):.1%} of store-all)"
    )


def _step(cfg: _Config) -> None:
    loss = cfg.model(*cfg.inputs)
    loss.backward()


def _zero_grad(cfg: _Config) -> None:
    cfg.params.zero_grad(set_to_none=True)


def _device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_step(cfg: _Config, dev: torch.device) -> float:
    _zero_grad(cfg)
    _sync(dev)
    start = time.perf_counter()
    _step(cfg)
    _sync(dev)
    seconds = time.perf_counter() - start
    _zero_grad(cfg)  # free the gradients: other configurations run next
    return seconds


def _remat_columns(row: Row, report) -> None:
    graphs = report.graphs
    row.graphs = len(graphs)
    row.predicted_peak = report.predicted_peak
    row.predicted_s = sum(g.step_seconds for g in graphs)
    # the step's joint plans where a step ended, else the graphs' compile-time ones
    plans = [s.plan for s in report.steps] or [g.plan for g in graphs]
    row.budget_bytes = max([s.limit for s in report.steps] or [g.limit for g in graphs])
    solves = sum(s.plan.solve_seconds for s in report.steps)
    row.plan_s = sum(g.plan_seconds for g in graphs) + solves
    gaps = [p.gap for p in plans]
    row.gap = None if any(x is None for x in gaps) else max(gaps, default=None)
    row.status = ",".join(sorted({p.status for p in plans}))


# ----------------------------------------------------------------------------- pareto


def pareto_budgets(
    model_spec: str,
    points: int,
    *,
    size_kwargs: dict[str, Any] | None = None,
    device: str | torch.device | None = "cpu",
    cost_model: str = "roofline",
) -> tuple[list[int | float], dict[str, int]]:
    """``points`` budgets from remat's store-all peak down to its smallest reachable peak.

    One planned step (``remat.plan`` at budget 1.0): bytes, evenly spaced from the step's
    store-all peak to ``min_peak_plan`` of the step planned as one (graph breaks included).
    Also returns ``{"store_all": ..., "minimum": ...}`` (bytes).
    """
    import remat
    from remat.solvers import min_peak_plan, store_all

    if points < 2:
        raise ValueError(f"need at least 2 points, got {points}")
    kwargs = dict(size_kwargs or {})
    if device is not None:
        kwargs["device"] = torch.device(device)
    model, inputs = examples.load(model_spec, **kwargs)
    try:
        # storing everything: the problem is all this needs, and CP-SAT would add seconds
        report = remat.plan(model, inputs, budget=1.0, solver="store-all", cost_model=cost_model)
    finally:
        torch.compiler.reset()
    steps = report.steps
    problem = steps[0].composed.problem if steps else report.graphs[0].extracted.problem
    hi, lo = store_all(problem).peak, min_peak_plan(problem).peak
    values = sorted({round(hi - (hi - lo) * k / (points - 1)) for k in range(points)})
    return values[::-1], {"store_all": hi, "minimum": lo}
