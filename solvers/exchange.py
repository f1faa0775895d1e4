"""One costly save for a few cheap ones: the move between plans that ``fill`` and single
flips cannot make, where the cheapest plan differs from the one at hand by a knapsack's
exchange (docs/solver-notes.md, "Adopted": one costly save for cheap ones)."""

from __future__ import annotations

from .heuristics import savable
from .plan import Plan, evaluate
from .problem import Problem

# The saves tried as the one taken in, per round (the costliest kinds), and the rounds:
# each round a few dozen simulations, and the plans that gained needed few
# (see docs/solver-notes.md, "Adopted": one costly save for cheap ones).
EXCHANGE_ADDS = 8
EXCHANGE_ROUNDS = 8
EXCHANGE_TRIES = 4  # simulations of one exchange before it is given up
# Kinds simulated per round as saves (the costliest) and as drops (the least recompute
# seconds per byte): bounds a round where a graph has many kinds (deep models have tens).
EXCHANGE_KINDS = 64


def exchange(problem: Problem, plan: Plan, limit: int) -> Plan:
    """Save one more costly value in exchange for dropping cheaper ones, while that
    lowers the cost and the plan fits ``limit``.

    The integer side of a knapsack: a plan at the budget with room left for part of a
    large, costly save (an attention projection) is cheaper saving it and recomputing
    a few small, cheap values instead; ``fill`` cannot add it (it overflows) and no
    single swap frees enough. Each round simulates the costliest recomputed values as
    saves (one per kind: cost and bytes) and the saved values as drops (one per kind:
    the cost it adds, the bytes it frees at the peak); then, for each save, by what it
    gains: drops by cost per byte freed, members of a kind in node order, until they
    free its overflow for less than it gains, simulated; the first that fits and costs
    less is taken. At most ``EXCHANGE_ROUNDS`` rounds, so bounded and deterministic.
    """
    movable = savable(problem)
    for _ in range(EXCHANGE_ROUNDS):
        better = _exchanged(problem, plan, limit, movable)
        if better is None:
            break
        plan = better
    return plan


def _exchanged(problem: Problem, plan: Plan, limit: int, movable) -> Plan | None:
    """``exchange``'s round: a cheaper plan that fits, or None."""
    nodes, storage = problem.nodes, problem.storage

    def trial(saved) -> Plan:
        return evaluate(problem, saved, solver=plan.solver, status=plan.status)

    adds = []
    costliest = sorted(plan.recomputed & movable, key=lambda i: (-nodes[i].cost, i))
    for i in _one_per_kind(problem, costliest)[:EXCHANGE_KINDS]:
        if len(adds) == EXCHANGE_ADDS:
            break
        taken = trial(plan.saved | {i})
        if taken.cost < plan.cost:
            if taken.peak <= limit:
                return taken
            adds.append((taken.cost - plan.cost, taken.peak - limit, i))
    # drops, one simulation per kind for the cost each adds; the bytes each frees are
    # its storage's where that is live at the peak (values elsewhere free nothing there)
    live = plan.timeline.live_at_peak
    kinds: dict[tuple, list[int]] = {}
    for i in sorted(plan.saved & movable):
        if storage[i] in live and nodes[storage[i]].bytes and nodes[i].recomputable:
            kinds.setdefault(_kind(problem, i), []).append(i)
    drops = []  # (cost per byte, cost, bytes, the kind's members)
    cheapest = sorted(kinds.items(), key=lambda k: (k[0][0] / k[0][1], k[1][0]))
    for (_, size), members in cheapest[:EXCHANGE_KINDS]:
        added = trial(plan.saved - {members[0]}).cost - plan.cost
        drops.append((added / size, added, size, members))
    drops.sort(key=lambda d: (d[0], d[3][0]))
    queue = [(added, size, j) for _, added, size, members in drops for j in members]
    for gain, over, i in sorted(adds):
        taken = _made_room(plan, trial, queue, i, gain, over, limit)
        if taken is not None:
            return taken
    return None


def _made_room(plan: Plan, trial, queue: list, i: int, gain: float, over: int, limit: int):
    """``plan`` saving ``i`` (``gain``: its cost change, ``over``: its overflow) with
    drops from ``queue`` (cost, bytes freed, value; best first) until it fits, at most
    ``EXCHANGE_TRIES`` simulations, the drops it did not need saved back; None where no
    such plan is cheaper."""
    saved, dropped, spent, need, tries = set(plan.saved) | {i}, [], 0.0, over, 0
    for added, frees, j in queue:
        if j == i or spent + added >= -gain:
            continue
        saved.discard(j)
        dropped.append(j)
        spent, need = spent + added, need - frees
        if need > 0:
            continue
        taken, tries = trial(saved), tries + 1
        if taken.cost >= plan.cost:
            return None
        if taken.peak <= limit:
            for j in reversed(dropped):  # the estimates overshoot: give back what fits
                back = trial(taken.saved | {j})
                if back.peak <= limit and back.cost < taken.cost:
                    taken = back
            return taken
        if tries == EXCHANGE_TRIES:
            return None
        need = taken.peak - limit  # the simulator's word over the estimates'
    return None


def _kind(problem: Problem, i: int) -> tuple:
    """Values alike to a plan: the same recompute seconds and bytes."""
    return (problem.nodes[i].cost, problem.nodes[problem.storage[i]].bytes)


def _one_per_kind(problem: Problem, values: list[int]) -> list[int]:
    """The first of ``values`` of each ``_kind``, in order."""
    seen: set[tuple] = set()
    return [i for i in values if (k := _kind(problem, i)) not in seen and not seen.add(k)]
