"""Where a ``Relaxation`` follows ``schedule``'s placement exactly.

- the **exact backward** (``add_exact_backward``, for ``Relaxation(exact=True)``):
  every backward step, as one cumulative over the schedule's own order;
- **exact points** (``add_point``), added between solves where an answer overflowed:
  the backward's memory during one core step, or while one recompute runs in its gap,
  exactly, with booleans for "recomputed by then" that follow ``schedule``'s placement
  (the chains miss recomputes pulled early by recomputed consumers, saved values read
  late only by recomputes, and what a gap holds while its recomputes run);
  ``add_points`` adds them where a plan overflows most.

Functions of the relaxation: they read what ``Relaxation`` builds (its model, its ``r``
and ``kept`` variables, the core's timings), keep the points added and the literals
they share in it (``points``, ``needed``, ``placed``: made once per node and step) and
record how a plan sets each literal they make (``Relaxation.derive``, for the hints).
This module imports nothing of ``relaxation``, which builds on it.
"""

from __future__ import annotations

import math

NEVER = math.inf  # no core position: a value no plan needs placed


def add_exact_backward(relax) -> None:
    """The backward's memory at every step of ``relax`` (a ``Relaxation``), exactly, as
    one cumulative constraint.

    Time: core position k is ``k*K + N``; a recompute x in the gap before it is
    ``k*K + rank[x]`` (``schedule`` orders each gap by rank). A recompute's gap is
    the first core position that needs it: ``gap[v] = min(first read, gap of each
    recomputed consumer)`` (a multi-output op: its recomputed outputs' need).
    A storage's interval runs from when it is allocated (the start, if saved) to
    the last step touching it; the backward's own values are a fixed profile.
    """
    problem, m = relax.problem, relax.model
    nodes, parts, rank = problem.nodes, problem.outputs_of, problem.rank
    n = len(nodes)
    K = n + 1
    horizon = (len(relax.core) + 1) * K
    gap = _placement(relax)
    time = {v: gap[v] * K + rank[v] for v in gap}
    intervals, demands = [], []

    def add(start, size, end_, present, demand, name):
        if demand <= 0:
            return
        if present is None:
            intervals.append(m.NewFixedSizeIntervalVar(start, size, name))
        else:
            intervals.append(m.NewOptionalIntervalVar(start, size, end_, present, name))
        demands.append(demand)

    lives = [*relax.base_live, None]
    for k, (across, live) in enumerate(zip(relax.across, lives, strict=True)):
        add(k * K, n, None, None, across, f"gap{k}")
        if live is not None:
            add(k * K + n, 1, None, None, live, f"core{k}")
    grads = {problem.storage[g] for g in problem.grads}
    for R in sorted(relax.kept):
        if nodes[R].bytes:
            _storage_interval(relax, R, K, horizon, R in grads, time, add)
    for x in gap:
        step, ran = (time[x], 1, time[x] + 1), relax.r[x]
        if nodes[x].workspace:
            add(*step, ran, nodes[x].workspace, f"ws{x}")
        for p in parts[x]:
            if p not in relax.kept:  # an output nobody needs: live at the op's step only
                add(*step, ran, nodes[p].bytes, f"tmp{p}")
            elif nodes[p].bytes:  # a re-run op rewrites a saved output: a second buffer
                both = m.NewBoolVar(f"rewrite{p}")
                m.Add(both >= ran + relax.kept[p] - 1)
                add(*step, both, nodes[p].bytes, f"rw{p}")
    m.AddCumulative(intervals, demands, relax.limit)


def _placement(relax) -> dict:
    """``gap[v]``: the core position a recompute of v runs before, as ``schedule``
    places it: ``min(first read, gap of each recomputed consumer)`` (a multi-output
    op: its recomputed outputs' need), for each node that may be recomputed, in order."""
    nodes, m, end = relax.problem.nodes, relax.model, len(relax.core)
    movable = sorted(relax.movable)
    gap = {v: m.NewIntVar(0, end, f"gap{v}") for v in movable}
    need = {}
    for v in sorted(movable, reverse=True):
        terms = [relax.first_read[v]] if v in relax.first_read else []
        for u in relax.users[v]:
            if u not in gap:
                continue
            later = need[u] if nodes[u].output_of == v else gap[u]
            e = m.NewIntVar(0, end, f"e{v}_{u}")
            m.Add(e == later).OnlyEnforceIf(relax.r[u])
            m.Add(e == end).OnlyEnforceIf(relax.r[u].Not())
            terms.append(e)
        need[v] = m.NewIntVar(0, end, f"need{v}")
        m.AddMinEquality(need[v], terms or [end])
    for v in movable:
        op = nodes[v].output_of
        m.Add(gap[v] == need[op if op in need else v])
    return gap


def _storage_interval(relax, R: int, K: int, horizon: int, is_grad: bool, time, add) -> None:
    """Storage R is live from the start (saved) or its recompute (or its op's) to the
    last step that touches it: a core reader, a recompute reading it, the end."""
    m, nodes = relax.model, relax.problem.nodes
    op = nodes[R].output_of
    maker = op if op is not None else R
    kept = relax.kept[R]
    present = m.NewBoolVar(f"live{R}")
    sources = [kept] + [relax.r[v] for v in {R, maker} if v in time]
    for lit in sources:
        m.Add(present >= lit)
    m.Add(present <= sum(sources))
    start = m.NewIntVar(0, horizon, f"start{R}")
    m.Add(start == 0).OnlyEnforceIf(kept)
    if maker in time:
        m.Add(start == time[maker]).OnlyEnforceIf(kept.Not())
    last_terms = [start]
    if is_grad:
        last_terms.append(horizon - 1)
    elif R in relax.use:
        k = relax.use[R][1]
        last_terms.append(k * K + K - 1 if k < len(relax.core) else horizon - 1)
    members = relax.members[R]
    # a re-run of R's op writes a second buffer (``rw``): it does not read R
    touchers = {u for v in members for u in relax.users[v]} | set(members) - {R}
    for u in sorted(touchers):
        if u in time:
            t = m.NewIntVar(-1, horizon, f"touch{R}_{u}")
            m.Add(t == time[u]).OnlyEnforceIf(relax.r[u])
            m.Add(t == -1).OnlyEnforceIf(relax.r[u].Not())
            last_terms.append(t)
    last = m.NewIntVar(0, horizon, f"last{R}")
    m.AddMaxEquality(last, last_terms)
    size = m.NewIntVar(0, horizon, f"size{R}")
    add(start, size, last + 1, present, nodes[R].bytes, f"live{R}")


def add_point(relax, k: int, x: int | None = None) -> bool:
    """The backward's memory at one step, exactly: during core step k, or (``x``)
    while the recompute x runs in the gap before core step k, in every plan that
    places it there. A cut every plan satisfies, added where an answer overflowed
    (the prefix chains miss recomputes pulled early by recomputed consumers, saved
    values read late by recomputes, and what a gap holds while its recomputes run).
    Returns False if the point is already there."""
    key = k if x is None else (k, x)
    if key in relax.points:
        return False
    relax.points.add(key)
    m, nodes, terms = relax.model, relax.problem.nodes, []
    rank = None if x is None else relax.problem.rank[x]
    for R in sorted(relax.kept):
        if nodes[R].bytes:
            live = _live_at(relax, R, k, rank)
            if live is not None:
                terms.append(nodes[R].bytes * live)
    if x is None:
        if terms:  # (without, the chains already hold the backward's own bytes under it)
            m.Add(sum(terms) <= relax.limit - relax.base_live[k])
        return True
    # x's own buffers and scratch, on what the backward alone holds in the gap
    made = nodes[x].workspace + sum(size for _, size in relax.problem.allocations[x])
    # (the exact "needed by" literals: ``_placed``'s are only bounded from below)
    here = [relax.r[x], _early_by(relax, x, k)]
    if k > 0:
        here.append(_early_by(relax, x, k - 1).Not())
    m.Add(sum(terms) <= relax.limit - relax.across[k] - made).OnlyEnforceIf(here)
    return True


def _live_at(relax, R: int, k: int, rank: int | None = None):
    """A literal true in every plan where forward storage R is live during core step
    k (or None if it never is): made by then (saved, or its op recomputed in a gap
    <= k) and touched later (a core reader at >= k, or a recompute in a gap > k).
    With ``rank``: while the recompute of that rank runs in the gap before core step
    k instead, where "by then" and "later" split that gap by rank (``schedule`` runs
    each gap in rank order)."""
    m, nodes, movable = relax.model, relax.problem.nodes, relax.movable
    op = nodes[R].output_of
    maker = op if op is not None else R
    made = [relax.kept[R]]
    by = _relative(relax, maker, k, rank, by=True) if maker in movable else None
    if by is not None:
        made.append(by)
    if relax.use.get(R, (0, -1))[1] >= k:
        later = None  # a core step at or after k reads it
    else:
        members = relax.members[R]
        readers = {u for v in members for u in relax.users[v]} - set(members)
        touchers = readers | set(members) - {R}  # not its op: a re-run writes anew
        later_lits = [
            _relative(relax, u, k, rank, by=False) for u in sorted(touchers) if u in movable
        ]
        if not later_lits:
            return None
        later = m.NewBoolVar(f"later{R}_{k}_{rank}")
        for lit in later_lits:
            m.Add(later >= lit)
        relax.derive(later, lambda x: max(x[lit] for lit in later_lits))
    live = m.NewBoolVar(f"live{R}_{k}_{rank}")
    # Where R's own op makes it, "kept" and "recomputed by then" exclude each other
    # (a saved member forbids re-running R: ``Relaxation._structure``), so their max
    # is their sum in every plan; given the sum, the LP cannot count an R half saved
    # and half recomputed as half live (see docs/solver-notes.md, "Adopted": a
    # point's liveness)
    for lit in [sum(made)] if maker == R else made:
        m.Add(live >= lit if later is None else live >= lit + later - 1)
    if later is not None and R not in relax.use:
        # R is read by recomputes only: kept, a recompute needs it, so it is dead at
        # k only if one of its readers ran by then. In the LP ``kept + later - 1``
        # is 0 for an R half kept and half read later; this keeps it half live
        # (see docs/solver-notes.md, "Adopted": LP-binding points)
        ran = [_relative(relax, u, k, rank, by=True) for u in sorted(readers) if u in movable]
        m.Add(live >= relax.kept[R] - sum(lit for lit in ran if lit is not None))
    relax.derive(live, lambda x: max(x[lit] for lit in made) and (later is None or x[later]))
    return live


def _relative(relax, u: int, k: int, rank: int | None, *, by: bool):
    """A literal: u is recomputed and runs by (``by``) or after core step k (``rank``
    None), or the recompute of that rank in the gap before core step k (u itself too:
    it reads its inputs then). None where it never can."""
    if rank is None or relax.problem.rank[u] < rank:
        return _placed(relax, u, k, by=by)
    if k == 0:  # every gap is at or after the first
        return None if by else relax.r[u]
    return _placed(relax, u, k - 1, by=by)


def _placed(relax, v: int, k: int, *, by: bool):
    """A literal: v is recomputed and runs before core step k (``by``), or after it.
    "before" is exact (``_live_at``'s cut for storages read by recomputes needs its
    upper side); "after" is only bounded from below (only that side is used).
    Made once per (v, k, by): v may touch several storages live at k."""
    if (v, k, by) in relax.placed:
        return relax.placed[v, k, by]
    early = _early_by(relax, v, k)
    lit = relax.placed[v, k, by] = relax.model.NewBoolVar(f"{'by' if by else 'after'}{v}_{k}")
    r = relax.r[v]
    if by:
        relax.model.Add(lit >= r + early - 1)
        relax.model.AddImplication(lit, r)
        relax.model.AddImplication(lit, early)
        relax.derive(lit, lambda x: x[r] and x[early])
    else:
        relax.model.Add(lit >= r - early)
        relax.derive(lit, lambda x: x[r] and not x[early])
    return lit


def _early_by(relax, v: int, k: int):
    """``gap[v] <= k`` as a literal, by the recursion that defines the gap (see
    ``_placement``): read by core step k, or needed by a recomputed consumer placed
    by then. Booleans only, not the gap integers (see docs/solver-notes.md,
    "Adopted": points as booleans)."""
    op = relax.problem.nodes[v].output_of
    return _needed_by(relax, op if op in relax.movable else v, k)


def _needed_by(relax, v: int, k: int):
    """``need[v] <= k`` (see ``_placement``), made for v's recomputable consumers
    first (iteratively: chains run thousands of nodes deep)."""
    early, stack = relax.needed, [v]
    while stack:
        x = stack[-1]
        if (x, k) in early:
            stack.pop()
            continue
        if relax.first_read.get(x, NEVER) <= k:
            early[x, k] = relax.model.NewConstant(1)
            relax.derive(early[x, k], lambda _: 1)
            stack.pop()
            continue
        sooner = [_sooner_key(relax, x, u) for u in relax.users[x] if u in relax.movable]
        todo = [y for y in sooner if (y, k) not in early]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        early[x, k] = _any_pull(relax, x, k, sooner)
    return early[v, k]


def _sooner_key(relax, v: int, u: int) -> int:
    """Whose need places consumer u: its own op's, unless u is one of v's outputs."""
    op = relax.problem.nodes[u].output_of
    if op == v:
        return u
    return op if op in relax.movable else u


def _any_pull(relax, v: int, k: int, sooner: list[int]):
    """A literal: some recomputed consumer of v is needed by core step k (``sooner``:
    whose need places each), so v's recompute is too."""
    m, pulls = relax.model, []
    users = (u for u in relax.users[v] if u in relax.movable)
    for u, y in zip(users, sooner, strict=True):
        pull, r, sooner_lit = m.NewBoolVar(f"pull{v}_{u}_{k}"), relax.r[u], relax.needed[y, k]
        m.AddBoolAnd([r, sooner_lit]).OnlyEnforceIf(pull)
        m.AddBoolOr([r.Not(), sooner_lit.Not(), pull])
        relax.derive(pull, lambda x, r=r, e=sooner_lit: x[r] and x[e])
        pulls.append(pull)
    lit = m.NewBoolVar(f"early{v}_{k}")
    if pulls:  # lit == max(pulls), as clauses, so that both LPs see ``lit <= sum(pulls)``
        # (see docs/solver-notes.md, "Adopted": LP-binding points)
        for pull in pulls:
            m.AddImplication(pull, lit)
        m.AddBoolOr([lit.Not(), *pulls])
    else:
        m.Add(lit == 0)
    relax.derive(lit, lambda x: max((x[p] for p in pulls), default=0))
    return lit


def add_points(relax, plan, count: int) -> int:
    """Make the worst ``count`` backward steps where ``plan`` overflows exact in ``relax``
    (those not exact yet). Returns how many were added."""
    added = 0
    for step in _overflowing_steps(relax, plan):
        if added == count:
            break
        added += add_point(relax, *step)
    return added


def _overflowing_steps(relax, plan) -> list[tuple]:
    """The backward steps of ``plan`` over the budget, as ``add_point`` names them:
    core steps ``(k,)`` first, then ``(k, x)`` for the recompute x in the gap before
    core step k; each kind worst first. A recompute's point holds only where x runs
    there, so its LP is weaker: core steps go first (see docs/solver-notes.md,
    "Adopted": points at recompute steps)."""
    over, k = [], 0
    for phase, node, live in plan.timeline.steps:
        if phase != "bwd":
            continue
        if node in relax.pos:
            step = (relax.pos[node],)
            k = relax.pos[node] + 1  # recomputes from here run in the gap before the next
        else:
            step = (k, node)
        if live > relax.limit:
            over.append((len(step) == 1, live, step))
    return [step for *_, step in sorted(over, reverse=True)]
