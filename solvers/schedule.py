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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .problem import Problem


@dataclass(frozen=True)
class Schedule:
    """Exact op order of both programs.

    ``backward`` holds backward nodes and the recomputed forward nodes.
    ``recompute_cost`` counts only recomputed nodes the forward also runs:
    a forward value first computed in the backward costs nothing extra.
    """

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    saved: frozenset[int]
    recomputed: frozenset[int]
    recompute_cost: float


class InvalidPlan(ValueError):
    """A saved set that cannot be realised (a solver bug, or bad user input)."""


def schedule(problem: Problem, saved: Iterable[int]) -> Schedule:
    """Build the forward and backward programs for ``saved``.

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

    core, reads = _backward_core(problem)
    recomputed, saved_eff = _split_reads(problem, reads, requested)
    # A value whose storage stays allocated anyway (held by the caller, or the
    # base of a saved view) is handed over, never rebuilt into a second buffer.
    while free := _already_allocated(problem, recomputed, saved_eff):
        requested |= free
        recomputed, saved_eff = _split_reads(problem, reads, requested)
    backward = _place_recomputes(problem, core, recomputed, reads)
    forward = _forward_program(problem, saved_eff)
    in_forward = frozenset(forward)
    cost = sum(nodes[i].cost for i in recomputed if i in in_forward)
    return Schedule(forward, backward, saved_eff, recomputed, cost)


def _backward_core(problem: Problem) -> tuple[list[int], list[int]]:
    """Backward nodes the gradients need (problem order), and forward values they read."""
    nodes = problem.nodes
    needed: set[int] = set()
    reads: set[int] = set()
    stack = list(problem.grads)
    while stack:
        i = stack.pop()
        if nodes[i].phase == "fwd":
            reads.add(i)
            continue
        if i in needed:
            continue
        needed.add(i)
        stack.extend(nodes[i].inputs)
    return sorted(needed), sorted(reads)


def _split_reads(
    problem: Problem, reads: list[int], requested: frozenset[int]
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
    problem: Problem, core: list[int], recomputed: frozenset[int], reads: list[int]
) -> tuple[int, ...]:
    """Backward order: each recompute just before its first reader, inputs first.

    A multi-output op's recomputed outputs follow it at once, as they do in fx.
    Gradients that are forward values (no tangent dependence) go last.
    """
    nodes = problem.nodes
    order: list[int] = []
    placed: set[int] = set()

    def place(root: int) -> None:
        stack = [(root, False)]
        while stack:
            i, expanded = stack.pop()
            if i in placed:
                continue
            if expanded:
                placed.add(i)
                order.append(i)
                for part in problem.outputs_of[i]:
                    if part in recomputed and part not in placed:
                        placed.add(part)
                        order.append(part)
                continue
            stack.append((i, True))
            for j in reversed(nodes[i].inputs):
                if j in recomputed and j not in placed:
                    stack.append((j, False))

    for i in core:
        for j in nodes[i].inputs:
            if j in recomputed:
                place(j)
        placed.add(i)
        order.append(i)
    for i in reads:
        if i in recomputed:
            place(i)
    return tuple(order)


def _forward_program(problem: Problem, saved: frozenset[int]) -> tuple[int, ...]:
    nodes = problem.nodes
    needed: set[int] = set()
    stack = [*problem.outputs, *saved]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack.extend(nodes[i].inputs)
    return tuple(sorted(needed))
