"""A forward that is a chain of stages, and the classic checkpointing schedules on it.

A *cut* is a forward value that every later forward node reaches the earlier ones
through: nothing computed before it is read after it. Cuts split the forward into
stages (a layer of an MLP, a residual block of a transformer: found from the graph, not
from module names), and a chain schedule works on them:

- the forward keeps some stage boundaries (checkpoints) and nothing else it can rebuild;
- the backward reverses the stages last to first; before stage ``k``'s backward it
  *tapes* stage ``k`` (recomputes the values its backward reads, from boundary
  ``k - 1``), and to reach boundary ``k - 1`` it *advances* from the nearest checkpoint,
  possibly storing boundaries on the way as new checkpoints.

So a value may be recomputed several times, each copy with its own lifetime: the plan
carries its backward's order (``Schedule.backward``), from which ``schedule`` derives
what the forward must hand over. ``sqrt`` checkpoints every ~√n stages; ``revolve``
chooses where to store by dynamic programming over the stages' costs for a number of
checkpoint slots.

Prior art, and what this module takes from it:

- Chen et al. 2016 (training with sublinear memory cost): ``sqrt``, a checkpoint every
  ~√n stages.
- REVOLVE (Griewank & Walther, ACM TOMS 2000): binomial checkpointing, the optimum for
  a number of slots on a chain of equal stages; ``revolve`` meets it there.
- rotor (Beaumont et al., 2019, heterogeneous chains): a dynamic programme over stages
  that differ, there over bytes of memory; ``revolve``'s runs over checkpoint slots.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from .errors import InfeasibleBudget, RematError
from .graph import reachable
from .plan import Plan, evaluate
from .problem import Problem
from .schedule import read_before_made

MAX_SLOTS = 32  # revolve's search: 32 slots reverse 560 uniform stages in <= 2 forwards
LOWEST_ONE_SLOT = 64  # stages up to which the floor search tries one slot
MAX_STAGES = 256  # longer chains are coarsened: the table grows as stages^2 x slots

# An action of a chain schedule: ("advance", l, m) computes boundary m from boundary l,
# ("tape", k) computes what stage k's backward reads, ("back", k) runs that backward.
Action = tuple


class NotAChain(RematError, ValueError):
    """A chain solver was asked for a graph whose forward has no usable chain of stages."""


@dataclass(frozen=True, eq=False)
class Chain:
    """The stages of ``problem``'s forward: ``cuts[k]`` ends stage ``k + 1`` (boundary
    ``k + 1``); stage 0's input (boundary 0) is resident. ``groups[k]`` are the backward
    core nodes of stage ``k + 1``, in order; the core runs them last stage first."""

    problem: Problem
    cuts: tuple[int, ...]
    stage_of: tuple[int, ...]  # stage (1-based) of each forward node, 0 for others
    groups: tuple[tuple[int, ...], ...]

    @property
    def length(self) -> int:
        return len(self.groups)

    @cached_property
    def costs(self) -> np.ndarray:
        """Seconds of each stage's forward (index k for stage k, 1-based; 0 unused)."""
        out = np.zeros(self.length + 1)
        for i, k in enumerate(self.stage_of):
            if k:
                out[k] += self.problem.nodes[i].cost
        return out


def find_chain(problem: Problem) -> Chain | None:
    """The chain of stages of ``problem``'s forward, or None where there is none: no cut,
    or a backward that does not reverse the stages in order."""
    nodes = problem.nodes
    free = _free_values(problem)
    # A view of an activation allocates nothing and may run anywhere after its base (the
    # graph places some late, among the backward): it belongs to its base's stage.
    views = {i for i in problem.forward_nodes if nodes[i].alias_of is not None} - free
    forward = [i for i in problem.forward_nodes if i not in free and i not in views]
    if not forward:
        return None

    def base(j: int) -> int:
        while j in views:
            j = nodes[j].alias_of
        return j

    cuts = _cuts(problem, forward, free, base)
    if not cuts:
        return None
    if len(cuts) > MAX_STAGES:
        stride = math.ceil(len(cuts) / MAX_STAGES)
        cuts = cuts[stride - 1 :: stride]
    if cuts[-1] != forward[-1]:
        cuts.append(forward[-1])  # the last stage runs to the end (it may not be a cut)
    return _in_backward_order(problem, forward, views, base, cuts)


def _free_values(problem: Problem) -> set[int]:
    """Values made of resident tensors alone (a weight's transpose): they cost nothing to
    hand over or remake, wherever they are, so they bind no stage. A multi-output op's
    bytes are on its outputs: it is free only if they all are."""
    nodes, free = problem.nodes, set()
    for i in problem.forward_nodes:
        parts = problem.outputs_of[i]
        if (nodes[i].bytes == 0 and all(j in free for j in nodes[i].inputs)
                and all(nodes[p].bytes == 0 for p in parts)):
            free.add(i)  # fmt: skip
    return free


def _cuts(problem: Problem, forward: list[int], free: set[int], base) -> list[int]:
    """The forward values no later node reads past: each later node reads nothing
    earlier than it (``base``: a view's storage owner)."""
    nodes = problem.nodes
    # earliest forward value each forward node reads; a cut c has none earlier read later
    earliest = {
        i: min((base(j) for j in nodes[i].inputs if nodes[j].phase == "fwd" and j not in free),
               default=i)
        for i in forward
    }  # fmt: skip
    cuts, later_min = [], math.inf
    for i in reversed(forward):
        node = nodes[i]
        if (later_min >= i and node.alias_of is None and not problem.outputs_of[i]
                and node.recomputable):
            cuts.append(i)
        later_min = min(later_min, earliest[i])
    cuts.reverse()  # fmt: skip
    return cuts


def _in_backward_order(
    problem: Problem, forward: list[int], views: set[int], base, cuts: list[int]
) -> Chain | None:
    """The chain of stages ``cuts`` end, with the stages the backward interleaves (a
    shortcut's backward after its block's main path) merged until it reverses them in
    order; None where fewer than two stages are left."""
    while True:
        stage_of = [0] * len(problem.nodes)
        k = 0
        for i in forward:
            stage_of[i] = k + 1
            if k < len(cuts) and i == cuts[k]:
                k += 1
        for i in sorted(views):
            stage_of[i] = stage_of[base(i)]
        groups, back = _groups(problem, stage_of, len(cuts))
        if back is None:
            return Chain(problem, tuple(cuts), tuple(stage_of), groups) if len(cuts) > 1 else None
        low, high = back
        cuts = [c for k, c in enumerate(cuts, 1) if not low <= k < high]
        if len(cuts) < 2:
            return None


def _groups(problem: Problem, stage_of: list[int], stages: int):
    """The backward core split by the stage each node's backward belongs to, and None;
    or, where the backward returns to a later stage, None and (that stage's position so
    far, the later stage)."""
    nodes = problem.nodes
    groups: list[list[int]] = [[] for _ in range(stages)]
    current = stages
    for c in problem.backward_core[0]:
        reads = [stage_of[j] for j in nodes[c].inputs if stage_of[j]]
        if reads and max(reads) > current:
            return None, (current, max(reads))
        if reads:
            current = max(reads)
        groups[current - 1].append(c)
    return tuple(tuple(g) for g in groups), None


# ----------------------------------------------------------------------------- schedules


class Revolve:
    """Cheapest reversals of a chain of ``len(costs) - 1`` stages (``costs[k]``: stage
    ``k``'s forward, ``costs[0]`` unused) holding at most ``s`` boundaries at once
    (boundary 0 included), for every ``s`` up to ``max_slots``.

    Dynamic programme over (first, last, slots): reversing stages l+1..r from boundary l
    either advances to a split m, stores it, reverses m+1..r with one slot fewer and
    then l+1..m with all; or, with one slot, advances from l to each stage in turn. On
    equal costs it keeps fewer boundaries. Costs count forward work beyond one taping
    of each stage.
    """

    def __init__(self, costs: Sequence[float], max_slots: int) -> None:
        n = len(costs) - 1
        if n < 1 or max_slots < 1:
            raise ValueError(f"need at least one stage and one slot, got {n} and {max_slots}")
        self.stages, self.max_slots = n, min(max_slots, n)
        prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float)[1:])))
        advance = prefix[None, :] - prefix[:, None]  # [l, m]: stages l+1..m
        slots = self.max_slots
        best = np.full((slots + 1, n + 1, n + 1), np.inf)
        self.split = np.zeros((slots + 1, n + 1, n + 1), dtype=np.int32)
        first = np.arange(n)
        best[1:, first, first + 1] = 0.0  # one stage: tape it from its boundary
        for d in range(2, n + 1):
            ls = np.arange(0, n - d + 1)
            rs = ls + d
            best[1, ls, rs] = advance[ls, rs - 1] + best[1, ls, rs - 1]
            if slots < 2:
                continue
            ms = ls[:, None] + np.arange(1, d)[None, :]  # splits l < m < r
            rows = np.arange(len(ls))
            for s in range(2, slots + 1):
                total = advance[ls[:, None], ms] + best[s - 1, ms, rs[:, None]]
                total = total + best[s, ls[:, None], ms]
                at = np.argmin(total, axis=1)
                pick, one = total[rows, at], best[1, ls, rs]
                better = pick < one
                best[s, ls, rs] = np.where(better, pick, one)
                self.split[s, ls, rs] = np.where(better, ms[rows, at], 0)
        self.best = best

    def cost(self, slots: int) -> float:
        return float(self.best[min(slots, self.max_slots), 0, self.stages])

    def actions(self, slots: int) -> list[Action]:
        """The schedule for ``slots`` (at most ``max_slots``), in the order it runs."""
        actions: list[Action] = []
        stack = [(0, self.stages, min(slots, self.max_slots))]
        while stack:
            left, right, s = stack.pop()
            if right - left == 1:
                actions += [("tape", right), ("back", right)]
                continue
            m = int(self.split[s, left, right])
            if m == 0:  # one slot: advance to right - 1, reverse the last stage, then the rest
                actions += [("advance", left, right - 1), ("tape", right), ("back", right)]
                stack.append((left, right - 1, 1))
                continue
            actions.append(("advance", left, m))
            stack.append((left, m, s))  # runs after the right part (a stack: pushed first)
            stack.append((m, right, s - 1))
        return actions


def sqrt_actions(n: int, segment: int) -> list[Action]:
    """Checkpoint every ``segment`` stages: the forward stores those boundaries; the
    backward, per segment from the last, tapes all its stages, then reverses them."""
    ends = list(range(segment, n, segment)) + [n]
    starts = [0, *ends[:-1]]
    bounds = list(zip(starts, ends, strict=True))
    actions: list[Action] = [("advance", a, b) for a, b in bounds[:-1]]
    for a, b in reversed(bounds):
        actions += [("tape", k) for k in range(a + 1, b + 1)]
        actions += [("back", k) for k in range(b, a, -1)]
    return actions


def binomial_forward_steps(n: int, slots: int) -> int:
    """Griewank's minimal number of forward steps to reverse ``n`` uniform steps with
    ``slots`` checkpoints (the initial state in one), besides one taping per step:
    ``t n - C(slots + t, t - 1)`` for the repetition number ``t`` with
    ``C(slots + t - 1, slots) < n <= C(slots + t, slots)``."""
    if n <= 1:
        return 0
    t = 1
    while math.comb(slots + t, slots) < n:
        t += 1
    return t * n - math.comb(slots + t, t - 1)


# ----------------------------------------------------------------------------- plans


def chain_plan(chain: Chain, actions: list[Action], *, solver: str, limit: int | None) -> Plan:
    """The plan ``actions`` stand for: the forward runs up to the first backward stage (a
    plain forward pass); the rest is the backward's order, and what it reads before it
    computes it is what the forward hands over."""
    problem = chain.problem
    kept = _never_rebuilt(chain)
    first_back = next(k for k, a in enumerate(actions) if a[0] == "back")
    order: list[int] = []
    for action in actions[first_back:]:
        if action[0] == "back":
            order += chain.groups[action[1] - 1]
        elif action[0] == "tape":
            k = action[1]
            order += _stage_nodes(chain, k, k, _tape_targets(chain, k), kept)
        else:
            _, left, right = action
            order += _stage_nodes(chain, left + 1, right, [chain.cuts[right - 1]], kept)
    while True:  # a value handed over is read as such, never computed again after it
        order = _without_dead(problem, order)
        saved = read_before_made(problem, order)
        if not any(i in saved for i in order):
            return evaluate(problem, saved, backward=tuple(order), solver=solver, limit=limit)
        order = [i for i in order if i not in saved]


def _without_dead(problem: Problem, order: list[int]) -> list[int]:
    """``order`` without the recomputes nothing reads before the value is made again
    (a boundary advanced to for a stage whose backward reads nothing)."""
    nodes = problem.nodes
    needed = {g for g in problem.grads if nodes[g].phase == "fwd"}
    kept: list[int] = []
    for i in reversed(order):
        if nodes[i].phase == "fwd":
            if i not in needed:
                continue
            needed.discard(i)
        kept.append(i)
        needed.update(nodes[i].inputs)
    return kept[::-1]


def _never_rebuilt(chain: Chain) -> frozenset[int]:
    """Forward values a chain schedule hands over rather than recomputes: those that may
    not be recomputed, and forward values returned as gradients."""
    problem = chain.problem
    nodes = problem.nodes
    fixed = {i for i in problem.forward_nodes if not nodes[i].recomputable}
    fixed |= {g for g in problem.grads if nodes[g].phase == "fwd"}
    return frozenset(fixed)


def _tape_targets(chain: Chain, k: int) -> list[int]:
    """The forward values stage ``k``'s backward reads that stage ``k`` computes, and its
    boundary (a tape of the next stage may start from it; unread, it is dropped)."""
    nodes, stage_of = chain.problem.nodes, chain.stage_of
    reads = [j for c in chain.groups[k - 1] for j in nodes[c].inputs
             if nodes[j].phase == "fwd" and stage_of[j] == k]  # fmt: skip
    return [*reads, chain.cuts[k - 1]]


def _stage_nodes(chain: Chain, first: int, last: int, targets, kept: frozenset[int]) -> list[int]:
    """What computes ``targets`` inside stages first..last, in the order a program runs
    it: a multi-output op's outputs right after it."""
    problem, stage_of = chain.problem, chain.stage_of

    def outside(i: int) -> bool:
        return not first <= stage_of[i] <= last or i in kept

    need = reachable([t for t in targets if not outside(t)], problem.producers, outside)
    return sorted(need, key=problem.rank.__getitem__)


# ----------------------------------------------------------------------------- solvers


def sqrt(problem: Problem, limit: int | None = None) -> Plan:
    """Checkpoint every k stages (k near √n, and the sizes around it): the cheapest such
    plan under ``limit``."""
    start = time.perf_counter()
    chain = _chain_or_refuse(problem, "sqrt")
    n = chain.length
    root = max(1, round(math.sqrt(n)))
    sizes = sorted({max(1, min(n, s)) for s in (root, root - 1, root + 1, root // 2, 2 * root,
                                                  1, n)})  # fmt: skip
    plans = [chain_plan(chain, sqrt_actions(n, s), solver="sqrt", limit=limit) for s in sizes]
    return _pick(problem, plans, limit, start)


def revolve(problem: Problem, limit: int | None = None, *, slots: int | None = None) -> Plan:
    """The binomial (REVOLVE) schedule over the graph's stages: with ``slots``, for that
    many checkpoints; otherwise the most slots (the least recomputation) under
    ``limit``, found by bisection. Peaks grow with slots only roughly (a slot's boundary
    may replace a larger tape), so the bisection can miss a cheaper plan that fits; it
    never returns one that does not."""
    start = time.perf_counter()
    chain = _chain_or_refuse(problem, "revolve")
    most = min(chain.length, MAX_SLOTS if slots is None else max(slots, 1))
    table = Revolve(chain.costs, most)

    def plan_for(s: int) -> Plan:
        return chain_plan(chain, table.actions(s), solver="revolve", limit=limit)

    if slots is not None:
        return _pick(problem, [plan_for(slots)], limit, start)
    if limit is None:
        return _pick(problem, [plan_for(most)], limit, start)
    low = plan_for(1)
    if low.peak > limit:
        return _pick(problem, [low, plan_for(2)] if most > 1 else [low], limit, start)
    lo, hi, best = 1, most, low
    while lo < hi:  # the most slots whose plan fits
        mid = (lo + hi + 1) // 2
        plan = plan_for(mid)
        if plan.peak <= limit:
            lo, best = mid, plan
        else:
            hi = mid - 1
    return _pick(problem, [best], limit, start)


def lowest_chain_peak(problem: Problem) -> Plan | None:
    """The lowest-peak chain plan, None without a chain: revolve with one or two slots
    (two only on long chains, where one slot's quadratic recomputation is slow to
    simulate and saves a single boundary)."""
    chain = find_chain(problem)
    if chain is None:
        return None
    table = Revolve(chain.costs, 2)
    slots = range(1, 3) if chain.length <= LOWEST_ONE_SLOT else range(2, 3)
    plans = [chain_plan(chain, table.actions(s), solver="revolve", limit=None)
             for s in slots if s <= table.max_slots]  # fmt: skip
    return min(plans, key=lambda p: (p.peak, p.cost))


def _chain_or_refuse(problem: Problem, solver: str) -> Chain:
    chain = find_chain(problem)
    if chain is None:
        raise NotAChain(
            f"solver {solver!r} needs a forward that is a chain of stages (a value every "
            f"later node reaches earlier ones through) and a backward that reverses them; "
            f"{problem.name or 'this graph'} has none: use solver='auto' or 'greedy'"
        )
    return chain


def _pick(problem: Problem, plans: list[Plan], limit: int | None, start: float) -> Plan:
    """The cheapest of ``plans`` within ``limit``; ``InfeasibleBudget`` naming the lowest
    peak among them when none fits."""
    from .heuristics import store_all

    fitting = [p for p in plans if limit is None or p.peak <= limit]
    if not fitting:
        low = min(p.peak for p in plans)
        raise InfeasibleBudget(limit, low, store_all(problem).peak, problem.name)
    best = min(fitting, key=lambda p: (p.cost, p.peak))
    return replace(best, solve_seconds=time.perf_counter() - start)
