"""The ``remat`` command line: look at a model's training graph, plan it, train it.

- ``remat inspect MODEL``: the joint forward+backward graph remat plans, one row per value.
- ``remat plan MODEL --budget B``: what remat would save and recompute under a budget.
- ``remat train MODEL``: a few SGD steps with ``remat.optimize`` and eagerly, side by side
  (measured peak memory, step time, losses).
- ``remat bench MODEL``: measured peak memory and step time of eager, checkpointing per block,
  torch's min-cut partitioner and remat, at a list of budgets (``remat.tools.bench``).
- ``remat pareto MODEL``: remat's measured memory/time frontier, store-all down to its minimum.

MODEL is a built-in example (``remat.tools.examples.EXAMPLES``) or ``package.module:factory``;
``--size key=value`` passes keyword arguments to the factory. Every mistake a user can make
(bad budget, unknown model or solver, infeasible budget) prints one line on stderr and exits
with status 2; progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tabulate import tabulate

from remat.errors import RematError, user_error
from remat.planner import COST_MODELS
from remat.solvers import SOLVERS, Budget, format_bytes
from remat.solvers.solve import CPSAT_SOLVERS, with_time_limit

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

SORT_KEYS = ("order", "bytes", "time")


class UsageError(Exception):
    """A mistake on the command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# ----------------------------------------------------------------------------- arguments


def _budget(text: str) -> Budget:
    try:
        return Budget.parse(text)
    except RematError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value (e.g. layers=4), got {text!r}")
    return key.strip(), _literal(value.strip())


def _literal(value: str) -> Any:
    """'4' -> 4, '0.1' -> 0.1, 'true' -> True, 'none' -> None, anything else stays a string."""
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


def _number(cast, accept, expected: str):
    """An argparse type: ``cast`` the text, keep it if ``accept``, else say what was expected."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative = _number(int, lambda v: v >= 0, "an integer >= 0")
_float = _number(float, lambda v: v > 0, "a positive number")


def _solver_names() -> list[str]:
    return ["auto", *sorted(name for name in SOLVERS if name != "auto")]


def build_parser() -> argparse.ArgumentParser:
    from remat import __version__
    from remat.tools.examples import EXAMPLES

    builtins = ", ".join(sorted(EXAMPLES))
    parser = _Parser(
        prog="remat",
        description="Fit a PyTorch training step in a memory budget by recomputing activations.",
        epilog="Run 'remat COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    model = _Parser(add_help=False)
    model.add_argument(
        "model",
        metavar="MODEL",
        help=f"a built-in example ({builtins}) or package.module:factory, a function "
        "returning (model, example_inputs) whose model(*example_inputs) is a scalar loss",
    )
    model.add_argument(
        "--size",
        metavar="KEY=VALUE",
        action="append",
        type=_size,
        default=[],
        help="keyword argument for the model factory, repeatable (e.g. --size layers=4); "
        "ints and floats are parsed, true/false/none too",
    )
    model.add_argument(
        "--device",
        default=None,
        help="passed to the factory as device=... (the built-in examples accept it); "
        "default: the factory's default (CPU for the built-ins)",
    )
    model.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default 0)")
    model.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    # Not part of ``model``: ``bench`` takes a list instead. (Overriding it there with
    # conflict_handler="resolve" stripped the option from the shared action, and every
    # command created after ``bench`` refused --cost-model.)
    cost_model = _Parser(add_help=False)
    cost_model.add_argument(
        "--cost-model",
        choices=COST_MODELS,
        default="roofline",
        help="per-op time: roofline estimate from flops and bytes (default) or measured by "
        "running each op on the device (slower to plan)",
    )
    solver = _Parser(add_help=False)
    solver.add_argument(
        "--solver",
        choices=_solver_names(),
        default="auto",
        help="planning algorithm (default auto: CP-SAT from the greedy plan)",
    )
    limit = _Parser(add_help=False)
    limit.add_argument(
        "--time-limit",
        type=_number(float, lambda v: v > 0, "a positive number of seconds"),
        default=None,
        help="CP-SAT's limit per graph, in its deterministic seconds (default 2: 1-17 wall "
        "seconds on graphs of 500-2,000 nodes on 2 cores; beyond 4,000 nodes, nodes / "
        "2,000); for the solvers auto and cpsat",
    )

    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect = sub.add_parser(
        "inspect",
        parents=[model, cost_model],
        help="table of the joint forward+backward graph: op, shape, bytes, time",
        description="Trace MODEL's training step and print one row per value of the joint "
        "graph remat plans (parameters and inputs are resident and not listed).",
    )
    inspect.add_argument(
        "--graph",
        type=_non_negative,
        default=None,
        metavar="N",
        help="show only graph N (one per graph break; default: all)",
    )
    inspect.add_argument(
        "--limit",
        type=_positive,
        default=None,
        metavar="K",
        help="show only the first K rows of each graph after sorting (default: all)",
    )
    inspect.add_argument(
        "--sort",
        choices=SORT_KEYS,
        default="order",
        help="row order: execution order (default), bytes or estimated time, largest first",
    )
    inspect.set_defaults(run=cmd_inspect)

    plan = sub.add_parser(
        "plan",
        parents=[model, cost_model, solver, limit],
        help="what remat saves and recomputes under a budget, and the predicted peak",
        description="Trace MODEL's training step, plan it under --budget and print the plan "
        "of every graph, without training.",
    )
    plan.add_argument(
        "--budget",
        type=_budget,
        required=True,
        metavar="B",
        help="peak bytes of one training step: '300MiB', '2GB', 1073741824 (bytes), or a "
        "fraction of the store-all peak: '40%%' or 0.4",
    )
    plan.set_defaults(run=cmd_plan)

    train = sub.add_parser(
        "train",
        parents=[model, cost_model, solver, limit],
        help="train a few steps with remat and eagerly; compare memory, time, losses",
        description="Train MODEL for --steps SGD steps with remat.optimize under --budget and "
        "eagerly (a copy of the same model), then measure one forward+backward of each and "
        "print the plan, the measured peaks, the step times and the losses.",
    )
    train.add_argument(
        "--budget",
        type=_budget,
        default="0.5",
        metavar="B",
        help="as for 'remat plan' (default 0.5: half the store-all peak)",
    )
    train.add_argument("--steps", type=_positive, default=3, help="SGD steps (default 3)")
    train.add_argument("--lr", type=_float, default=0.01, help="SGD learning rate (default 0.01)")
    train.add_argument(
        "--compiler",
        choices=("eager", "inductor"),
        default="eager",
        help="how remat's forward/backward programs run: plain fx (default, the plan's exact "
        "schedule) or inductor (fused kernels; experimental)",
    )
    train.add_argument(
        "--repeat",
        type=_positive,
        default=5,
        help="timed steps per model for the median step time (default 5)",
    )
    train.set_defaults(run=cmd_train)

    output = _Parser(add_help=False)
    output.add_argument(
        "--compiler",
        choices=("eager", "inductor"),
        default="eager",
        help="compiler of the compiled programs, for torch's partitioner and remat alike: "
        "plain fx (default) or inductor",
    )
    output.add_argument(
        "--repeat",
        type=_positive,
        default=5,
        help="timed steps per configuration, interleaved across configurations (default 5)",
    )
    output.add_argument(
        "--threads",
        type=_non_negative,
        default=1,
        help="torch.set_num_threads on CPU while measuring (default 1, for stable timings; "
        "0 leaves torch's default)",
    )
    output.add_argument("--csv", metavar="FILE", help="also write the rows as CSV")
    output.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    output.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also plot peak memory against step time (needs matplotlib: the 'plot' extra)",
    )

    bench = sub.add_parser(
        "bench",
        parents=[model, output, limit],
        help="measure eager, checkpoint per block, torch's min-cut partitioner and remat",
        description="Measure one training step (forward+backward) of MODEL: eager, "
        "torch.utils.checkpoint around each of model.blocks, torch's "
        "min_cut_rematerialization_partition at activation_memory_budget = each budget, and "
        "remat at each budget with each solver. Per configuration: measured peak memory, "
        "median step time, overhead vs eager, compile time; for remat also the predicted "
        "peak and the solver's gap. torch's budget is a fraction of the bytes it saves, "
        "remat's a fraction of the store-all peak: compare the curves, not equal budgets.",
    )
    bench.add_argument(
        "--budgets",
        type=_budget_list,
        default="1,0.7,0.5,0.3,0.1",
        metavar="B,B,...",
        help="comma-separated fractions in [0, 1] (default 1,0.7,0.5,0.3,0.1); absolute "
        "budgets such as 64MiB apply to remat only",
    )
    bench.add_argument(
        "--solvers",
        type=_solver_list,
        default="auto",
        metavar="S,S,...",
        help=f"remat solvers, comma-separated, from {', '.join(_solver_names())} (default auto)",
    )
    bench.add_argument(
        "--cost-model",
        type=_cost_model_list,
        default="roofline",
        metavar="C,C,...",
        help="remat's per-op time, comma-separated: roofline (default, an estimate from "
        "flops and bytes) and/or profile (each distinct op timed on the device); each one "
        "named plans its own remat rows",
    )
    bench.set_defaults(run=cmd_bench)

    pareto = sub.add_parser(
        "pareto",
        parents=[model, cost_model, solver, output, limit],
        help="remat's measured memory/time frontier, from store-all down to its minimum",
        description="Trace MODEL once, find remat's store-all peak and the smallest peak it "
        "can reach, then measure remat at --points budgets evenly spaced between them (and "
        "eager for reference) and print the frontier.",
    )
    pareto.add_argument(
        "--points",
        type=_points,
        default=12,
        help="budgets from store-all down to the minimum, both included (default 12)",
    )
    pareto.set_defaults(run=cmd_pareto)
    return parser


def _cost_model_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    bad = [n for n in names if n not in COST_MODELS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown cost model(s) {', '.join(map(repr, bad))}; choose from "
            f"{', '.join(COST_MODELS)}"
        )
    return list(dict.fromkeys(names))


def _budget_list(text: str) -> list[float | int]:
    """Fractions (floats) and bytes (ints) for torch and remat alike. A plain number in
    [0, 1] is a fraction even without a point (``1`` is store-all, not one byte), and 0 is
    let through for torch's knob (the bench refuses it for remat)."""
    values: list[float | int] = []
    for token in text.split(","):
        token = token.strip()
        if not token:
            raise argparse.ArgumentTypeError(f"empty budget in {text!r}")
        try:
            number = float(token)
        except ValueError:
            number = None
        if number is not None and math.isfinite(number) and 0 <= number <= 1:
            values.append(number)
            continue
        try:
            budget = Budget.parse(token)
        except RematError as e:
            raise argparse.ArgumentTypeError(f"budget {token!r}: {e}") from None
        values.append(budget.fraction if budget.fraction is not None else budget.nbytes)
    return values


def _solver_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    for name in names:
        if name not in _solver_names():
            raise argparse.ArgumentTypeError(
                f"unknown solver {name!r}; choose from {', '.join(_solver_names())}"
            )
    return list(dict.fromkeys(names))


def _points(text: str) -> int:
    value = _positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 points, got {text!r}")
    return value


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    progress = _Progress(quiet=args.quiet)
    try:
        with progress.planner_log():
            return args.run(args, progress)
    except UsageError as e:
        print(f"remat {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        user = user_error(e)
        if user is None:  # a bug: the traceback is what a report needs
            raise
        print(f"remat {args.command}: error: {_one_line(str(user))}", file=sys.stderr)
        return EXIT_USAGE


class _Progress:
    """Progress lines on stderr, including the planner's one line per planned graph."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def planner_log(self):
        return _PlannerLog(self)


class _PlannerLog(logging.Handler):
    """While active, the ``remat`` logger's INFO lines (one per planned graph) are progress."""

    def __init__(self, progress: _Progress) -> None:
        super().__init__(logging.INFO)
        self.progress = progress
        self.logger = logging.getLogger("remat")
        self.old_level = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.progress(f"  {record.getMessage()}")

    def __enter__(self):
        if not self.progress.quiet:
            self.logger.addHandler(self)
            if not self.logger.isEnabledFor(logging.INFO):
                self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------- loading


def _load(args, progress: _Progress):
    """(model, inputs) for MODEL and --size; UsageError for an unknown model or bad size."""
    import torch

    from remat.tools import examples

    kwargs = dict(args.size)
    if args.device is not None:
        kwargs["device"] = args.device
    torch.manual_seed(args.seed)
    described = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    progress(f"loading {args.model}" + (f" ({described})" if described else "") + "...")
    try:
        model, inputs = examples.load(args.model, **kwargs)
    except ValueError as e:
        raise UsageError(_one_line(str(e))) from None
    except TypeError as e:  # an unknown --size key, or a factory returning the wrong thing
        raise UsageError(f"{args.model}: {_one_line(str(e))}") from None
    return model, inputs


def _solver(args):
    """The --solver name, or CP-SAT carrying --time-limit."""
    _check_time_limit(args, [args.solver])
    return with_time_limit(args.solver, args.time_limit)


def _check_time_limit(args, solvers: list[str]) -> None:
    """--time-limit is CP-SAT's: refused unless some solver named runs it."""
    if args.time_limit is not None and not set(CPSAT_SOLVERS) & set(solvers):
        names = ", ".join(solvers)
        raise UsageError(f"--time-limit applies to the solvers auto and cpsat, not {names}")


def _plan(args, model, inputs, budget, solver, progress: _Progress):
    import remat

    progress(f"tracing {args.model} (dynamo + AOTAutograd) and planning (budget {budget})...")
    return remat.plan(
        model, inputs, budget=budget, solver=solver, cost_model=args.cost_model
    )


# ----------------------------------------------------------------------------- inspect


def cmd_inspect(args, progress: _Progress) -> int:
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
    return EXIT_OK


INSPECT_COLUMNS = (
    "#",
    "name",
    "op",
    "shape",
    "dtype",
    "bytes",
    "est. time",
    "phase",
    "recomputable",
    "view of",
)


def inspect_table(
    g, index: int, count: int, *, sort: str = "order", limit: int | None = None
) -> str:
    """One graph of ``remat inspect``: heading, node table, summary line."""
    problem, fx_nodes = g.extracted.problem, g.extracted.fx_nodes
    nodes = problem.nodes
    order = list(range(len(nodes)))
    if sort == "bytes":
        order.sort(key=lambda i: -nodes[i].bytes)
    elif sort == "time":
        order.sort(key=lambda i: -nodes[i].cost)
    shown = order if limit is None else order[:limit]
    # Scratch memory of kernels (convolutions): a column only where some node has any.
    workspace = any(getattr(n, "workspace", 0) for n in nodes)
    rows = []
    for i in shown:
        node, fx_node = nodes[i], fx_nodes[i]
        shape, dtype = _shape_dtype(fx_node.meta.get("val"))
        row = [
            i,
            node.name,
            _op_label(node, fx_node, nodes),
            shape,
            dtype,
            format_bytes(node.bytes),
            format_seconds(node.cost),
            node.phase,
            "yes" if node.recomputable else "no",
            nodes[node.alias_of].name if node.alias_of is not None else "",
        ]
        if workspace:
            row.append(format_bytes(node.workspace) if node.workspace else "")
        rows.append(row)
    headers = INSPECT_COLUMNS + (("workspace",) if workspace else ())
    n_fwd = sum(1 for n in nodes if n.phase == "fwd")
    act = sum(n.bytes for n in nodes if n.phase == "fwd")
    heading = f"{g.name} (graph {index + 1} of {count}, sorted by {sort})"
    summary = (
        f"{g.name}: {len(nodes)} nodes ({n_fwd} fwd, {len(nodes) - n_fwd} bwd), "
        f"activation bytes {format_bytes(act)} ({act} B, all forward values), "
        f"resident {format_bytes(problem.resident_bytes)} (parameters and inputs), "
        f"store-all peak {format_bytes(g.store_all.peak)}"
    )
    if len(shown) < len(nodes):
        summary += f"; showing {len(shown)} of {len(nodes)} rows"
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    return f"{heading}\n{table}\n{summary}"


def _op_label(node, fx_node, nodes) -> str:
    if node.output_of is not None and len(fx_node.args) > 1:
        return f"{nodes[node.output_of].name}[{fx_node.args[1]}]"
    return node.op.removesuffix(".default")


def _shape_dtype(val: Any) -> tuple[str, str]:
    import torch

    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(str(d) for d in val.shape) + "]", str(val.dtype).removeprefix(
            "torch."
        )
    if isinstance(val, (tuple, list)):
        parts = [_shape_dtype(v) for v in val]
        dtypes = sorted({d for _, d in parts if d})
        return "(" + ", ".join(s or "-" for s, _ in parts) + ")", "/".join(dtypes)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "", type(val).__name__
    return "", ""


def format_seconds(s: float) -> str:
    """Seconds in the unit that reads best: '7.6 µs', '12.3 ms', '1.20 s'."""
    if s == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


# ----------------------------------------------------------------------------- plan


def cmd_plan(args, progress: _Progress) -> int:
    model, inputs = _load(args, progress)
    report = _plan(args, model, inputs, args.budget, _solver(args), progress)
    print(plan_table(report, args.budget))
    return EXIT_OK


def plan_table(report, budget: str) -> str:
    """``remat plan``'s output: one column per graph, then a summary line."""
    if not report.graphs:
        return "no graph was compiled (does the model's forward run any torch op?)"
    metrics: list[tuple[str, Callable]] = [
        ("nodes", lambda g: len(g.extracted.problem)),
        ("budget", lambda g: format_bytes(g.budget)),
        ("saved values", lambda g: len(g.plan.saved)),
        ("saved bytes", lambda g: format_bytes(g.saved_bytes)),
        ("recomputed values", lambda g: len(g.plan.recomputed)),
        ("recomputed bytes", lambda g: format_bytes(_recomputed_bytes(g))),
        ("predicted peak", lambda g: format_bytes(g.plan.peak)),
        ("store-all peak", lambda g: format_bytes(g.store_all.peak)),
        ("peak / store-all", lambda g: f"{g.plan.peak / max(g.store_all.peak, 1):.1%}"),
        ("recompute (est.)", lambda g: format_seconds(g.plan.recompute_cost)),
        ("recompute overhead", lambda g: f"+{_overhead(g):.1%} of forward"),
        ("solver", lambda g: g.plan.solver),
        ("status", lambda g: g.plan.status),
        ("lower bound", lambda g: "-" if g.plan.bound is None else format_seconds(g.plan.bound)),
        ("gap", lambda g: "-" if g.plan.gap is None else f"{g.plan.gap:.1%}"),
        ("solve time", lambda g: f"{g.plan.solve_seconds:.3f} s"),
        ("plan time", lambda g: f"{g.plan_seconds:.3f} s"),
    ]
    rows = [(label, *(str(f(g)) for g in report.graphs)) for label, f in metrics]
    headers = ("", *(g.name for g in report.graphs))
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    predicted, store_all = report.predicted_peak, report.store_all_peak
    summary = (
        f"budget {budget}: predicted peak {format_bytes(predicted)} ({predicted} B), "
        f"{predicted / max(store_all, 1):.1%} of the store-all peak {format_bytes(store_all)} "
        f"({store_all} B)"
    )
    if len(report.graphs) > 1:
        summary += f"; {len(report.graphs)} graphs (graph breaks), planned one after another"
    return f"{table}\n{summary}"


def _recomputed_bytes(g) -> int:
    problem = g.extracted.problem
    return sum(problem.nodes[i].bytes for i in g.plan.recomputed)


def _overhead(g) -> float:
    """Recompute cost as a fraction of the forward's estimated time (as ``PlanReport``)."""
    problem = g.extracted.problem
    fwd_cost = sum(problem.nodes[i].cost for i in g.store_all.schedule.forward)
    return g.plan.recompute_cost / max(fwd_cost, 1e-12)


# ----------------------------------------------------------------------------- train


def cmd_train(args, progress: _Progress) -> int:
    import torch

    import remat
    from remat import costs, memory
    from remat.passes.rng import is_replay_state

    model, inputs = _load(args, progress)
    eager = copy.deepcopy(model)
    try:
        optimized = remat.optimize(
            model,
            args.budget,
            solver=_solver(args),
            compiler=args.compiler,
            cost_model=args.cost_model,
        )
    except ValueError as e:
        raise UsageError(_one_line(str(e))) from None
    runs = {
        "eager": (eager, torch.optim.SGD(eager.parameters(), lr=args.lr)),
        "remat": (optimized, torch.optim.SGD(model.parameters(), lr=args.lr)),
    }
    device = _device_of(model)

    def forward_backward(m):
        loss = m(*inputs)
        loss.backward()
        return loss.detach()

    def step(m, opt):
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(m)
        opt.step()
        return loss

    losses: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.steps):
        for name, (m, opt) in runs.items():
            if name == "remat" and i == 0:
                progress(
                    f"compiling {args.model} with remat (trace, plan under budget "
                    f"{args.budget}, rewrite)..."
                )
            torch.manual_seed(args.seed + i)  # same dropout masks for both, step by step
            losses[name].append(step(m, opt).item())
        progress(
            f"step {i + 1}/{args.steps}: loss eager {losses['eager'][-1]:.6f}, "
            f"remat {losses['remat'][-1]:.6f}"
        )

    report = optimized.remat.report()
    peaks, times = {}, {}
    for name, (m, opt) in runs.items():
        progress(
            f"measuring {name}: peak memory of one forward+backward, then "
            f"{args.repeat} timed steps..."
        )
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(args.seed)
        peaks[name] = memory.peak(forward_backward, m, device=device).peak_bytes
        opt.zero_grad(set_to_none=True)
        times[name] = memory.step_time(
            lambda m=m, opt=opt: step(m, opt), warmup=1, repeat=args.repeat, device=device
        )
    # Replayed dropout draws eager's masks; only other random ops may draw differently.
    random = any(
        costs.is_random(n) and not is_replay_state(n)
        for g in report.graphs
        for n in g.extracted.fx_nodes
    )

    print(
        f"plan ({args.model}, budget {args.budget}, solver {args.solver}, compiler {args.compiler})"
    )
    print(plan_table(report, args.budget))
    print()
    print(train_table(args, report, peaks, times, losses))
    print()
    verdict, ok = _loss_verdict(losses, random)
    ratio = peaks["remat"] / max(peaks["eager"], 1)
    budgets = sorted({g.budget for g in report.graphs})
    within = all(peaks["remat"] <= b for b in budgets) if len(budgets) == 1 else None
    print(
        f"measured peak: remat {format_bytes(peaks['remat'])} = {ratio:.1%} of eager's "
        f"{format_bytes(peaks['eager'])}"
        + ("" if within is None else f"; within the budget: {'yes' if within else 'NO'}")
    )
    print(f"step time: remat {times['remat'] / max(times['eager'], 1e-12):.2f}x eager's")
    print(verdict)
    return EXIT_OK if ok else EXIT_FAILED


def train_table(args, report, peaks, times, losses) -> str:
    budgets = sorted({g.budget for g in report.graphs})
    budget = f"{args.budget} = {format_bytes(budgets[0])}" if len(budgets) == 1 else args.budget
    rows = [
        (
            "peak memory (measured, fwd+bwd)",
            format_bytes(peaks["eager"]),
            format_bytes(peaks["remat"]),
        ),
        (
            "predicted peak",
            f"{format_bytes(report.store_all_peak)} (store-all)",
            format_bytes(report.predicted_peak),
        ),
        ("budget", "-", budget),
        (
            f"step time (median of {args.repeat})",
            format_seconds(times["eager"]),
            format_seconds(times["remat"]),
        ),
    ]
    for i, (a, b) in enumerate(zip(losses["eager"], losses["remat"], strict=True)):
        rows.append((f"loss step {i + 1}", f"{a:.6f}", f"{b:.6f}"))
    return tabulate(rows, headers=("", "eager", "remat"), tablefmt="simple", disable_numparse=True)


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


# ----------------------------------------------------------------------------- bench


def _bench_setup(args, progress: _Progress) -> tuple[str | None, str, dict]:
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
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib: install the 'plot' extra (pip install -e '.[plot]')"
            ) from None
    try:
        model, _inputs = _load(args, progress)  # fails fast on an unknown model or --size key
    except ImportError as e:
        raise UsageError(f"{args.model}: {_one_line(str(e))}") from None
    if device is None:  # the factory's default: pass nothing, measure where it lives
        return None, str(_device_of(model)), dict(args.size)
    return device, str(torch.device(device)), dict(args.size)


def _bench_output(args, rows, meta: dict) -> None:
    from remat.tools import bench

    print(bench.rows_table(rows))
    if args.csv:
        bench.write_csv(rows, args.csv)
    if args.json:
        bench.write_json(rows, args.json, meta)
    if args.plot:
        bench.plot_rows(rows, args.plot, title=f"{args.model}: peak memory vs step time")


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


def cmd_bench(args, progress: _Progress) -> int:
    from remat.tools import bench

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
    verdicts = bench.dominates(rows)
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
    from remat.tools import bench

    best = bench.fastest_within(rows, torch_row.peak_bytes)
    if best is None:
        return f"{torch_row.label} (no remat point at or below its peak)"
    noise = max(r.spread or 0.0 for r in (best, torch_row))
    ratio = best.step_s / torch_row.step_s
    faster, rounds = bench.rounds_faster(best, torch_row)
    paired = f", faster in {faster}/{rounds} rounds" if rounds else ""
    return (
        f"{torch_row.label} (nearest: {best.label} at {ratio:.3f}x its time{paired}, +-{noise:.1%})"
    )


def cmd_pareto(args, progress: _Progress) -> int:
    from remat.tools import bench

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
    front = [r for r in bench.frontier(rows) if r.method == "remat"]
    print()
    print(
        f"remat frontier ({len(front)} of {sum(r.method == 'remat' for r in rows)} points "
        "not beaten on both peak and time): "
        + ", ".join(f"{format_bytes(r.peak_bytes)} @ {format_seconds(r.step_s)}" for r in front)
    )
    return EXIT_OK
