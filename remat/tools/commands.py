"""The ``remat`` commands, one function each: load the model, run, print; a mistake the
user can fix is a ``UsageError`` (or a ``remat.errors`` type) that ``cli.main`` prints as
one line."""

from __future__ import annotations

import copy
import functools
import logging
import sys
from typing import Any

from remat.solvers import format_bytes
from remat.solvers.solve import CPSAT_SOLVERS, with_time_limit
from remat.tools import bench, examples
from remat.tools.files import write_dot, write_report_json, write_timeline
from remat.tools.helptext import listed
from remat.tools.output import (
    format_seconds,
    inspect_table,
    plan_table,
    time_ratio_line,
    train_table,
    values_table,
)
from remat.tools.plotting import pyplot
from remat.tools.rows import (
    dominates,
    fastest_within,
    frontier,
    plot_rows,
    rounds_faster,
    rows_table,
    write_csv,
    write_json,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake on the command line: reported as one line, exit status 2."""


class Progress:
    """Progress lines on stderr, including the planner's one line per planned graph."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def planner_log(self):
        return _PlannerLog(self)


class _PlannerLog(logging.Handler):
    """While active, the ``remat`` logger's INFO lines (one per planned graph) and warnings
    are progress; ``--quiet`` silences both (errors still end the command, in one line)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.INFO)
        self.progress = progress
        self.logger = logging.getLogger("remat")
        self.old_level = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.progress(f"  {record.getMessage()}")

    def __enter__(self):
        if self.progress.quiet:
            self.logger.setLevel(logging.ERROR)
        else:
            self.logger.addHandler(self)
            if not self.logger.isEnabledFor(logging.INFO):
                self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)


def one_line(text: str) -> str:
    return " ".join(text.split())


def _load(args, progress: Progress):
    """(model, inputs) for MODEL and --size; UsageError for an unknown model or bad size."""
    import torch

    kwargs = dict(args.size)
    if args.device is not None:
        kwargs["device"] = args.device
    torch.manual_seed(args.seed)
    described = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    progress(f"loading {args.model}" + (f" ({described})" if described else "") + "...")
    try:
        model, inputs = examples.load(args.model, **kwargs)
    except ValueError as e:
        raise UsageError(one_line(str(e))) from None
    except TypeError as e:  # an unknown --size key, or a factory returning the wrong thing
        raise UsageError(f"{args.model}: {one_line(str(e))}") from None
    return model, inputs


def _solver(args):
    """The --solver name, or CP-SAT carrying --time-limit."""
    _check_time_limit(args, [args.solver])
    return with_time_limit(args.solver, args.time_limit)


def _check_time_limit(args, solvers: list[str]) -> None:
    """--time-limit is CP-SAT's: refused unless some solver named runs it."""
    if args.time_limit is not None and not set(CPSAT_SOLVERS) & set(solvers):
        raise UsageError(
            f"--time-limit applies to the solvers {listed(CPSAT_SOLVERS)}, not {', '.join(solvers)}"
        )


def _plan(args, model, inputs, budget, solver, progress: Progress):
    import remat

    progress(f"tracing {args.model} (dynamo + AOTAutograd) and planning (budget {budget})...")
    return remat.plan(model, inputs, budget=budget, solver=solver, cost_model=args.cost_model)


def cmd_inspect(args, progress: Progress) -> int:
    model, inputs = _load(args, progress)
    report = _plan(args, model, inputs, "1.0", "auto", progress)
    graphs = list(enumerate(report.graphs))
    if args.graph is not None:
        if args.graph >= len(graphs):
            raise UsageError(
                f"--graph {args.graph}: {args.model} compiled to {len(graphs)} graph(s), "
                f"numbered 0..{len(graphs) - 1}"
            )
        graphs = [graphs[args.graph]]
    for k, (index, g) in enumerate(graphs):
        if k:
            print()
        print(inspect_table(g, index, len(report.graphs), sort=args.sort, limit=args.limit))
    write_dot(args, [g for _, g in graphs], with_plan=False, progress=progress)
    return EXIT_OK


def cmd_plan(args, progress: Progress) -> int:
    _check_plot(args.timeline, "--timeline")
    model, inputs = _load(args, progress)
    report = _plan(args, model, inputs, args.budget, _solver(args), progress)
    if args.json != "-":  # else stdout is the JSON's
        print(plan_table(report, args.budget))
        if args.values:
            print()
            print(values_table(report))
    if args.json:
        write_report_json(args, report, progress)
    write_timeline(args, report, None, progress)
    write_dot(args, report.graphs, with_plan=True, progress=progress)
    return EXIT_OK


def _check_plot(path: str | None, option: str) -> None:
    """A plot asked for without matplotlib is refused before minutes of tracing."""
    if path:
        try:
            pyplot(option)
        except ImportError as e:
            raise UsageError(str(e)) from None


def cmd_train(args, progress: Progress) -> int:
    """``remat train``: SGD steps of remat and of eager side by side, one measured step of
    each, the plan and the comparison; status 1 where the losses differ although no random
    op explains it."""
    import torch

    _check_plot(args.timeline, "--timeline")
    model, inputs = _load(args, progress)
    eager = copy.deepcopy(model)
    optimized = _optimize(args, model)
    runs = {
        "eager": (eager, torch.optim.SGD(eager.parameters(), lr=args.lr)),
        "remat": (optimized, torch.optim.SGD(model.parameters(), lr=args.lr)),
    }
    losses = _train(args, runs, inputs, progress)
    report = optimized.remat.report()
    peaks, times, measured = _measure(args, runs, inputs, _device_of(model), progress)
    print(
        f"plan ({args.model}, budget {args.budget}, solver {args.solver}, compiler {args.compiler})"
    )
    print(plan_table(report, args.budget))
    print()
    print(train_table(args, report, peaks, times, losses))
    print()
    verdict, ok = _loss_verdict(losses, _draws_unreplayed_random(report))
    print(_peak_line(report, peaks))
    print(time_ratio_line(times))
    print(verdict)
    write_timeline(args, report, measured, progress)
    return EXIT_OK if ok else EXIT_FAILED


def _optimize(args, model):
    """``remat.optimize`` with the command's options; a ``ValueError`` is a usage error."""
    import remat

    try:
        return remat.optimize(
            model,
            args.budget,
            solver=_solver(args),
            compiler=args.compiler,
            cost_model=args.cost_model,
        )
    except ValueError as e:
        raise UsageError(one_line(str(e))) from None


def _forward_backward(model, inputs):
    loss = model(*inputs)
    loss.backward()
    return loss.detach()


def _sgd_step(model, opt, inputs):
    opt.zero_grad(set_to_none=True)
    loss = _forward_backward(model, inputs)
    opt.step()
    return loss


def _train(args, runs: dict, inputs, progress: Progress) -> dict[str, list[float]]:
    """``--steps`` SGD steps of every run in turn, each step from the same seed (the same
    dropout masks for both); each run's losses."""
    import torch

    losses: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.steps):
        for name, (m, opt) in runs.items():
            if name == "remat" and i == 0:
                progress(
                    f"compiling {args.model} with remat (trace, plan under budget "
                    f"{args.budget}, rewrite)..."
                )
            torch.manual_seed(args.seed + i)  # same dropout masks for both, step by step
            losses[name].append(_sgd_step(m, opt, inputs).item())
        progress(
            f"step {i + 1}/{args.steps}: loss eager {losses['eager'][-1]:.6f}, "
            f"remat {losses['remat'][-1]:.6f}"
        )
    return losses


def _measure(args, runs: dict, inputs, device, progress: Progress) -> tuple[dict, dict, Any]:
    """Each run's peak memory of one forward+backward and the times of ``--repeat`` steps,
    round by round in turn (a slow spell of a shared machine hits both); with
    ``--timeline`` on the CPU, remat's memory over that forward+backward too (its peak is
    the same measurement's)."""
    import torch

    from remat import memory

    over_time = bool(args.timeline) and torch.device(device).type == "cpu"
    if args.timeline and not over_time:
        progress("--timeline: memory over time is measured on the CPU only; plotting the plan")
    peaks, measured = {}, None
    for name, (m, opt) in runs.items():
        progress(f"measuring {name}: peak memory of one forward+backward...")
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(args.seed)
        if name == "remat" and over_time:
            measured = memory.trace(_forward_backward, m, inputs)
            peaks[name] = measured.peak_bytes
        else:
            peaks[name] = memory.peak(_forward_backward, m, inputs, device=device).peak_bytes
        opt.zero_grad(set_to_none=True)
    progress(f"timing {args.repeat} steps of each, in turn...")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.repeat):
        for name, (m, opt) in runs.items():
            step = functools.partial(_sgd_step, m, opt, inputs)
            times[name] += memory.step_times(step, warmup=int(i == 0), repeat=1, device=device)
    return peaks, times, measured


def _draws_unreplayed_random(report) -> bool:
    """Whether a graph has a random op remat does not replay: replayed dropout draws
    eager's masks; only other random ops may draw differently."""
    from remat import costs
    from remat.passes.rng import is_replay_state

    return any(
        costs.is_random(n) and not is_replay_state(n)
        for g in report.graphs
        for n in g.extracted.fx_nodes
    )


def _peak_line(report, peaks: dict) -> str:
    """remat's measured peak against eager's, and whether it kept the budget (where the
    graphs share one)."""
    ratio = peaks["remat"] / max(peaks["eager"], 1)
    budgets = sorted({g.limit for g in report.graphs})
    within = all(peaks["remat"] <= b for b in budgets) if len(budgets) == 1 else None
    return (
        f"measured peak: remat {format_bytes(peaks['remat'])} = {ratio:.1%} of eager's "
        f"{format_bytes(peaks['eager'])}"
        + ("" if within is None else f"; within the budget: {'yes' if within else 'NO'}")
    )


def _loss_verdict(losses: dict[str, list[float]], random: bool) -> tuple[str, bool]:
    diffs = [abs(a - b) for a, b in zip(losses["eager"], losses["remat"], strict=True)]
    worst = max(diffs, default=0.0)
    scale = max((abs(a) for a in losses["eager"]), default=1.0)
    if worst == 0:
        return "losses: remat's equal eager's exactly, step by step.", True
    if worst <= 1e-5 * max(scale, 1.0):
        return (
            f"losses: remat's match eager's (max difference {worst:.2g}, float32 "
            "rounding from a different op order).",
            True,
        )
    if random:
        return (
            f"losses: differ by up to {worst:.2g}; the model has random ops that the "
            "compiled program draws differently (inductor's own RNG, or ops other than "
            "dropout), so only a model without them is expected to match.",
            True,
        )
    return (
        f"losses: remat's DIFFER from eager's by up to {worst:.2g} although the model has "
        "no random op: this is a remat bug, please report it.",
        False,
    )


def _device_of(model) -> Any:
    import torch

    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _bench_setup(args, progress: Progress) -> tuple[str | None, str, dict]:
    """Check what can be checked before minutes of measuring: device, model, plot, files."""
    import torch

    device = args.device
    if device is not None:
        try:
            dev = torch.device(device)
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda (or cuda:N), got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available to this torch")
    _check_plot(args.plot, "--plot")
    try:
        model, _inputs = _load(args, progress)  # fails fast on an unknown model or --size key
    except ImportError as e:
        raise UsageError(f"{args.model}: {one_line(str(e))}") from None
    if device is None:  # the factory's default: pass nothing, measure where it lives
        return None, str(_device_of(model)), dict(args.size)
    return device, str(torch.device(device)), dict(args.size)


def _bench_output(args, rows, meta: dict) -> None:

    print(rows_table(rows))
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        write_json(rows, args.json, meta)
    if args.plot:
        plot_rows(rows, args.plot, title=f"{args.model}: peak memory vs step time")


def _bench_meta(args, device: str, **extra) -> dict:
    import datetime
    import platform

    import torch

    return {
        "model": args.model,
        "size": dict(args.size),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else
        platform.processor() or platform.machine(),
        "compiler": args.compiler,
        "repeat": args.repeat,
        "threads": args.threads,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "remat " + " ".join(sys.argv[1:]),
        **extra,
    }  # fmt: skip


def cmd_bench(args, progress: Progress) -> int:
    _check_time_limit(args, args.solvers)
    device, measured_on, size = _bench_setup(args, progress)
    rows = bench.run_bench(
        args.model,
        args.budgets,
        device=device,
        compiler=args.compiler,
        solvers=args.solvers,
        repeat=args.repeat,
        size_kwargs=size,
        threads=args.threads or None,
        cost_model=args.cost_model,
        time_limit=args.time_limit,
        at_torch_peaks=args.at_torch_peaks,
        progress=progress,
    )
    _bench_output(args, rows, _bench_meta(args, measured_on, budgets=args.budgets))
    wrong = [r.label for r in rows if not r.grads_ok]
    if wrong:
        print()
        print(
            "gradients differ from the reference's (the grads column's, same seed), not "
            f"counted as points: {', '.join(wrong)}"
        )
    verdicts = dominates(rows)
    if verdicts:
        missing = [_nearest_text(rows, t) for t, r in verdicts if r is None]
        print()
        if missing:
            print(
                f"remat dominates {len(verdicts) - len(missing)}/{len(verdicts)} torch points "
                f"(a remat point with peak <= and time <= 1.02x); not: {'; '.join(missing)}"
            )
        else:
            print(
                f"remat dominates all {len(verdicts)} torch points (a remat point with "
                "peak <= and time <= 1.02x each)"
            )
    return EXIT_OK


def _nearest_text(rows, torch_row) -> str:
    """A missed torch point, with how far remat's fastest point at no more memory is,
    in how many rounds it was faster, and the two rows' timing spread: a miss within the
    spread, faster in about half the rounds, is a tie."""

    best = fastest_within(rows, torch_row.peak_bytes)
    if best is None:
        return f"{torch_row.label} (no remat point at or below its peak)"
    noise = max(r.spread or 0.0 for r in (best, torch_row))
    ratio = best.step_s / torch_row.step_s
    faster, rounds = rounds_faster(best, torch_row)
    paired = f", faster in {faster}/{rounds} rounds" if rounds else ""
    return (
        f"{torch_row.label} (nearest: {best.label} at {ratio:.3f}x its time{paired}, +-{noise:.1%})"
    )


def cmd_pareto(args, progress: Progress) -> int:
    _check_time_limit(args, [args.solver])
    device, measured_on, size = _bench_setup(args, progress)
    progress(f"tracing {args.model} to find remat's store-all and minimum peaks...")
    budgets, info = bench.pareto_budgets(
        args.model, args.points, size_kwargs=size, device=device, cost_model=args.cost_model
    )
    progress(
        f"store-all {format_bytes(info['store_all'])}, minimum {format_bytes(info['minimum'])}: "
        f"measuring {len(budgets)} budgets"
    )
    rows = bench.run_bench(
        args.model,
        budgets,
        device=device,
        compiler=args.compiler,
        solvers=[args.solver],
        repeat=args.repeat,
        size_kwargs=size,
        methods=("eager", "remat"),
        threads=args.threads or None,
        cost_model=args.cost_model,
        time_limit=args.time_limit,
        progress=progress,
    )
    _bench_output(args, rows, _bench_meta(args, measured_on, points=args.points, **info))
    front = [r for r in frontier(rows) if r.method == "remat"]
    print()
    print(
        f"remat frontier ({len(front)} of {sum(r.method == 'remat' for r in rows)} points "
        "not beaten on both peak and time): "
        + ", ".join(f"{format_bytes(r.peak_bytes)} @ {format_seconds(r.step_s)}" for r in front)
    )
    return EXIT_OK
