"""A solver's answer: what to save, what it costs, and how sure the solver is."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .problem import Problem
from .schedule import Schedule, schedule
from .simulate import Timeline, simulate
from .units import format_bytes


@dataclass(frozen=True)
class Plan:
    """Saved and recomputed forward values, with the schedule and timeline they imply.
    A plan whose backward's order was given (``ordered``: the chain schedules, which
    may recompute a value more than once, ``multiple``) is determined by
    ``schedule.backward``; any other by ``saved``.

    ``cost`` (what solvers minimise) is the step's extra time: ``recompute_cost``, the
    seconds of what the backward runs again, plus ``save_cost``, the seconds of keeping
    the saved storages (``Node.save_cost``; 0 where the cost model charges none).
    ``status`` is ``"optimal"`` when the solver proved no cheaper plan meets
    the budget, ``"feasible"`` when it stopped with a proven ``bound`` on the
    cost, and ``"heuristic"`` when there is no bound at all.
    """

    saved: frozenset[int]
    recomputed: frozenset[int]
    peak: int
    recompute_cost: float
    solver: str
    status: str
    limit: int | None
    schedule: Schedule
    timeline: Timeline
    bound: float | None = None
    solve_seconds: float = 0.0
    ordered: bool = False  # the backward's order was given, not derived from ``saved``
    save_cost: float = 0.0

    @property
    def cost(self) -> float:
        """Recompute plus save seconds: the step time the plan adds."""
        return self.recompute_cost + self.save_cost

    @property
    def multiple(self) -> bool:
        """Whether the backward recomputes some value more than once."""
        order = self.schedule.backward
        return len(set(order)) < len(order)

    @property
    def gap(self) -> float | None:
        """(cost - bound) / cost, 0 when proven optimal, None without a bound."""
        if self.bound is None:
            return None
        if self.cost <= 0:
            return 0.0
        return max(0.0, (self.cost - self.bound) / self.cost)

    def __str__(self) -> str:
        gap = "" if self.gap is None else f", gap {self.gap:.1%}"
        return (
            f"Plan({self.solver}, {self.status}{gap}: save {len(self.saved)}, "
            f"recompute {len(self.recomputed)}, peak {format_bytes(self.peak)}, "
            f"recompute cost {self.recompute_cost:.3g}{self._save_text()})"
        )


    def _save_text(self) -> str:
        return f", save cost {self.save_cost:.3g}" if self.save_cost else ""


def evaluate(
    problem: Problem,
    saved: Iterable[int],
    *,
    solver: str,
    status: str = "heuristic",
    limit: int | None = None,
    bound: float | None = None,
    solve_seconds: float = 0.0,
    backward: Sequence[int] | None = None,
) -> Plan:
    """Schedule and simulate ``saved`` (or the ``backward`` order a chain schedule
    gives): the only way a Plan is made."""
    sched = schedule(problem, saved, backward)
    timeline = simulate(problem, sched)
    return Plan(
        saved=sched.saved,
        recomputed=sched.recomputed,
        peak=timeline.peak,
        recompute_cost=sched.recompute_cost,
        solver=solver,
        status=status,
        limit=limit,
        schedule=sched,
        timeline=timeline,
        bound=bound,
        solve_seconds=solve_seconds,
        ordered=backward is not None,
        save_cost=save_cost(problem, sched.saved),
    )


def with_bound(
    plan: Plan, bound: float, *, solver: str, limit: int, seconds: float, proven: bool = False
) -> Plan:
    """``plan`` as a solver that proved ``bound`` (a lower bound on every plan's cost) returns
    it: the bound capped at the plan's cost; ``optimal`` where ``proven`` or the bound meets
    the cost (to rounding), else ``feasible``."""
    bound = min(bound, plan.cost)
    closed = proven or plan.cost - bound <= 1e-9 * max(1.0, bound)
    return replace(
        plan,
        solver=solver,
        status="optimal" if closed else "feasible",
        limit=limit,
        bound=bound,
        solve_seconds=seconds,
    )


def held_bytes(problem: Problem, plan: Plan) -> int:
    """Bytes a graph leaves allocated while later graphs of the step run (graph breaks):
    the storages it saves and those of its outputs (the caller holds them, conservatively,
    until the step ends), each storage once."""
    return _storage_bytes(problem, (*plan.saved, *problem.outputs))


def saved_bytes(problem: Problem, plan: Plan) -> int:
    """Bytes the forward hands to the backward: storages of the saved values."""
    return _storage_bytes(problem, plan.saved)


def step_seconds(problem: Problem, plan: Plan) -> float:
    """The step's estimated time under ``plan``: every node once, plus the plan's cost."""
    return sum(n.cost for n in problem.nodes) + plan.cost


def save_cost(problem: Problem, saved: Iterable[int]) -> float:
    """Seconds of keeping ``saved``'s storages for the backward, each storage once; those
    of the outputs are kept for the caller anyway and cost nothing more."""
    storage, nodes = problem.storage, problem.nodes
    held = {storage[i] for i in problem.outputs}
    return sum(nodes[r].save_cost for r in {storage[i] for i in saved} - held)


def _storage_bytes(problem: Problem, values) -> int:
    """Bytes of the storages ``values`` live in, each storage once."""
    roots = {problem.storage[i] for i in values}
    return sum(problem.nodes[r].bytes for r in roots)
