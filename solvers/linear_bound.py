"""A lower bound from a CP-SAT model's linear relaxation, solved by an LP solver.

CP-SAT proves its first bound only after its presolve and its search around the hint:
on large graphs most of ``cpsat``'s time, for a bound that an LP solver (HiGHS, bundled
with OR-Tools) finds on the same model in seconds (see docs/solver-notes.md, "Adopted":
the relaxation's LP from HiGHS first). Where the greedy's plan is already that close to
the bound, the search has nothing left to prove.

The LP is the model with integrality dropped: each linear constraint as it is, each
enforced one relaxed by big-M (from the bounds of its variables), Boolean clauses as
sums. It is no stronger than CP-SAT's own root LP (which adds cuts); it is earlier.

``solve_mip`` keeps the model's Booleans integral and hands it to HiGHS's MIP solver
(``highspy``, the ``prove`` extra: OR-Tools bundles an older HiGHS): far stronger where
the optimum trades whole values, far slower (``proof.prove``).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.sat import cp_model_pb2

from .errors import RematError

logger = logging.getLogger(__name__)

# The first of these OR-Tools was built with solves the LP: fastest first, GLOP last (it
# gives up on byte-sized coefficients; see docs/solver-notes.md, "Adopted").
LP_SOLVERS = ("HIGHS_LP", "CLP", "GLOP")
INT_MAX = 2**63 - 1  # CP-SAT's infinite domain ends
INF = float("inf")
# The LP's optimum is met to the solver's tolerances; the bound gives up this share of
# it so that rounding cannot lift it over the true optimum.
SAFETY = 1e-6


@dataclass(frozen=True)
class LinearSolution:
    """The LP's optimum (``bound``: in the units CP-SAT reports the model's objective in,
    a little under the LP's, so a valid lower bound on the integer optimum) and its
    values, by CP-SAT variable index; ``program``, the LP it solved, made of the model's
    first ``converted`` constraints (for ``solve_lp``'s ``after``)."""

    bound: float
    values: tuple[float, ...]
    program: linear_solver_pb2.MPModelProto = field(repr=False, compare=False)
    converted: int = 0

    def value(self, var) -> float:
        """A CP-SAT variable's value in the LP's answer (fractional in general)."""
        return self.values[var.Index()]


def solve_lp(model, seconds: float, after: LinearSolution | None = None) -> LinearSolution | None:
    """``model``'s LP relaxation solved, or None where no LP solver is available, it
    did not finish within ``seconds`` of wall time, or the objective is not linear.
    ``after``: an earlier solution of ``model`` before variables and constraints were
    added (and none changed); only what was added is converted."""
    proto = _message(model)
    lp = _linear_program(proto, after)
    if lp is None:
        return None
    name, solver = _lp_solver()
    if solver is None:
        return None
    error = solver.LoadModelFromProto(lp)
    if error:
        logger.debug("LP bound: model not loaded (%s)", error)
        return None
    if name == "HIGHS_LP":
        solver.SetSolverSpecificParametersAsString("output_flag=false")  # else a banner
    solver.SetTimeLimit(max(1, int(seconds * 1000)))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    value = solver.Objective().Value()
    return LinearSolution(
        bound=value - SAFETY * abs(value),
        values=tuple(var.solution_value() for var in solver.variables()),
        program=lp,
        converted=len(proto.constraints),
    )


@dataclass(frozen=True)
class MipSolution:
    """HiGHS's MIP solve: ``bound``, its dual bound (a valid lower bound, in CP-SAT's
    units, a little under HiGHS's); ``values``, its best answer by CP-SAT variable index
    (empty where it found none); ``closed``, whether it proved that answer optimal."""

    bound: float
    values: tuple[float, ...]
    closed: bool

    def value(self, var) -> float:
        return self.values[var.Index()]


def solve_mip(model, seconds: float) -> MipSolution | None:
    """``model``'s linear form (as ``solve_lp``'s) with every Boolean integral, solved by
    HiGHS's MIP solver for at most ``seconds`` of wall time (its dual bound is a bound
    whether or not it closed the gap), or None where it proved no bound (stopped before
    its root LP, or the objective is not linear). Needs ``highspy`` (the ``prove``
    extra)."""
    try:
        import highspy
    except ImportError:
        raise RematError(
            "a MIP bound needs highspy (HiGHS 1.16 or later): install the 'prove' extra "
            "(pip install -e '.[prove]' or pip install highspy)"
        ) from None
    proto = _message(model)
    lp = _linear_program(proto)
    if lp is None:
        return None
    highs = _silent_highs(highspy)
    highs.setOptionValue("time_limit", float(seconds))
    _load_highs(highs, lp)
    booleans = [i for i, v in enumerate(proto.variables) if list(v.domain) == [0, 1]]
    kinds = [highspy.HighsVarType.kInteger] * len(booleans)
    highs.changeColsIntegrality(len(booleans), np.array(booleans, dtype=np.int32), np.array(kinds))
    highs.run()
    info = highs.getInfo()
    if not math.isfinite(info.mip_dual_bound):  # no root LP yet (-inf), or infeasible (+inf)
        return None
    bound = info.mip_dual_bound + lp.objective_offset
    found = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    return MipSolution(
        bound=bound - SAFETY * abs(bound),
        values=tuple(highs.getSolution().col_value) if found else (),
        closed=highs.getModelStatus() == highspy.HighsModelStatus.kOptimal,
    )


def _silent_highs(highspy):
    """A ``highspy.Highs`` that prints nothing: its first construction in a process
    writes a banner to file descriptor 1 (from C, before any option can be set)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    highs.setOptionValue("output_flag", False)
    return highs


def _load_highs(highs, lp: linear_solver_pb2.MPModelProto) -> None:
    """``lp``'s columns and rows into an empty ``highspy.Highs``."""
    columns, rows = lp.variable, lp.constraint
    highs.addCols(
        len(columns),
        np.array([c.objective_coefficient for c in columns], dtype=float),
        np.array([c.lower_bound for c in columns], dtype=float),
        np.array([c.upper_bound for c in columns], dtype=float),
        0,
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0),
    )
    starts = np.cumsum([0] + [len(r.var_index) for r in rows])[:-1].astype(np.int32)
    index = np.fromiter((i for r in rows for i in r.var_index), dtype=np.int32)
    value = np.fromiter((c for r in rows for c in r.coefficient), dtype=float)
    highs.addRows(
        len(rows),
        np.array([r.lower_bound for r in rows], dtype=float),
        np.array([r.upper_bound for r in rows], dtype=float),
        len(index),
        starts,
        index,
        value,
    )


def _lp_solver() -> tuple[str, pywraplp.Solver | None]:
    for name in LP_SOLVERS:
        if solver := pywraplp.Solver.CreateSolver(name):
            return name, solver
    return "", None


def _message(model) -> cp_model_pb2.CpModelProto:
    """The model as a protobuf message: through a file, far faster than reading OR-Tools'
    own wrapper of it field by field from Python (see docs/solver-notes.md, "Adopted")."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.pb")
        if not model.ExportToFile(path):
            raise RuntimeError("CP-SAT could not export the model")
        with open(path, "rb") as f:
            return cp_model_pb2.CpModelProto.FromString(f.read())


def _linear_program(
    proto, earlier: LinearSolution | None = None
) -> linear_solver_pb2.MPModelProto | None:
    """``proto`` (a CP-SAT model) with integrality dropped. A constraint of another kind
    is left out (fewer constraints: still a lower bound); None for a floating-point
    objective. ``earlier``: a solution of this model before variables and constraints
    were added; its program is extended (a copy) instead of converting all again."""
    if proto.HasField("floating_point_objective"):
        return None
    lp = linear_solver_pb2.MPModelProto()
    first_variable = first_constraint = 0
    if earlier is not None:
        lp.CopyFrom(earlier.program)
        first_variable, first_constraint = len(lp.variable), earlier.converted
        for column in lp.variable:  # the objective is set again below
            column.objective_coefficient = 0.0
        lp.objective_offset = 0.0
    bounds = [(column.lower_bound, column.upper_bound) for column in lp.variable]
    for index in range(first_variable, len(proto.variables)):
        domain = proto.variables[index].domain
        low, high = _float_bound(domain[0]), _float_bound(domain[-1])  # holes relaxed
        column = lp.variable.add()
        column.lower_bound, column.upper_bound = low, high
        bounds.append((low, high))
    left_out = 0
    for index in range(first_constraint, len(proto.constraints)):
        ct = proto.constraints[index]
        rows = _rows(ct)
        if rows is None:
            left_out += 1
            continue
        enforcement = list(ct.enforcement_literal)
        for terms, low, high in rows:
            _add_enforced(lp, terms, low, high, enforcement, bounds)
    if left_out:
        logger.debug("LP bound: %d constraints of other kinds left out", left_out)
    objective = proto.objective
    scale = objective.scaling_factor or 1.0
    if any(ref < 0 for ref in objective.vars):
        return None  # negated references: CP-SAT's Python layer does not emit them
    for var, coeff in zip(objective.vars, objective.coeffs, strict=True):
        lp.variable[var].objective_coefficient += scale * coeff
    lp.objective_offset += scale * objective.offset
    return lp


def _rows(ct) -> list[tuple[dict[int, float], float | None, float | None]] | None:
    """The constraint as ``(terms, low, high)`` rows (``None``: no such side), or None
    for a kind this does not linearise (or negated references in a linear one, which
    CP-SAT's Python layer does not emit)."""
    kind = ct.WhichOneof("constraint")
    if kind == "linear":
        if any(ref < 0 for ref in ct.linear.vars):
            return None
        terms: dict[int, float] = {}
        for var, coeff in zip(ct.linear.vars, ct.linear.coeffs, strict=True):
            if coeff:  # a zero times an infinite bound would be NaN in the big-M
                terms[var] = terms.get(var, 0) + coeff
        domain = ct.linear.domain
        low, high = _float_bound(domain[0]), _float_bound(domain[-1])
        return [(terms, None if low == -INF else low, None if high == INF else high)]
    if kind == "bool_or":
        return [_literal_sum(ct.bool_or.literals, low=1)]
    if kind == "bool_and":
        return [_literal_sum([ref], low=1) for ref in ct.bool_and.literals]
    if kind == "at_most_one":
        return [_literal_sum(ct.at_most_one.literals, high=1)]
    if kind == "exactly_one":
        return [_literal_sum(ct.exactly_one.literals, low=1, high=1)]
    return None


def _literal_sum(literals, low=None, high=None):
    """``low <= sum(literals) <= high`` as a row: a negated literal is ``1 - x``."""
    terms: dict[int, float] = {}
    negated = 0
    for ref in literals:
        var, sign = _var(ref)
        terms[var] = terms.get(var, 0) + sign
        negated += sign < 0
    return terms, None if low is None else low - negated, None if high is None else high - negated


def _add_enforced(lp, terms, low, high, enforcement: list[int], bounds) -> None:
    """``low <= terms <= high`` where every enforcement literal holds: each side moved
    by its big-M (how far the terms can reach past it) for each literal that is false."""
    reach_low = sum(c * bounds[v][0 if c > 0 else 1] for v, c in terms.items())
    reach_high = sum(c * bounds[v][1 if c > 0 else 0] for v, c in terms.items())
    for sign, value, reach in ((1, low, reach_low), (-1, high, reach_high)):
        if value is None or sign * (value - reach) <= 0:
            continue  # no such side, or the terms cannot cross it
        big_m = sign * (value - reach)
        if enforcement and big_m == INF:
            continue  # unbounded terms: no big-M, the side is left out
        row_terms, bound = dict(terms), value
        # sign * (terms - value) >= -big_m * (literals false), with a false literal
        # 1 - x for x, and x for not x
        for ref in enforcement:
            var, positive = _var(ref)
            row_terms[var] = row_terms.get(var, 0) - sign * positive * big_m
            bound -= sign * big_m * (positive > 0)
        row = lp.constraint.add()
        row.lower_bound, row.upper_bound = (bound, INF) if sign > 0 else (-INF, bound)
        row.var_index.extend(row_terms)
        row.coefficient.extend(row_terms.values())


def _var(ref: int) -> tuple[int, int]:
    """A CP-SAT reference as (variable, +1 or -1 where negated)."""
    return (ref, 1) if ref >= 0 else (-ref - 1, -1)


def _float_bound(value: int) -> float:
    """A CP-SAT domain end as an LP bound: its infinite ends as infinities."""
    return INF if value >= INT_MAX else -INF if value <= -INT_MAX else value
