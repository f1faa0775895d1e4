"""The ``remat`` command line: look at a model's training graph, plan it, train it.

- ``remat inspect MODEL``: the joint forward+backward graph remat plans, one row per value.
- ``remat plan MODEL --budget B``: what remat would save and recompute under a budget (by
  module with ``--values``; as JSON, a memory-over-time plot and DOT on request).
- ``remat train MODEL``: a few SGD steps with ``remat.optimize`` and eagerly, side by side
  (measured peak memory, step times with their spread, losses).
- ``remat bench MODEL``: measured peak memory and step time of eager, checkpointing per block,
  torch's min-cut partitioner and remat, at a list of budgets (``remat.tools.bench``).
- ``remat pareto MODEL``: remat's measured memory/time frontier, store-all down to its minimum.

MODEL is a built-in example (``remat.tools.examples.EXAMPLES``) or ``package.module:factory``
(found in the current folder too, as ``python -m`` finds it); ``--size key=value`` passes
keyword arguments to the factory. Every mistake a user can make (bad budget, unknown model
or solver, infeasible budget) prints one line on stderr and exits with status 2; progress
goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from remat.costs import COMPILERS, COST_MODELS
from remat.errors import RematError, user_error
from remat.solvers import Budget
from remat.tools.arguments import (
    cost_model_list,
    non_negative,
    number,
    points,
    positive,
    positive_float,
    size_option,
    solver_list,
)
from remat.tools.commands import (
    EXIT_USAGE,
    Progress,
    UsageError,
    cmd_bench,
    cmd_inspect,
    cmd_pareto,
    cmd_plan,
    cmd_train,
    one_line,
)
from remat.tools.helptext import (
    COMPILER_TEXT,
    COST_MODEL_TEXT,
    HelpFormatter,
    choice_lines,
    model_help,
    solver_help,
    solver_names,
    time_limit_help,
)

__all__ = ["main"]


SORT_KEYS = ("order", "bytes", "time")
TIMELINE_HELP = (
    "also plot the step's predicted memory over time against storing everything, with the "
    "budget, and write the numbers to FILE.json beside it (needs matplotlib: the 'plot' "
    "extra)"
)
DEFAULT_COST_MODEL = "roofline"  # an estimate: planning starts without timing every op


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line instead of usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# ----------------------------------------------------------------------------- arguments


def _budget(text: str) -> Budget:
    try:
        return Budget.parse(text)
    except RematError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``remat`` parser: options shared by several commands are parent parsers."""
    from remat import __version__

    parser = _Parser(
        prog="remat",
        description="Fit a PyTorch training step in a memory budget by recomputing activations.",
        epilog="Run 'remat COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    shared = {
        "model": _model_options(),
        "cost_model": _cost_model_option(),
        "solver": _solver_option(),
        "limit": _time_limit_option(),
        "output": _measuring_options(),
    }
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_inspect, _add_plan, _add_train, _add_bench, _add_pareto):
        add(sub, shared)
    return parser


def _model_options() -> argparse.ArgumentParser:
    """Parent parser: MODEL and how it is built (its factory's sizes, device, seed), and
    --quiet."""
    model = _Parser(add_help=False)
    model.add_argument("model", metavar="MODEL", help=model_help())
    model.add_argument(
        "--size",
        metavar="KEY=VALUE",
        action="append",
        type=size_option,
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
    return model


def _cost_model_option() -> argparse.ArgumentParser:
    """Parent parser: one --cost-model. Not part of ``_model_options``: ``bench`` takes a
    list instead. (Overriding it there with conflict_handler="resolve" stripped the option
    from the shared action, and every command created after ``bench`` refused
    --cost-model.)"""
    cost_model = _Parser(add_help=False)
    cost_model.add_argument(
        "--cost-model",
        choices=COST_MODELS,
        default=DEFAULT_COST_MODEL,
        help=choice_lines("per-op time", COST_MODEL_TEXT, COST_MODELS, DEFAULT_COST_MODEL),
    )
    return cost_model


def _solver_option() -> argparse.ArgumentParser:
    """Parent parser: --solver, one of ``SOLVERS``, each described by its docstring."""
    solver = _Parser(add_help=False)
    solver.add_argument(
        "--solver", choices=solver_names(), default=solver_names()[0], help=solver_help()
    )
    return solver


def _time_limit_option() -> argparse.ArgumentParser:
    """Parent parser: --time-limit, CP-SAT's."""
    limit = _Parser(add_help=False)
    limit.add_argument(
        "--time-limit",
        type=number(float, lambda v: v > 0, "a positive number of seconds"),
        default=None,
        help=time_limit_help(),
    )
    return limit


def _measuring_options() -> argparse.ArgumentParser:
    """Parent parser: how ``bench`` and ``pareto`` measure, and the files they write."""
    output = _Parser(add_help=False)
    output.add_argument(
        "--compiler",
        choices=COMPILERS,
        default=COMPILERS[0],
        help=choice_lines(
            "what runs the compiled programs, torch's partitioner's and remat's alike",
            COMPILER_TEXT,
            COMPILERS,
            COMPILERS[0],
        ),
    )
    output.add_argument(
        "--repeat",
        type=positive,
        default=5,
        help="timed steps per configuration, interleaved across configurations (default 5)",
    )
    output.add_argument(
        "--threads",
        type=non_negative,
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
    return output


def _add_inspect(sub, shared: dict[str, argparse.ArgumentParser]) -> None:
    inspect = sub.add_parser(
        "inspect",
        parents=[shared["model"], shared["cost_model"]],
        help="table of the joint forward+backward graph: op, shape, bytes, time",
        description="Trace MODEL's training step and print one row per value of the joint "
        "graph remat plans (parameters and inputs are resident and not listed).",
    )
    inspect.add_argument(
        "--graph",
        type=non_negative,
        default=None,
        metavar="N",
        help="show only graph N (one per graph break; default: all)",
    )
    inspect.add_argument(
        "--limit",
        type=positive,
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
    inspect.add_argument(
        "--dot",
        metavar="FILE",
        help="also write the graphs as Graphviz DOT (one box per value, an edge per read, "
        "a legend)",
    )
    inspect.set_defaults(run=cmd_inspect)


def _add_plan(sub, shared: dict[str, argparse.ArgumentParser]) -> None:
    plan = sub.add_parser(
        "plan",
        parents=[shared["model"], shared["cost_model"], shared["solver"], shared["limit"]],
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
    plan.add_argument(
        "--dot",
        metavar="FILE",
        help="also write the graphs as Graphviz DOT, saved values blue, recomputed orange "
        "(a legend in the file says so)",
    )
    plan.add_argument(
        "--values",
        action="store_true",
        help="also list each value the plan saves or recomputes as 'module: op' (e.g. "
        "'transformer.h.0.mlp.act: gelu'), with its bytes",
    )
    plan.add_argument(
        "--json",
        metavar="FILE",
        help="also write the report as JSON (numbers: bytes, seconds; every graph, step and "
        "saved or recomputed value); '-' writes it to stdout instead of the table",
    )
    plan.add_argument("--timeline", metavar="FILE.png", help=TIMELINE_HELP)
    plan.set_defaults(run=cmd_plan)


def _add_train(sub, shared: dict[str, argparse.ArgumentParser]) -> None:
    train = sub.add_parser(
        "train",
        parents=[shared["model"], shared["cost_model"], shared["solver"], shared["limit"]],
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
    train.add_argument("--steps", type=positive, default=3, help="SGD steps (default 3)")
    train.add_argument(
        "--lr", type=positive_float, default=0.01, help="SGD learning rate (default 0.01)"
    )
    train.add_argument(
        "--compiler",
        choices=COMPILERS,
        default=COMPILERS[0],
        help=choice_lines(
            "how remat's forward/backward programs run", COMPILER_TEXT, COMPILERS, COMPILERS[0]
        ),
    )
    train.add_argument(
        "--repeat",
        type=positive,
        default=5,
        help="timed steps per model: their median and range are shown (default 5)",
    )
    train.add_argument(
        "--timeline",
        metavar="FILE.png",
        help=TIMELINE_HELP + "; on the CPU with remat's measured memory over one step too",
    )
    train.set_defaults(run=cmd_train)


def _add_bench(sub, shared: dict[str, argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        parents=[shared["model"], shared["output"], shared["limit"]],
        help="measure eager, checkpoint per block, torch's min-cut partitioner and remat",
        description="Measure one training step (forward+backward) of MODEL: eager, "
        "torch.utils.checkpoint around each of model.blocks, torch's "
        "min_cut_rematerialization_partition at activation_memory_budget = each budget, and "
        "remat at each budget with each solver. Per configuration: measured peak memory, "
        "median step time, overhead vs eager, compile time; for remat also the predicted "
        "peak and the solver's gap. torch's budget is a fraction of the bytes it saves, "
        "remat's a fraction of its store-all peak (or lower: docs/guide.md): compare the "
        "curves, not equal budgets.",
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
        "--at-torch-peaks",
        action="store_true",
        help="also run remat (first solver) at each measured peak of a torch point with "
        "correct gradients, as an absolute budget: the curves compared at equal memory",
    )
    bench.add_argument(
        "--solvers",
        type=solver_list,
        default=solver_names()[0],
        metavar="S,S,...",
        help=f"remat solvers, comma-separated, from {', '.join(solver_names())} (default "
        f"{solver_names()[0]}; 'remat plan --help' describes them)",
    )
    bench.add_argument(
        "--cost-model",
        type=cost_model_list,
        default=DEFAULT_COST_MODEL,
        metavar="C,C,...",
        help=choice_lines(
            "remat's per-op time, comma-separated, each one named planning its own remat rows",
            COST_MODEL_TEXT,
            COST_MODELS,
            DEFAULT_COST_MODEL,
        ),
    )
    bench.set_defaults(run=cmd_bench)


def _add_pareto(sub, shared: dict[str, argparse.ArgumentParser]) -> None:
    pareto = sub.add_parser(
        "pareto",
        parents=[shared[k] for k in ("model", "cost_model", "solver", "output", "limit")],
        help="remat's measured memory/time frontier, from store-all down to its minimum",
        description="Trace MODEL once, find remat's store-all peak and the smallest peak it "
        "can reach, then measure remat at --points budgets evenly spaced between them (and "
        "eager for reference) and print the frontier.",
    )
    pareto.add_argument(
        "--points",
        type=points,
        default=12,
        help="budgets from store-all down to the minimum, both included (default 12)",
    )
    pareto.set_defaults(run=cmd_pareto)


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
        if budget.lowest or budget.device:
            raise argparse.ArgumentTypeError(
                f"budget {token!r}: --budgets compares torch and remat at budgets both "
                "read, fractions or bytes; 'remat pareto' sweeps down to remat's lowest peak"
            )
        values.append(budget.fraction if budget.fraction is not None else budget.nbytes)
    return values


# ----------------------------------------------------------------------------- main


def _import_from_cwd() -> None:
    """``package.module:factory`` finds a module in the current folder, as ``python -m``
    does: the ``remat`` script's ``sys.path`` starts with the script's own folder."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command line; returns the exit status."""
    _import_from_cwd()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    progress = Progress(quiet=args.quiet)
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
        print(f"remat {args.command}: error: {one_line(str(user))}", file=sys.stderr)
        return EXIT_USAGE
