"""Choosing a solver by name, and the one entry point the rest of remat calls."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Protocol

from .chain import lowest_chain_peak, revolve, sqrt
from .cpsat import GAP_LIMIT, cpsat
from .errors import InfeasibleBudget, InvalidOption, RematError, SolverOverBudget
from .heuristics import greedy, recompute_all, store_all
from .plan import Plan, evaluate, with_bound
from .problem import Problem
from .repeated import repeated
from .schedule import InvalidPlan


class Solver(Protocol):
    """What plans a problem under a limit: the functions in ``SOLVERS`` (``greedy``,
    ``cpsat``, ...), a ``functools.partial`` of one with its options, or a user's own.

    ``solve`` runs any of them and trusts none: it derives each plan again from its
    saved set, so a solver only has to choose what to save, and make its plan with
    ``evaluate`` (docs/architecture.md, "Adding a solver").
    """

    def __call__(self, problem: Problem, limit: int, /) -> Plan:
        """Plan ``problem`` to peak at most ``limit`` bytes.

        Args:
            problem: the joint graph to plan.
            limit: the budget in bytes (a user's budget is read once, at the API:
                ``Budget.parse(budget).resolve(store_all(problem).peak)``).

        Returns:
            The plan ``evaluate`` makes of the values it saves: ``solve`` derives it again
            and refuses one that differs.

        Raises:
            InfeasibleBudget: no plan the solver can find fits ``limit``; its ``minimum``
                is the lowest budget it found a plan under (a retry there succeeds).

        Example:
            A solver that saves nothing (every value the backward reads is recomputed):

            >>> from remat.solvers import Node, Plan, Problem, evaluate, solve
            >>> def save_nothing(problem: Problem, limit: int, /) -> Plan:
            ...     return evaluate(problem, (), solver="save-nothing", limit=limit)
            >>> problem = Problem(
            ...     (Node("x", "fwd", bytes=100, cost=1.0),
            ...      Node("h", "fwd", bytes=100, cost=1.0, inputs=(0,)),
            ...      Node("loss", "fwd", bytes=4, cost=1.0, inputs=(1,)),
            ...      Node("tangent", "bwd", bytes=4),
            ...      Node("dh", "bwd", bytes=100, cost=1.0, inputs=(3, 1)),
            ...      Node("dx", "bwd", bytes=100, cost=1.0, inputs=(4, 0))),
            ...     outputs=(2,), grads=(5,))
            >>> plan = solve(problem, 1000, save_nothing)
            >>> plan.solver, plan.saved, plan.peak <= 1000
            ('save-nothing', frozenset(), True)
        """
        ...


log = logging.getLogger("remat")


def auto(problem: Problem, limit: int | None = None, **cpsat_options) -> Plan:
    """``repeated``'s pattern plan where its bound proves it within the gap limit (one LP
    and a few dozen simulations), else CP-SAT (which starts from the greedy plan and
    returns it when it finds nothing better in its time limit: never worse than the
    greedy, with a bound when it can) and the cheaper of the two plans, with the higher
    bound. From ``REPEATED_MIN_NODES`` nodes ``repeated`` alone. Below the floor of plans
    that recompute each value once, the binomial schedule over the graph's chain of
    stages (``revolve``), which recomputes some more than once. ``cpsat_options`` go to
    CP-SAT (``time_limit``, ``gap_limit``, ``probes``)."""
    from . import cpsat as module  # the module's function, so tests can watch it

    try:
        return _patterns_or_search(problem, limit, module.cpsat, cpsat_options)
    except InfeasibleBudget as refusal:
        low = lowest_chain_peak(problem)
        if low is None or low.peak >= refusal.minimum:
            raise
        if low.peak > limit:
            raise InfeasibleBudget(limit, low.peak, refusal.store_all, problem.name) from None
        return revolve(problem, limit)


# From this size ``auto`` plans repeated blocks by pattern alone: CP-SAT on the whole
# graph takes minutes there, and the patterns are no costlier (see docs/solver-notes.md,
# "Repeated blocks").
REPEATED_MIN_NODES = 5_000


def _patterns_or_search(problem: Problem, limit: int | None, search, options: dict) -> Plan:
    """``auto``'s plan (its docstring): below ``REPEATED_MIN_NODES`` CP-SAT's search only
    where the patterns are not proven within the gap limit (see docs/solver-notes.md,
    "Repeated blocks": the patterns first)."""
    if limit is None:
        return search(problem, limit, **options)
    start = time.perf_counter()
    patterns = repeated(problem, limit, **options)  # CP-SAT itself where no block repeats
    if (
        len(problem) >= REPEATED_MIN_NODES
        or patterns.solver != "repeated"
        or patterns.gap <= options.get("gap_limit", GAP_LIMIT)
    ):
        return patterns
    searched = search(problem, limit, **options)
    best = min((searched, patterns), key=lambda plan: plan.cost)
    return with_bound(
        best,
        max(patterns.bound, searched.bound),
        solver=best.solver,
        limit=limit,
        seconds=time.perf_counter() - start,
        proven=searched.status == "optimal",
    )


CPSAT_SOLVERS = ("auto", "cpsat", "repeated")  # the names that run CP-SAT, so take its time limit

SOLVERS: dict[str, Solver] = {  # the one registry of names; the first is the default
    "auto": auto,
    "cpsat": cpsat,
    "repeated": repeated,
    "greedy": greedy,
    "store-all": store_all,
    "recompute-all": recompute_all,
    "sqrt": sqrt,
    "revolve": revolve,
}


def solver_for(solver: str | Solver) -> Solver:
    """The solver a name (from ``SOLVERS``) or a callable ``(problem, limit) -> Plan``
    stands for; ``InvalidOption`` naming the choices otherwise."""
    if callable(solver):
        return solver
    if solver not in SOLVERS:
        raise InvalidOption(
            f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)} "
            "or pass a callable (problem, limit) -> Plan"
        )
    return SOLVERS[solver]


def with_time_limit(solver: str, time_limit: float | None) -> str | Solver:
    """``solver`` as ``solve`` takes it: the name, or for ``CPSAT_SOLVERS`` CP-SAT carrying
    ``time_limit`` (deterministic seconds) when one is given."""
    if time_limit is None or solver not in CPSAT_SOLVERS:
        return solver
    from . import cpsat as module  # the module's function, so tests can watch it

    run = {"auto": auto, "repeated": repeated}.get(solver, module.cpsat)
    return functools.partial(run, time_limit=time_limit)


def solve(
    problem: Problem,
    limit: int,
    solver: str | Solver = "auto",
    candidates: Callable[[], Mapping[str, Iterable[int]]] | None = None,
) -> Plan:
    """Plan ``problem`` to peak at most ``limit`` bytes: the one entry point the rest of
    remat calls.

    No plan is taken on faith: each is derived again from its saved set (and its backward
    order, where it gives one) through ``schedule`` and ``simulate``, a plan whose peak,
    cost or programs differ from that is refused, and the limit is checked against the
    derived peak; so a buggy solver cannot break the promise. A solver that crashes (an
    OR-Tools fault, a bug in a user's solver) is replaced by the greedy, with a warning:
    a solver's failure must not end a training step.

    Args:
        problem: the joint graph to plan (a step's graphs together: ``step.compose``).
        limit: the budget in bytes. A user's budget becomes one through
            ``Budget.parse(budget).resolve(store_all(problem).peak)`` (a fraction needs
            the problem's store-all peak).
        solver: a name from ``SOLVERS`` or a ``Solver`` callable.
        candidates: saved sets found elsewhere, by name (torch's own partition), made
            on demand: one that fits and costs less than the solver's plan is returned
            instead, under its name and with the solver's bound (a bound on every plan);
            one ``schedule`` refuses is skipped. Called only where the solver's bound
            does not prove its plan within ``GAP_LIMIT`` of every plan: a candidate
            could save no more than CP-SAT itself stops short of; and where the solver
            finds no plan under ``limit``, whose refusal a fitting candidate overrules
            (the cheapest is returned, without a bound).

    Returns:
        The plan: what it saves and recomputes, its programs' order, its predicted peak
        (at most ``limit``) and cost, and from the optimising solvers a lower bound on
        every plan's cost (``bound``, ``gap``).

    Raises:
        InfeasibleBudget: ``limit`` is below the lowest peak remat can reach; its
            ``minimum`` names that peak, a budget a retry meets.
        SolverOverBudget: the solver's plan peaks over a ``limit`` some plan meets (a
            fixed strategy, or a user's solver that ignores the limit).
        InvalidPlan: the solver's plan is not what its saved set makes.
        InvalidOption: ``solver`` names no solver.
        TypeError: ``limit`` is not ``int`` bytes, or the solver returned no ``Plan``.

    Example:
        A chain ``x -> h -> y`` whose backward reads each of its values:

        >>> from remat.solvers import Budget, InfeasibleBudget, Node, Problem, solve, store_all
        >>> problem = Problem(
        ...     (Node("x", "fwd", bytes=100, cost=1.0),
        ...      Node("h", "fwd", bytes=100, cost=1.0, inputs=(0,)),
        ...      Node("y", "fwd", bytes=100, cost=1.0, inputs=(1,)),
        ...      Node("loss", "fwd", bytes=4, cost=1.0, inputs=(2,)),
        ...      Node("tangent", "bwd", bytes=4),
        ...      Node("dy", "bwd", bytes=100, cost=1.0, inputs=(4, 2)),
        ...      Node("dh", "bwd", bytes=100, cost=1.0, inputs=(5, 1)),
        ...      Node("dx", "bwd", bytes=100, cost=1.0, inputs=(6, 0))),
        ...     outputs=(3,), grads=(7,))
        >>> limit = Budget.parse("80%").resolve(store_all(problem).peak)
        >>> plan = solve(problem, limit)
        >>> plan.peak <= limit, plan.status
        (True, 'optimal')
        >>> [problem.nodes[i].name for i in sorted(plan.recomputed)]
        ['x']
        >>> try:
        ...     solve(problem, 200)
        ... except InfeasibleBudget as refusal:
        ...     print(refusal.minimum)
        304
    """
    fn = solver_for(solver)
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(
            f"limit must be bytes (int), got {type(limit).__name__}: resolve a budget with "
            "Budget.parse(budget).resolve(store_all(problem).peak)"
        )
    with _no_cycle_collection():
        try:
            plan = _checked(problem, _run_or_greedy(fn, problem, limit, solver), solver)
        except InfeasibleBudget:
            fitting = _fitting(problem, limit, candidates() if candidates else {})
            if fitting is None:
                raise
            return fitting
        if plan.peak > limit:
            minimum = min_peak_plan(problem).peak
            if minimum > limit:
                raise InfeasibleBudget(limit, minimum, store_all(problem).peak, problem.name)
            raise SolverOverBudget(
                f"solver {solver!r} returned a plan peaking at {plan.peak} bytes, over the budget "
                f"of {limit} bytes, which is feasible (remat reaches {minimum} bytes)"
            )
        if candidates is None or (plan.gap is not None and plan.gap <= GAP_LIMIT):
            return plan
        return _cheapest(problem, plan, limit, candidates())


def _cheapest(
    problem: Problem, plan: Plan, limit: int, candidates: Mapping[str, Iterable[int]]
) -> Plan:
    """``plan``, or the cheapest of ``candidates`` that fits ``limit`` where it costs less."""
    for name, saved in candidates.items():
        try:
            other = evaluate(problem, saved, solver=name, limit=limit)
        except InvalidPlan as e:
            log.debug("remat %s: candidate %s skipped: %s", problem.name, name, e)
            continue
        if other.peak <= limit and other.cost < plan.cost:
            if plan.bound is None:
                plan = replace(other, solve_seconds=plan.solve_seconds)
            else:
                seconds = plan.solve_seconds
                plan = with_bound(other, plan.bound, solver=name, limit=limit, seconds=seconds)
    return plan


def _fitting(
    problem: Problem, limit: int, candidates: Mapping[str, Iterable[int]]
) -> Plan | None:
    """The cheapest of ``candidates`` that fits ``limit``, or None."""
    plans = []
    for name, saved in candidates.items():
        try:
            plans.append(evaluate(problem, saved, solver=name, limit=limit))
        except InvalidPlan as e:
            log.debug("remat %s: candidate %s skipped: %s", problem.name, name, e)
    return min((p for p in plans if p.peak <= limit), key=lambda p: p.cost, default=None)


def _run_or_greedy(fn: Solver, problem: Problem, limit: int, solver: str | Solver) -> object:
    """``fn``'s answer; where it crashes (an OR-Tools fault, a bug in a user's solver), the
    greedy's plan, with a warning naming the fault: a solver's failure must not end a
    training step. Verdicts (``RematError``: the budget is infeasible, ...) pass."""
    try:
        return fn(problem, limit)
    except RematError:
        raise
    except Exception as fault:
        if fn is greedy:
            raise
        name = getattr(solver, "__name__", None) or repr(solver)
        log.warning(
            "remat %s: solver %s failed (%s: %s); planning with the greedy instead",
            problem.name or "graph",
            name,
            type(fault).__name__,
            " ".join(str(fault).split())[:200],
        )
        return greedy(problem, limit)


def _checked(problem: Problem, plan: object, solver: str | Solver) -> Plan:
    """``plan`` if it is what its saved set and order make; else ``InvalidPlan`` naming
    ``solver`` and what differs."""
    name = getattr(solver, "__name__", None) or repr(solver)
    if not isinstance(plan, Plan):
        raise TypeError(f"solver {name} returned {type(plan).__name__}, expected a Plan")
    order = plan.schedule.backward if plan.ordered else None
    try:
        again = evaluate(problem, plan.saved, backward=order, solver=plan.solver)
    except InvalidPlan as e:
        raise InvalidPlan(f"solver {name} returned a plan that cannot run: {e}") from None
    claims = {
        "peak": (plan.peak, again.peak),
        "recompute cost": (plan.recompute_cost, again.recompute_cost),
        "save cost": (plan.save_cost, again.save_cost),
        "programs": (plan.schedule, again.schedule),
    }
    wrong = [f"{what} {got!r:.60} (derived: {want!r:.60})"
             for what, (got, want) in claims.items() if got != want]  # fmt: skip
    if wrong:
        raise InvalidPlan(
            f"solver {name} returned a plan that is not what its saved values make: "
            + "; ".join(wrong)
            + ". Build plans with remat.solvers.evaluate."
        )
    return plan


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a solver runs, as ``timeit`` does.

    Solvers simulate hundreds of plans, allocating millions of short-lived tuples that
    form no cycles (reference counting frees them); each time they trigger a full
    collection it rescans every tracked object of the process (350,000 once torch is
    imported). At 10,000 nodes that was half the greedy's time (11.7 s -> 5.2 s without).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def min_peak_plan(problem: Problem) -> Plan:
    """The lowest-peak plan remat can find: what a budget below it is told. The greedy's
    lowest, or a chain schedule's where the graph is a chain and that is lower."""
    plans = [greedy(problem), lowest_chain_peak(problem)]
    return min((p for p in plans if p is not None), key=lambda p: p.peak)


def lowest_budget(problem: Problem, solver: str | Solver = "auto") -> int:
    """The lowest budget ``solver`` finds a plan of ``problem`` under: what a budget of
    ``"min"`` plans at, and what every refusal names (a refusal's minimum does not depend
    on the budget asked, so the smallest budget's refusal names it)."""
    try:
        plan = solve(problem, 1, solver)
    except InfeasibleBudget as refusal:
        return refusal.minimum
    return plan.peak  # a problem that allocates nothing
