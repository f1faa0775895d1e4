"""The one function that turns a choice of saved values into programs.

A plan is decided by which forward values the forward hands to the backward
(``saved``). Everything else follows here, and nowhere else, so the solver,
the simulator and the graph rewrite all see the same programs:

- the backward runs the backward nodes the gradients need, in problem order;
- a forward value the backward reads that is not saved is recomputed, placed
  just before its first reader, after the values it is computed from;
- a value that may not be recomputed (random, side effects) is saved, and so
  is one whose storage stays allocated anyway (a caller-held output, the base
  of a saved view);
- the forward runs what its outputs and the saved values need.

A plan may instead give the backward's order itself (``backward``), where a forward
value may be recomputed more than once, each copy read until the next one is made (the
chain schedules of ``solvers.chain``). Then the backward core must appear once each, in
problem order; what the backward reads before computing it is handed over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import RematError
from .graph import reachable
from .problem import Problem


@dataclass(frozen=True)
class Schedule:
    """Exact op order of both programs.

    ``backward`` holds backward nodes and the recomputed forward nodes (a forward
    node more than once where a plan gives the order: each run is a copy).
    ``recompute_cost`` counts the recomputes of nodes the forward also runs, and all
    but the first of the others: a forward value first computed in the backward costs
    nothing extra.
    """

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    saved: frozenset[int]
    recomputed: frozenset[int]
    recompute_cost: float


class InvalidPlan(RematError, ValueError):
    """A plan that cannot be realised, or is not what it claims (a solver bug, or a
    user's solver)."""


def schedule(
    problem: Problem, saved: Iterable[int], backward: Sequence[int] | None = None
) -> Schedule:
    """Build the forward and backward programs for ``saved``, or for the ``backward``
    order a plan gives (then ``saved`` adds to what that order reads before making).

    Saved values the backward never reads are dropped; values that must be
    saved are added. The result's ``saved`` is the set actually handed over.
    """
    nodes = problem.nodes
    requested = frozenset(saved)
    for i in requested:
        if not 0 <= i < len(nodes) or nodes[i].phase != "fwd":
            raise InvalidPlan(f"saved value {i} is not a forward node")
        if problem.outputs_of[i]:
            raise InvalidPlan(
                f"saved value {i} ({nodes[i].name}) is a multi-output op; save its outputs"
            )

    if backward is not None:
        return _given_order(problem, requested, tuple(backward))
    core, reads = problem.backward_core
    recomputed, saved_eff = _split_reads(problem, reads, requested)
    # A value whose storage stays allocated anyway (held by the caller, or the
    # base of a saved view) is handed over, never rebuilt into a second buffer.
    while free := _already_allocated(problem, recomputed, saved_eff):
        requested |= free
        recomputed, saved_eff = _split_reads(problem, reads, requested)
    backward = _place_recomputes(problem, core, recomputed)
    base, extra = problem.forward_base, _forward_extra(problem, saved_eff)
    forward = tuple(sorted(base | extra))
    cost = sum(nodes[i].cost for i in recomputed if i in base or i in extra)
    return Schedule(forward, backward, saved_eff, recomputed, cost)


def _given_order(problem: Problem, requested: frozenset[int], order: tuple[int, ...]) -> Schedule:
    """The schedule of a backward order a plan gives: checked, its hand-over derived."""
    nodes = problem.nodes
    core = problem.backward_core[0]
    if any(not 0 <= i < len(nodes) for i in order):
        raise InvalidPlan("the backward order names a node the problem does not have")
    if tuple(i for i in order if nodes[i].phase == "bwd") != core:
        raise InvalidPlan("the backward order must run the backward core once each, in order")
    fixed = [nodes[i].name for i in order if nodes[i].phase == "fwd" and not nodes[i].recomputable]
    if fixed:
        raise InvalidPlan(f"{fixed[0]} may not be recomputed, and the order recomputes it")
    handed = read_before_made(problem, order) | (requested - set(order))
    bad = [j for j in handed if problem.outputs_of[j]]
    if bad:
        raise InvalidPlan(
            f"{nodes[bad[0]].name} is a multi-output op the backward reads before making it"
        )
    saved = frozenset(handed)
    base, extra = problem.forward_base, _forward_extra(problem, saved)
    recomputes = [i for i in order if nodes[i].phase == "fwd"]
    cost, seen = 0.0, set()
    for i in recomputes:
        if i in base or i in extra or i in seen:
            cost += nodes[i].cost
        seen.add(i)
    forward = tuple(sorted(base | extra))
    return Schedule(forward, order, saved, frozenset(recomputes), cost)


def read_before_made(problem: Problem, order: Sequence[int]) -> set[int]:
    """The forward values a backward ``order`` reads (or returns as gradients) before it
    computes them: what the forward must hand over for it."""
    nodes = problem.nodes
    made: set[int] = set()
    handed: set[int] = set()
    for i in order:
        handed |= {j for j in nodes[i].inputs if nodes[j].phase == "fwd" and j not in made}
        made.add(i)
    return handed | {g for g in problem.grads if nodes[g].phase == "fwd" and g not in made}


def _backward_core(problem: Problem) -> tuple[list[int], list[int]]:
    """Backward nodes the gradients need (problem order), and forward values they read."""
    core, reads = problem.backward_core
    return list(core), list(reads)


def _split_reads(
    problem: Problem, reads: tuple[int, ...], requested: frozenset[int]
) -> tuple[frozenset[int], frozenset[int]]:
    """Walk back from what the backward reads: stop at saved values, recompute the rest."""
    nodes = problem.nodes
    recomputed: set[int] = set()
    saved: set[int] = set()
    stack = list(reads)
    while stack:
        i = stack.pop()
        if i in recomputed or i in saved:
            continue
        node = nodes[i]
        multi = bool(problem.outputs_of[i])
        if not multi and (i in requested or not node.recomputable):
            saved.add(i)
            continue
        if not node.recomputable:
            raise InvalidPlan(f"{node.name} may not be recomputed and cannot be saved")
        recomputed.add(i)
        stack.extend(node.inputs)
    return frozenset(recomputed), frozenset(saved)


def _already_allocated(
    problem: Problem, recomputed: frozenset[int], saved: frozenset[int]
) -> frozenset[int]:
    """Recomputed non-views whose own storage is live through the backward."""
    storage = problem.storage
    live = {storage[i] for i in (*problem.outputs, *saved)}
    return frozenset(
        i for i in recomputed if storage[i] == i and i in live and not problem.outputs_of[i]
    )


def _place_recomputes(
    problem: Problem, core: tuple[int, ...], recomputed: frozenset[int]
) -> tuple[int, ...]:
    """Backward order: each recompute in the gap before the first backward node that
    needs it (directly, or through recomputed consumers); each gap in problem order.

    Problem order is topological, and makes the order a function of the gaps alone,
    which is what lets the CP-SAT model encode it exactly. A multi-output op's
    recomputed outputs follow it at once, as they do in fx (``rank``). Forward values
    returned as gradients are needed last.
    """
    gap, rank = recompute_gaps(problem, recomputed), problem.rank
    order: list[int] = []
    done = 0  # core nodes placed so far
    for i in sorted(recomputed, key=lambda i: (gap[i], rank[i])):
        if gap[i] > done:
            order += core[done : gap[i]]
            done = gap[i]
        order.append(i)
    order += core[done:]
    return tuple(order)


def recompute_gaps(problem: Problem, recomputed: frozenset[int]) -> dict[int, int]:
    """For each recomputed value, the core position it is placed before (``len(core)``
    for the end): the first core node that reads it, or the gap of a recomputed
    consumer if earlier. Outputs of a multi-output op take the op's gap."""
    nodes, first = problem.nodes, problem.first_reads
    end = len(problem.backward_core[0])
    need = {i: first.get(i, end) for i in recomputed}
    for i in sorted(recomputed, reverse=True):  # consumers come later in problem order
        for j in nodes[i].inputs:
            if j in need and need[i] < need[j]:
                need[j] = need[i]
    return {i: need[nodes[i].output_of] if nodes[i].output_of in need else need[i] for i in need}


def _forward_extra(problem: Problem, saved: frozenset[int]) -> set[int]:
    """What the forward runs beyond ``forward_base`` to compute the saved values."""
    base = problem.forward_base
    return reachable(saved, problem.producers, base.__contains__)


def _forward_program(problem: Problem, saved: frozenset[int]) -> tuple[int, ...]:
    """The forward's order: what its outputs and the saved values need."""
    return tuple(sorted(problem.forward_base | _forward_extra(problem, saved)))
