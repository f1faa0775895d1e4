"""The optimising solver: CP-SAT on ``Relaxation``, every answer checked by the simulator.

First the relaxation's LP, solved by an LP solver (``linear_bound.solve_lp``, not
charged to the limit): a proven bound before CP-SAT's presolve, and where it proves the
greedy's plan within ``gap_limit`` the search is skipped; its answer, rounded and
repaired, is a candidate plan, and where the rounded answer overflows in the backward,
those steps are made exact before the first round. Then two phases share the time limit:

1. the relaxation (prefix-sum memory chains, no exact backward), on one worker with
   CP-SAT's strongest LP, up to the whole limit once the greedy's plan fits (else up to
   ``BOUND_SHARE``, leaving the exact model time to find a plan). Its optimum is a
   lower bound on every plan's cost; its answer, repaired when it overflows (the
   cheapest single flip that fits, else ``descend``) and polished by ``fill``, is a
   candidate plan. While the answer overflows, the backward steps where it does are
   made exact (``add_point``: cuts every plan satisfies) or its forward overflow cut
   off, and the relaxation solved again: each round's optimum is a stronger bound, and
   an answer that fits is optimal outright.
2. the full model (the backward exact at every step, the forward relaxed), hinted
   with the best plan so far. An answer that overflows (in the forward) is cut off
   (``explain``, or that exact saved set) and the model solved again. Its deterministic
   time undercounts its work, so it gets the rest of the limit divided by
   ``EXACT_WEIGHT`` (not run below ``MIN_EXACT``), in full only when the greedy found
   no plan.

With the default limit, where the plan is still not proven within ``gap_limit`` after
both, they run again for up to ``EXTRA_LIMIT`` more (the relaxation keeps its points).

Both phases stop once the incumbent is proven within ``gap_limit`` (1%) of the optimum:
the relaxation from inside CP-SAT (a bound callback), not only between rounds.

Each solve's final answer is simulated (not the intermediate ones: which of those
CP-SAT reports depends on thread timing, its final answer does not); the cheapest
that fits is returned (``fill``-polished, costliest first, then per byte), never worse
than the greedy plan it starts from (also polished). ``bound`` is the best proven bound
of either phase, so ``gap`` is honest.

Deterministic: one seed, a limit in CP-SAT's *deterministic* time (a work count,
the same on every machine) and, with several workers, interleaved search; so every
rank of a distributed job gets the same plan. Each solve also has a wall-clock guard
of ``WALL_FACTOR`` times its limit against pathological models (the LP solve one of
``WALL_FACTOR`` times the whole limit); only if one fires can two runs differ.
The measurements behind each choice: docs/solver-notes.md, "Adopted". The model, and
the papers it follows (Checkmate's LP rounding, Moccasin's CP-SAT): ``relaxation``.
"""

from __future__ import annotations

import functools
import logging
import time

from ortools.sat.python import cp_model

from .cuts import explain, forbid, forbid_saved_set
from .errors import InfeasibleBudget
from .exact import add_points
from .heuristics import fill, greedy, repaired
from .linear_bound import solve_lp
from .plan import Plan, evaluate, with_bound
from .problem import Problem
from .relaxation import Relaxation
from .units import format_bytes

logger = logging.getLogger(__name__)

WALL_FACTOR = 20.0  # wall-clock guard per solve, as a multiple of its deterministic limit
BOUND_SHARE = 0.75  # of the time limit, at most, for the relaxation while no plan fits
GAP_LIMIT = 0.01  # stop once the plan is proven within this fraction of the optimum
# Overflowing backward steps made exact per relaxation round: few keep each round cheap
# (see docs/solver-notes.md, "Adopted": two points per round).
POINTS_PER_ROUND = 2
# The first relaxation round stops at this share of the limit (on graphs up to
# FIRST_ROUND_CAP_NODES), so that an overflowing answer gets its exact points while time
# is left (see docs/solver-notes.md, "Adopted": first relaxation round capped).
FIRST_ROUND_SHARE = 1 / 3
FIRST_ROUND_CAP_NODES = 5_000
# The exact model's deterministic time undercounts its work: it is charged this many
# times over (see docs/solver-notes.md, "Adopted": exact model charged 8-fold).
EXACT_WEIGHT = 8.0
# Below this many deterministic seconds the exact model finds nothing, yet its presolve
# costs seconds: not run (see docs/solver-notes.md, "Adopted": no exact model below 0.1).
MIN_EXACT = 0.1
# Solves spent, when a budget is refused, on the lowest budget that fits (what the refusal
# names, whatever the budget asked): one just below the greedy's minimum, one at the peak
# of the plan found there (a retry fits a budget only where a solve under it did); each
# starts from no plan, the slow case (docs/solver-notes.md, "Adopted": two probes down).
PROBES = 2


# The default limit: DEFAULT_LIMIT deterministic seconds, or one per NODES_PER_LIMIT_SECOND
# nodes where that is more (beyond 4,000 nodes), so that a large graph's relaxation gets
# past its presolve to a bound (see docs/solver-notes.md, "Adopted": default limit).
DEFAULT_LIMIT = 2.0
NODES_PER_LIMIT_SECOND = 2_000
# Deterministic seconds the default limit grows by where the plan is still not proven
# within ``gap_limit``: real graphs whose first bound is loose close there (see
# docs/solver-notes.md, "Adopted": more time where the gap is open).
EXTRA_LIMIT = 8.0


def default_time_limit(problem: Problem) -> float:
    """CP-SAT's limit when none is given: 2 deterministic s, ``len / 2,000`` on graphs
    beyond 4,000 nodes (10,000 nodes: 5)."""
    return max(DEFAULT_LIMIT, len(problem) / NODES_PER_LIMIT_SECOND)


def cpsat(
    problem: Problem,
    limit: int | None = None,
    *,
    time_limit: float | None = None,
    gap_limit: float = GAP_LIMIT,
    workers: int = 4,
    seed: int = 0,
    log: bool = False,
    probes: int = PROBES,
) -> Plan:
    """Minimum recompute cost under ``limit`` bytes, with a proven lower bound.

    ``time_limit`` is in CP-SAT deterministic seconds over all rounds (see the
    module docstring); by default ``default_time_limit(problem)``, and up to
    ``EXTRA_LIMIT`` more where the plan is not proven within ``gap_limit`` by then (see
    the module docstring; a given ``time_limit`` is the whole limit). The search stops
    earlier once the plan is proven within ``gap_limit`` of the optimum (``gap <=
    gap_limit``; 0 searches until optimal or out of time): a 1% better plan is rarely
    worth more seconds of planning.
    ``workers`` subsolvers take turns in the exact rounds (interleaved search, so still
    deterministic; they overrun a limit by up to a batch); the relaxation runs on one.
    Without a budget, the lowest peak the greedy reaches is the budget. Raises
    ``InfeasibleBudget`` when no plan fits; its ``minimum`` is the lowest budget this
    solver found a plan under in ``probes`` bisection steps between ``limit`` and the
    greedy's minimum (a retry at it succeeds: the solver is deterministic).
    """
    time_limit, extra = _time_limits(problem, time_limit)
    _check_options(time_limit, workers, gap_limit)
    start = time.perf_counter()
    first, limit, refusal = _greedy_start(problem, limit)
    search = _Search(problem, limit, first, workers, seed, log, gap_limit)
    relax = Relaxation(problem, limit, exact=False)
    seeded = _lp_start(search, relax, time_limit)
    # 1. the relaxation, made exact where its answers overflow, then 2. the exact model.
    #    With the greedy's plan in hand the relaxation may take the whole limit and the
    #    exact model's work is charged EXACT_WEIGHT-fold; without one, the relaxation
    #    leaves the exact model a share, in full even if a repaired relaxation answer
    #    fits (such a repair can cost more than the model's plan: docs/solver-notes.md,
    #    "Adopted").
    capped = not seeded and len(problem) <= FIRST_ROUND_CAP_NODES
    share, weight = (1.0, EXACT_WEIGHT) if first is not None else (BOUND_SHARE, 1.0)
    _relaxation_then_exact(search, relax, time_limit, time_limit * share, weight, capped)
    # 3. by default, more time where the plan is not proven within ``gap_limit``: the
    #    relaxation goes on from its points, then the exact model from the best plan.
    if extra and search.gap_open:
        _relaxation_then_exact(search, relax, extra, extra, weight, capped=False)
    best = search.final()
    if best is None:
        retry = functools.partial(
            cpsat, problem, time_limit=time_limit, gap_limit=gap_limit, workers=workers,
            seed=seed, log=log, probes=0,
        )  # fmt: skip
        raise _refusal(problem, limit, refusal, search.proven, retry, probes, start)
    seconds = time.perf_counter() - start
    return with_bound(
        best, search.bound, solver="cpsat", limit=limit, seconds=seconds, proven=search.proven
    )


def _time_limits(problem: Problem, time_limit: float | None) -> tuple[float, float]:
    """The search's limit and the extra it may take where its gap stays open: only the
    default limit grows (a given one is the whole limit)."""
    if time_limit is None:
        return default_time_limit(problem), EXTRA_LIMIT
    return time_limit, 0.0


def _check_options(time_limit: float, workers: int, gap_limit: float) -> None:
    """``ValueError`` for options no search can run with."""
    if time_limit <= 0:
        raise ValueError(f"time_limit must be positive, got {time_limit}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if not 0 <= gap_limit < 1:
        raise ValueError(f"gap_limit must be in [0, 1), got {gap_limit}")


def _greedy_start(
    problem: Problem, limit: int | None
) -> tuple[Plan | None, int, InfeasibleBudget | None]:
    """The search's first incumbent: the greedy's plan, polished by ``fill``; the limit
    (without one, the greedy's lowest peak); or, where the greedy finds no plan, its
    refusal, kept for the error (CP-SAT may still find a plan the greedy cannot)."""
    try:
        first = greedy(problem, limit)
    except InfeasibleBudget as refusal:
        return None, limit, refusal
    limit = first.peak if limit is None else limit
    return fill(problem, first, limit), limit, None


def _lp_start(search: _Search, relax: Relaxation, time_limit: float) -> bool:
    """The relaxation's LP, from an LP solver (not charged to the limit): a proven bound
    in seconds, where CP-SAT's own first one comes after its presolve (most of the time
    on large graphs); where it proves the incumbent within ``gap_limit``, there is
    nothing left to search for. Else its answer rounded, repaired and polished is a
    candidate, and where that answer overflows in the backward its steps are made exact
    before the first round. Returns whether any were: that round then needs no cap."""
    lp = solve_lp(relax.model, WALL_FACTOR * time_limit)
    if lp is None:
        return False
    search.bound = lp.bound / relax.scale
    if search.close_enough:
        return False
    rounded = evaluate(search.problem, relax.saved_set(lp.value), solver="cpsat")
    search.offer(search.repair(rounded), polished=True)
    return add_points(relax, rounded, POINTS_PER_ROUND) > 0  # none where it fits


def _relaxation_then_exact(
    search: _Search,
    relax: Relaxation,
    seconds: float,
    relaxation_seconds: float,
    weight: float,
    capped: bool,
) -> None:
    """The relaxation's rounds for up to ``relaxation_seconds`` (each optimum bounds
    every plan's cost, each answer repaired is a candidate), then the exact model,
    hinted with the best plan so far, on the rest of ``seconds`` charged ``weight``-fold
    (not run below ``MIN_EXACT``, where it would find nothing, unless no plan fits yet)."""
    used = 0.0 if search.close_enough else search.bound_round(relax, relaxation_seconds, capped)
    exact_seconds = (seconds - used) / weight
    if exact_seconds >= MIN_EXACT or search.best is None:
        search.exact_rounds(exact_seconds)


def _refusal(
    problem: Problem,
    limit: int,
    greedy_refusal: InfeasibleBudget,
    proven: bool,
    retry,
    probes: int,
    start: float,
) -> InfeasibleBudget:
    """The error for a ``limit`` no plan was found under, naming the lowest budget found
    to fit whatever ``limit`` was: the greedy's minimum, pushed down by ``probes`` solves
    below it (``_lowest_below``; none where ``limit`` is just below it: that solve ran).
    The probes take as long as the solve did, or longer: the log says so first."""
    fitting = greedy_refusal.minimum
    if limit == fitting - 1:  # the probe's question, answered by this solve
        return _infeasible(problem, greedy_refusal, fitting, proven)
    if probes:
        logger.info(
            "remat %s: no plan fits %s (%s CP-SAT in %.1fs); up to %d more solve%s below "
            "the greedy's lowest peak %s, to name the lowest budget that fits",
            problem.name or "graph",
            format_bytes(limit),
            "proven by" if proven else "none found by",
            time.perf_counter() - start,
            probes,
            "s" if probes > 1 else "",
            format_bytes(fitting),
        )
    minimum, lowest_proven = _lowest_below(fitting, retry, probes)
    return _infeasible(problem, greedy_refusal, minimum, proven, lowest_proven)


def _infeasible(
    problem: Problem,
    greedy_refusal: InfeasibleBudget,
    minimum: int,
    proven: bool,
    lowest_proven: bool = False,
) -> InfeasibleBudget:
    g = greedy_refusal
    proven_at_minimum = lowest_proven or (proven and g.limit == minimum - 1)
    return InfeasibleBudget(
        g.limit, minimum, g.store_all, problem.name, proven, lowest_proven=proven_at_minimum
    )


def _lowest_below(fitting: int, solve, probes: int) -> tuple[int, bool]:
    """The lowest budget ``solve(budget)`` fits in ``probes`` calls, going down from
    ``fitting`` (one it fits): each call just below the last budget that fit, or at the
    peak of the plan found there where that is lower. And whether it is proven the lowest:
    the solve one byte below it proved that nothing fits there."""
    target = fitting - 1
    for _ in range(probes):
        if target < 1:
            break
        try:
            found = solve(target)
        except InfeasibleBudget as refusal:
            return fitting, refusal.proven and target == fitting - 1
        fitting = target
        target = found.peak if found.peak < target else target - 1
    return fitting, False


class _Search:
    """The incumbent (cheapest plan that fits, by the simulator) and the proven bound."""

    def __init__(self, problem, limit, best, workers, seed, log, gap_limit) -> None:
        self.problem, self.limit, self.best = problem, limit, best
        self.workers, self.seed, self.log, self.gap_limit = workers, seed, log, gap_limit
        self.bound, self.proven = 0.0, False
        self.polished = best is not None  # ``best`` went through ``fill`` already

    @property
    def gap_open(self) -> bool:
        """There is a plan, not proven within ``gap_limit`` of the optimum yet."""
        return self.best is not None and not self.proven and not self.close_enough

    @property
    def close_enough(self) -> bool:
        """The incumbent is proven within ``gap_limit`` of the optimum."""
        if self.best is None or self.gap_limit <= 0:
            return False
        return self.best.cost - self.bound <= self.gap_limit * self.best.cost

    def final(self) -> Plan | None:
        """The incumbent as returned: polished by ``fill`` unless proven optimal, then a
        last pass by seconds per byte saves back the tiny tensors the costliest-first
        order gives up before; only here, where it cannot change the search's hint (see
        docs/solver-notes.md, "Adopted": a last fill by recompute seconds per byte)."""
        best = self.best
        if best is None or self.proven:
            return best
        if not self.polished:
            best = fill(self.problem, best, self.limit)
        return fill(self.problem, best, self.limit, order="per_byte")

    def offer(self, plan: Plan, polished: bool = False) -> None:
        if plan.peak <= self.limit and (self.best is None or _key(plan) < _key(self.best)):
            self.best, self.polished = plan, polished

    def repair(self, plan: Plan) -> Plan:
        """An overflowing answer pushed under the limit (``heuristics.repaired``)."""
        return repaired(self.problem, plan, self.limit)

    def solve(self, relax: Relaxation, seconds: float, gap_limit: float = 0.0):
        """One CP-SAT solve: (status, its answer simulated or None, deterministic time).

        CP-SAT reports OPTIMAL also when it stopped at ``relative_gap_limit``; the status
        returned here is OPTIMAL only when its bound met its objective."""
        if self.best is not None:
            relax.hint(self.best)
        if relax.exact:
            solver = _solver(seconds, self.workers, self.seed, self.log, gap_limit)
        else:  # one worker at the LP's full strength: see ``_relaxation_solver``
            solver = _relaxation_solver(seconds, self.seed, self.log)
            self._stop_when_close_enough(solver, relax.scale)
        status = solver.Solve(relax.model)
        answer = None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            self.bound = max(self.bound, solver.BestObjectiveBound() / relax.scale)
            answer = evaluate(self.problem, relax.saved_set(solver.Value), solver="cpsat")
            self.offer(answer)
            if solver.BestObjectiveBound() < solver.ObjectiveValue():
                status = cp_model.FEASIBLE  # stopped at the gap limit, not proven
        return status, answer, solver.ResponseProto().deterministic_time

    def _stop_when_close_enough(self, solver: cp_model.CpSolver, scale: float) -> None:
        """Stop the relaxation once its bound proves the incumbent within ``gap_limit``:
        its own search would go on to its optimum, which the incumbent no longer needs
        (see docs/solver-notes.md, "Adopted": stop inside CP-SAT). With one worker the
        callback runs in the search's thread, so where it stops is deterministic; not so
        with interleaved workers, hence the relaxation only."""
        if self.best is None or self.gap_limit <= 0:
            return
        enough = (1 - self.gap_limit) * self.best.cost * scale

        def on_bound(bound: float) -> None:
            if bound >= enough:
                solver.stop_search()

        solver.best_bound_callback = on_bound

    def bound_round(self, relax: Relaxation, seconds: float, capped: bool) -> float:
        """Solve the relaxation; while its answer overflows, make the overflowing backward
        steps exact (or cut the forward's overflow) and solve again. Every answer's
        optimum is a bound (the cuts hold for every plan); an answer that fits is the
        optimum. The first round stops at ``FIRST_ROUND_SHARE`` of the time if
        ``capped``, and runs again uncapped if that left no overflow to point at.
        Returns the deterministic time used."""
        spent = 0.0
        while seconds - spent > 0.01:
            cap = seconds * FIRST_ROUND_SHARE if capped else seconds
            status, answer, used = self.solve(relax, min(seconds - spent, cap))
            spent += used
            if capped and _nothing_to_point_at(status, answer, self.limit):
                capped = False  # the cut-short round's answer fits or is missing: go on
                continue
            capped = False
            if answer is None:
                # out of time, or not even the relaxation fits: then no plan does
                self.proven = status == cp_model.INFEASIBLE and self.best is None
                return spent
            if answer.peak <= self.limit:
                if status == cp_model.OPTIMAL:
                    self.proven = True  # nothing is cheaper, and it fits
                    self.bound = max(self.bound, answer.cost)
                return spent
            if not self.close_enough:  # else a repair could save under gap_limit
                self.offer(self.repair(answer), polished=True)
            if self.close_enough:
                return spent
            _tighten(relax, answer)
        return spent

    def exact_rounds(self, seconds: float) -> None:
        """Solve, simulate, cut what overflowed (only the forward is relaxed), repeat.
        The model is built only if a round runs: building it alone takes seconds on large
        graphs."""
        relax = None
        while seconds > 0.01 and not self.proven and not self.close_enough:
            if relax is None:
                relax = Relaxation(self.problem, self.limit)
            status, answer, used = self.solve(relax, seconds, self.gap_limit)
            seconds -= used
            if status == cp_model.INFEASIBLE:
                # every plan fitting the budget satisfies the model and its cuts
                self.proven = True
                if self.best is not None:
                    self.bound = self.best.cost
                return
            if answer is None:
                return  # out of time before any solution
            if answer.peak <= self.limit:
                if status == cp_model.OPTIMAL:
                    self.proven = True
                    self.bound = max(self.bound, answer.cost)
                return
            _cut(relax, answer)
            self.offer(self.repair(answer), polished=True)


def _nothing_to_point_at(status, answer: Plan | None, limit: int) -> bool:
    """A relaxation round ended without proof and without an overflowing answer (no
    answer, or one that fits): no exact point to add, so cutting it short gained nothing."""
    if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
        return False
    return answer is None or answer.peak <= limit


def _tighten(relax: Relaxation, plan: Plan) -> None:
    """Cut off an overflowing answer: the backward steps where it overflows made exact
    (the worst ``POINTS_PER_ROUND`` not exact yet) and its forward overflow forbidden
    (``explain``); failing both, that exact saved set."""
    _cut(relax, plan, weakest=not add_points(relax, plan, POINTS_PER_ROUND))


def _cut(relax: Relaxation, plan: Plan, *, weakest: bool = True) -> None:
    """Forbid the answer's forward overflow (``explain``); failing that, and if
    ``weakest``, its exact saved set."""
    literals = explain(relax, plan)
    if literals is not None:
        forbid(relax, literals)
    elif weakest:
        forbid_saved_set(relax, plan.saved)


def _key(plan: Plan) -> tuple:
    """Cheapest, then lowest peak, then the saved set itself: a total order, so the
    choice never depends on the order plans arrive in."""
    return (plan.cost, plan.peak, sorted(plan.saved))


def _solver(
    seconds: float, workers: int, seed: int, log: bool, gap_limit: float = 0.0
) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_deterministic_time = seconds
    params.max_time_in_seconds = WALL_FACTOR * seconds + 1.0  # the guard, see module doc
    params.num_workers = workers
    params.interleave_search = workers > 1
    params.random_seed = seed
    params.relative_gap_limit = gap_limit  # of its own model; ours is checked after
    params.log_search_progress = log
    return solver


def _relaxation_solver(seconds: float, seed: int, log: bool) -> cp_model.CpSolver:
    """One worker with CP-SAT's strongest LP (``linearization_level=2``, its ``max_lp``
    subsolver): on the relaxation it is the worker that proves the optimum, and alone it
    keeps to the limit, where interleaved workers run their whole batch first
    (see docs/solver-notes.md, "Adopted": relaxation on one max-LP worker)."""
    solver = _solver(seconds, 1, seed, log)
    solver.parameters.linearization_level = 2
    # layers repeat (see docs/solver-notes.md, "Adopted": use_symmetry_in_lp)
    solver.parameters.use_symmetry_in_lp = True
    return solver
