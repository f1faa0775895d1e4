"""Fast solvers without optimality proofs: the two extremes and a peak-guided greedy.

Prior art: the greedy's choice, the storage live at the peak that frees the most bytes
per second of recompute, is the ratio DTR (Kirisame et al., ICLR 2021) evicts by at run
time (with staleness too); ``checkpoint_sweep`` is segment checkpointing (Chen et al.
2016) at every segment size.
"""

from __future__ import annotations

import time
from dataclasses import replace

from .errors import InfeasibleBudget, SolverOverBudget
from .graph import reachable
from .plan import Plan, evaluate, held_bytes
from .problem import Problem, without_free_views
from .units import format_bytes

# ``fill``'s simulations, and its failed trials in a row before it gives up: bounded, so
# deterministic and seconds at most (see docs/solver-notes.md, "Adopted": fill's caps)
FILL_TRIALS = 256
FILL_MISSES = 64
DESCEND_FLIPS = 32  # flips ``descend`` simulates per round
# Plateau moves ``descend`` makes in a row before it gives up: the runs that help need
# few, uncapped ones cost minutes on large graphs (see docs/solver-notes.md, "Adopted":
# descend crosses plateaus).
DESCEND_PLATEAU = 2
DROP_STEPS = 256  # ``_drop_saves`` frees at most 1/DROP_STEPS of the store-all peak per step
# The grown trajectory (``_grown``) runs on graphs up to this many nodes: beyond, it
# costs ten times the plain one, and the LP bound proves the plan anyway
# (see docs/solver-notes.md, "Adopted": the greedy's grown trajectory).
GROWN_MAX_NODES = 5_000


def savable(problem: Problem) -> frozenset[int]:
    """Forward values a plan may hand to the backward (multi-output ops hand their parts)."""
    return frozenset(i for i in problem.forward_nodes if not problem.outputs_of[i])


def store_all(problem: Problem, limit: int | None = None) -> Plan:
    """What eager autograd does: save every value of the forward pass the backward reads.

    Forward-phase values that only the backward uses (they depend on no
    tangent, e.g. a mask built from an activation) are computed in the
    backward from the saved ones, once, at no extra cost.
    """
    movable = savable(problem)
    plan = evaluate(problem, movable & problem.forward_closure, solver="store-all", limit=limit)
    # Values a forced save (a random op outside the forward closure) makes the
    # forward run are saved too, rather than run a second time.
    while extra := (_run_by_forward(problem, plan) & movable) - plan.saved:
        plan = evaluate(problem, plan.saved | extra, solver="store-all", limit=limit)
    return _within(plan, problem)


def _run_by_forward(problem: Problem, plan: Plan) -> frozenset[int]:
    """Recomputed values the forward computes too (itself, or its multi-output op)."""
    ran = set(plan.schedule.forward)
    return frozenset(i for i in plan.recomputed if i in ran or problem.nodes[i].output_of in ran)


def recompute_all(problem: Problem, limit: int | None = None) -> Plan:
    """Save only what may not be recomputed. Often *not* the smallest peak: the
    backward then rebuilds long chains at once."""
    return _within(evaluate(problem, (), solver="recompute-all", limit=limit), problem)


def least_held(problem: Problem, limit: int) -> Plan | None:
    """Of the greedy's candidate plans (``greedy``) and recompute-all, the one that holds
    the fewest bytes past the forward (``held_bytes``: its saved values and outputs) with a
    peak within ``limit``, the cheapest of those; None where none fits. What a graph can
    leave to code after it that nothing has measured yet."""
    candidates = [*_drop_saves(problem), *checkpoint_sweep(problem)]
    if len(problem) <= GROWN_MAX_NODES:
        candidates += _drop_saves(problem, grow=True)
    candidates.append(evaluate(problem, (), solver="recompute-all"))
    fitting = [p for p in candidates if p.peak <= limit]
    return min(fitting, key=lambda p: (held_bytes(problem, p), p.cost), default=None)


def greedy(problem: Problem, limit: int | None = None) -> Plan:
    """The cheapest of several fast plans that fits ``limit``.

    Candidates: the trajectories of ``_drop_saves`` (stop saving, one at a time,
    the storage live at the peak that frees the most bytes per unit of recompute
    cost; and, on graphs up to ``GROWN_MAX_NODES``, the same with storages grown
    into groups that share their recomputes) and ``checkpoint_sweep`` (segment
    checkpointing at every segment size). Where none fits, ``descend`` pushes the
    lowest peak further down. Without a budget it returns the lowest-peak plan: the
    feasible minimum remat reports.
    """
    start = time.perf_counter()
    target = -1 if limit is None else limit
    # The same candidates for every budget, so a looser budget never costs more
    # and a tighter one never peaks higher.
    plain, sweep = _drop_saves(problem), checkpoint_sweep(problem)
    grown = _drop_saves(problem, grow=True) if len(problem) <= GROWN_MAX_NODES else []
    candidates = plain + grown + sweep
    feasible = [p for p in candidates if p.peak <= target]
    if not feasible:
        # descents from the lowest plan of each kind: where one ends is not where the
        # other does (see docs/solver-notes.md, "Adopted": the greedy's grown trajectory)
        for family in (plain + sweep, grown):
            if family:
                lowest = min(family, key=lambda p: (p.peak, p.cost))
                candidates.append(descend(problem, lowest, target))
        feasible = [p for p in candidates if p.peak <= target]
    if not feasible:
        best = min(candidates, key=lambda p: (p.peak, p.cost))
        if limit is None:
            return _finish(best, limit, start)
        raise InfeasibleBudget(limit, best.peak, store_all(problem).peak, problem.name)
    return _finish(min(feasible, key=lambda p: (p.cost, p.peak)), limit, start)


def _drop_saves(problem: Problem, grow: bool = False) -> list[Plan]:
    """Plans from store-all, each saving fewer values, while that frees bytes at the peak.

    Each step drops the best victims (``_victims``) together: one simulation per step
    instead of per victim, which is what makes this linear-ish on large graphs. With
    ``grow``, a victim is a group of storages (``_grown``).
    """
    # Saving a free view is saving its base; saving both would make neither a victim
    # (dropping one frees nothing while the other holds the storage).
    plan = evaluate(problem, without_free_views(problem, store_all(problem).saved), solver="greedy")
    plans = [plan]
    step = max(1, plan.peak // DROP_STEPS)
    while victims := _victims(problem, plan, step, grow):
        plan = evaluate(problem, plan.saved - victims, solver="greedy")
        plans.append(plan)
    return plans


def checkpoint_sweep(problem: Problem, levels: int = 24) -> list[Plan]:
    """Chen et al.'s sublinear-memory heuristic, one plan per segment size.

    Walks the forward in order and saves a *cut* value (one that few bytes
    flow around: a layer boundary) each time the bytes since the last saved cut
    exceed a threshold; everything between cuts is recomputed. Sweeping the
    threshold traces the memory/recompute curve, √n checkpointing included.
    """
    nodes, storage = problem.nodes, problem.storage
    order = sorted(savable(problem) & problem.forward_closure)
    crossing = _crossing(problem)
    cuts = {i for i in order if nodes[storage[i]].bytes and crossing[i] <= nodes[i].bytes}
    if not cuts:
        return []
    total = sum(nodes[storage[i]].bytes for i in order)
    smallest = min(nodes[storage[i]].bytes for i in cuts)
    plans, seen = [], set()
    for k in range(levels):
        threshold = smallest * (total / smallest) ** (k / max(1, levels - 1))
        saved, since = [], 0
        for i in order:
            since += nodes[i].bytes
            if i in cuts and since >= threshold:
                saved.append(i)
                since = 0
        key = frozenset(saved)
        if key not in seen:
            seen.add(key)
            plans.append(evaluate(problem, key, solver="greedy"))
    return plans


def _crossing(problem: Problem) -> list[int]:
    """Bytes of forward values made before node i and read after it: what a
    checkpoint at i leaves uncut."""
    nodes = problem.nodes
    last_read = list(range(len(nodes)))
    for i in problem.forward_closure:
        for j in nodes[i].inputs:
            last_read[j] = max(last_read[j], i)
    delta = [0] * (len(nodes) + 1)
    for j in problem.forward_closure:
        if last_read[j] > j + 1 and nodes[j].bytes:
            delta[j + 1] += nodes[j].bytes
            delta[last_read[j]] -= nodes[j].bytes
    crossing, running = [], 0
    for i in range(len(nodes)):
        running += delta[i]
        crossing.append(running)
    return crossing


def descend(problem: Problem, plan: Plan, target: int) -> Plan:
    """Flip one value at a time, the flip that lowers the peak most, until the plan fits
    ``target`` or no flip helps.

    Flips are limited to values live at the peak: stop saving a saved one, or
    save a recomputed one, which cuts the recompute chain that runs through it.
    Each round tries the ``DESCEND_FLIPS`` largest first (each a full simulation; on
    large graphs hundreds are live at the peak), and the rest only if none of those
    lowers the peak: so it stops where the full scan would. Where no flip lowers the
    peak (two steps share it: lowering either alone leaves it where it is), it takes
    the flip that keeps the peak and lowers the bytes live summed over all steps most,
    and goes on from there, for up to ``DESCEND_PLATEAU`` moves (trying the
    ``DESCEND_FLIPS`` largest flips each) until one lowers the peak; a run that does not
    ends at the plan it started from. The path does not
    depend on ``target``, which only says where to stop, so every budget between the
    start's peak and the end's is met.
    """
    storage, nodes = problem.storage, problem.nodes
    movable = savable(problem)
    roots = without_free_views(problem, plan.saved)  # the same plan; see _drop_saves
    if roots != plan.saved:
        plan = evaluate(problem, roots, solver=plan.solver, status=plan.status)
    stuck, flat = plan, 0  # where the current plateau run started, and its length
    while plan.peak > target:
        flips = sorted(
            _flips_at_peak(problem, plan, movable), key=lambda i: (-nodes[storage[i]].bytes, i)
        )
        better = _better_flips(problem, plan, flips[:DESCEND_FLIPS])
        if not flat and not any(t.peak < plan.peak for t in better):
            better += _better_flips(problem, plan, flips[DESCEND_FLIPS:])
        lower = [t for t in better if t.peak < plan.peak]
        if lower:
            plan = min(lower, key=lambda t: (t.peak, t.cost))
            stuck, flat = plan, 0
        elif better and flat < DESCEND_PLATEAU:
            plan = min(better, key=lambda t: (_area(t), t.cost))
            flat += 1
        else:
            return stuck  # the plateau moves led nowhere: back to where they began
    return plan


def nearest_fit(problem: Problem, plan: Plan, target: int) -> Plan | None:
    """The cheapest plan one flip away from ``plan`` that fits ``target``, or None.

    The repair for an answer just over the budget (a relaxation's: it misses by a
    fraction of a percent): ``descend`` takes the flip that lowers the peak most, which
    can cost far more than the overflow needs. The flips are ``descend``'s (values live
    at the peak), those that alone could free the overflow first, then the cheapest to
    recompute; at most ``FILL_TRIALS`` simulations (see docs/solver-notes.md,
    "Adopted": the cheapest single flip first).
    """
    storage, nodes = problem.storage, problem.nodes
    over = plan.peak - target
    flips = sorted(
        _flips_at_peak(problem, plan, savable(problem)),
        key=lambda i: (i in plan.saved and nodes[storage[i]].bytes < over, nodes[i].cost, i),
    )
    fits = (evaluate(problem, plan.saved ^ {i}, solver=plan.solver) for i in flips[:FILL_TRIALS])
    return min((t for t in fits if t.peak <= target), key=lambda t: (t.cost, t.peak), default=None)


def repaired(problem: Problem, plan: Plan, limit: int) -> Plan:
    """``plan`` pushed under ``limit`` (by its cheapest single flip that fits, else
    ``descend``), then polished back up with ``fill``: the repair of a plan that misses a
    limit it was not made for. Over ``limit`` still where ``descend`` cannot get under."""
    fixed = nearest_fit(problem, plan, limit)
    if fixed is None:
        fixed = descend(problem, plan, limit)
    return fill(problem, fixed, limit) if fixed.peak <= limit else fixed


def _flips_at_peak(problem: Problem, plan: Plan, movable: frozenset[int]) -> list[int]:
    """Values whose flip (save a recomputed one, recompute a saved one) can move the peak:
    movable, recomputable, their storage live at the peak."""
    live, nodes, storage = plan.timeline.live_at_peak, problem.nodes, problem.storage
    return [
        i
        for i in plan.saved | plan.recomputed
        if i in movable and storage[i] in live and nodes[i].recomputable
    ]


def _better_flips(problem: Problem, plan: Plan, flips: list[int]) -> list[Plan]:
    """``plan`` with each of ``flips`` flipped, kept where that lowers its peak, or keeps
    the peak and lowers its ``_area``."""
    area, better = _area(plan), []
    for i in flips:
        trial = evaluate(problem, plan.saved ^ {i}, solver="greedy")
        if trial.peak < plan.peak or (trial.peak == plan.peak and _area(trial) < area):
            better.append(trial)
    return better


def _area(plan: Plan) -> int:
    """Bytes live summed over every step: what a plateau of equal peaks shrinks by."""
    return sum(live for _, _, live in plan.timeline.steps)


def fill(
    problem: Problem,
    plan: Plan,
    limit: int,
    max_trials: int | None = None,
    order: str = "cost",
) -> Plan:
    """Save recomputed values back, costliest first (``order="cost"``) or most recompute
    seconds per byte first (``"per_byte"``), while the plan still fits ``limit``.

    The polish for plans that were pushed under the budget by coarse moves (a repair,
    a relaxation's answer): each accepted save lowers the recompute cost. Passes over
    the recomputed values repeat while one helps, up to ``max_trials`` simulations
    (default ``FILL_TRIALS``), so it is deterministic and bounded. It gives up after
    ``FILL_MISSES`` failed trials in a row: a plan already at the budget (the greedy's)
    would otherwise spend every trial on saves that cannot fit. "per_byte" reaches what
    "cost" gives up before: the many tiny masks and index tensors of a real graph.
    """
    orders = {"cost": _costliest, "per_byte": _per_byte}
    if order not in orders:
        raise ValueError(f"order must be one of {sorted(orders)}, got {order!r}")
    key = orders[order]
    movable = savable(problem)
    trials = FILL_TRIALS if max_trials is None else max_trials
    misses = 0
    improved = True
    while improved and trials > 0 and misses < FILL_MISSES:
        improved = False
        for i in sorted(plan.recomputed & movable, key=lambda i: key(problem, i)):
            if trials <= 0 or misses >= FILL_MISSES:
                break
            if i not in plan.recomputed:
                continue
            trials -= 1
            trial = evaluate(problem, plan.saved | {i}, solver=plan.solver, status=plan.status)
            if trial.peak <= limit and trial.cost < plan.cost:
                plan, improved, misses = trial, True, 0
            else:
                misses += 1
    return plan


def _costliest(problem: Problem, i: int) -> tuple:
    return (-problem.nodes[i].cost, i)


def _per_byte(problem: Problem, i: int) -> tuple:
    return (-problem.nodes[i].cost / (problem.nodes[problem.storage[i]].bytes + 1), i)


def _victims(problem: Problem, plan: Plan, step: int, grow: bool = False) -> frozenset[int]:
    """Saved values to stop saving, best freed bytes per recompute cost first: the best
    group (``_ranked_groups``), then the next ones while they are independent of those
    before (no node newly recomputed for two of them) and free at most ``step`` bytes
    in all."""
    chosen: set[int] = set()
    touched: set[int] = set()
    freed = 0
    for _, _, saved, chain, size in _ranked_groups(problem, plan, grow):
        freed += size
        if chosen and (freed > step or not touched.isdisjoint(chain)):
            break
        chosen.update(saved)
        touched |= chain
    return frozenset(chosen)


def _ranked_groups(problem: Problem, plan: Plan, grow: bool) -> list[tuple]:
    """Storages live at the peak the plan could stop saving, best bytes per recompute
    second first, each as ``(score, root, saved values, new recomputes, bytes)``.

    A storage goes with every saved value on it (while one view stays saved, dropping
    another frees nothing); with ``grow`` also with the storages ``_grown`` adds.
    """
    nodes, storage = problem.nodes, problem.storage
    held = {storage[i] for i in (*problem.outputs, *problem.grads)}
    live = plan.timeline.live_at_peak
    on: dict[int, list[int]] = {}
    pinned = set()  # storages holding a saved value that may not be recomputed
    for i in sorted(plan.saved):
        root = storage[i]
        if root in live and root not in held and nodes[root].bytes:
            on.setdefault(root, []).append(i)
            if not nodes[i].recomputable:
                pinned.add(root)
    ranked = []
    for root, saved in on.items():
        if root not in pinned:
            chain = _new_recomputes(problem, plan, saved)
            size = nodes[root].bytes
            ranked.append((size / _seconds(problem, chain), root, frozenset(saved), chain, size))
    if grow:
        ranked = _grown(problem, ranked)
    ranked.sort(key=lambda t: (-t[0], t[1]))
    return ranked


def _grown(problem: Problem, ranked: list[tuple]) -> list[tuple]:
    """Each of ``_ranked_groups``'s storages with the others whose recomputes it makes
    cheaper, added one at a time while each raises the bytes freed per recompute second.

    Attention's q, k and v, saved apart, each need the costly qkv projection re-run:
    dropping one frees a third of what that costs, dropping the three all of it
    (see docs/solver-notes.md, "Adopted": the greedy's grown trajectory).
    """
    nodes = problem.nodes
    single = {root: (saved, chain) for _, root, saved, chain, _ in ranked}
    sharing: dict[int, list[int]] = {}  # costly node -> the storages whose drop re-runs it
    for root, (_, chain) in single.items():
        for j in chain:
            if nodes[j].cost:
                sharing.setdefault(j, []).append(root)

    def added(r: int, chain: set[int]) -> float:
        """Bytes per recompute second that storage r adds on top of ``chain``."""
        return nodes[r].bytes / _seconds(problem, single[r][1] - chain)

    out = []
    for score, root, saved, chain, size in ranked:
        roots = {root}
        while near := {r for j in chain for r in sharing.get(j, ())} - roots:
            gain, _, r = max((added(r, chain), -r, r) for r in near)  # ties: the lowest r
            if gain <= score:
                break
            roots.add(r)
            size += nodes[r].bytes
            saved, chain = saved | single[r][0], chain | single[r][1]
            score = size / _seconds(problem, chain)
        out.append((score, root, saved, chain, size))
    return out


def _seconds(problem: Problem, chain) -> float:
    """Recompute seconds of ``chain`` (never 0: a free chain scores infinitely well)."""
    return sum(problem.nodes[j].cost for j in chain) + 1e-12


def _new_recomputes(problem: Problem, plan: Plan, victims: list[int]) -> set[int]:
    """The nodes that start being recomputed if ``victims`` are no longer saved."""
    saved, recomputed = plan.saved, plan.recomputed

    def stays(i: int) -> bool:  # recomputed already, or saved and not a victim
        return i in recomputed or (i in saved and i not in victims)

    return reachable(victims, problem.producers, stays)


def _within(plan: Plan, problem: Problem) -> Plan:
    """Fixed strategies do not adapt to a budget; say so instead of exceeding it."""
    if plan.limit is not None and plan.peak > plan.limit:
        raise SolverOverBudget(
            f"solver {plan.solver!r} peaks at {format_bytes(plan.peak)}, over the budget "
            f"{format_bytes(plan.limit)}{' for ' + problem.name if problem.name else ''}; "
            "it does not adapt to a budget: use solver='auto' or 'greedy'"
        )
    return plan


def _finish(plan: Plan, limit: int | None, start: float) -> Plan:
    return replace(plan, limit=limit, solve_seconds=time.perf_counter() - start)
