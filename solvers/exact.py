"""Where ``Relaxation`` follows ``schedule``'s placement exactly.

- the **exact backward** (``_exact_backward``, with ``exact=True``): every backward
  step, as one cumulative over the schedule's own order;
- **exact points** (``add_point``), added between solves where an answer overflowed:
  the backward's memory during one core step, or while one recompute runs in its gap,
  exactly, with booleans for "recomputed by then" that follow ``schedule``'s placement
  (the chains miss recomputes pulled early by recomputed consumers, saved values read
  late only by recomputes, and what a gap holds while its recomputes run).

Methods of ``Relaxation`` (a mixin): they read what ``Relaxation.__init__`` sets up,
the model, its ``s``, ``r`` and ``kept`` variables, the core's timings, and ``_derive``
for the hints.
"""

from __future__ import annotations

import math

NEVER = math.inf  # no core position: a value no plan needs placed


class Exact:
    """The exact layers of ``Relaxation``'s model."""

    def _exact_backward(self, n_core: int) -> None:
        """The backward's memory at every step, exactly, as one cumulative constraint.

        Time: core position k is ``k*K + N``; a recompute x in the gap before it is
        ``k*K + rank[x]`` (``schedule`` orders each gap by rank). A recompute's gap is
        the first core position that needs it: ``gap[v] = min(first read, gap of each
        recomputed consumer)`` (a multi-output op: its recomputed outputs' need).
        A storage's interval runs from when it is allocated (the start, if saved) to
        the last step touching it; the backward's own values are a fixed profile.
        """
        problem, m = self.problem, self.model
        nodes, parts, rank = problem.nodes, problem.outputs_of, problem.rank
        storage = problem.storage
        n = len(nodes)
        K = n + 1
        horizon = (n_core + 1) * K
        self.gap: dict = {}  # node -> core position its recompute runs before
        movable = self._placement()
        self.time = {v: self.gap[v] * K + rank[v] for v in movable}

        intervals, demands = [], []

        def add(start, size, end_, present, demand, name):
            if demand <= 0:
                return
            if present is None:
                intervals.append(m.NewFixedSizeIntervalVar(start, size, name))
            else:
                intervals.append(m.NewOptionalIntervalVar(start, size, end_, present, name))
            demands.append(demand)

        lives = [*self.base_live, None]
        for k, (across, live) in enumerate(zip(self.across, lives, strict=True)):
            add(k * K, n, None, None, across, f"gap{k}")
            if live is not None:
                add(k * K + n, 1, None, None, live, f"core{k}")
        grads = {storage[g] for g in problem.grads}
        for R in sorted(self.kept):
            if nodes[R].bytes:
                self._storage_interval(R, K, horizon, R in grads, add)
        for x in movable:
            scratch = nodes[x].workspace
            if scratch:
                add(self.time[x], 1, self.time[x] + 1, self.r[x], scratch, f"ws{x}")
            for p in parts[x]:
                if p not in self.kept:  # an output nobody needs: live at the op's step only
                    add(self.time[x], 1, self.time[x] + 1, self.r[x], nodes[p].bytes, f"tmp{p}")
                elif nodes[p].bytes:  # a re-run op rewrites a saved output: a second buffer
                    both = m.NewBoolVar(f"rewrite{p}")
                    m.Add(both >= self.r[x] + self.kept[p] - 1)
                    add(self.time[x], 1, self.time[x] + 1, both, nodes[p].bytes, f"rw{p}")
        m.AddCumulative(intervals, demands, self.limit)

    def _placement(self) -> list[int]:
        """``gap[v]``: the core position a recompute of v runs before, as ``schedule``
        places it: ``min(first read, gap of each recomputed consumer)`` (a multi-output
        op: its recomputed outputs' need). Returns the nodes that have one."""
        nodes, m, end = self.problem.nodes, self.model, len(self.core)
        movable = sorted(self._movable)
        for v in movable:
            self.gap[v] = m.NewIntVar(0, end, f"gap{v}")
        need = {}
        for v in sorted(movable, reverse=True):
            terms = [self.first_read[v]] if v in self.first_read else []
            for u in self.users[v]:
                if u not in self.gap:
                    continue
                later = need[u] if nodes[u].output_of == v else self.gap[u]
                e = m.NewIntVar(0, end, f"e{v}_{u}")
                m.Add(e == later).OnlyEnforceIf(self.r[u])
                m.Add(e == end).OnlyEnforceIf(self.r[u].Not())
                terms.append(e)
            need[v] = m.NewIntVar(0, end, f"need{v}")
            m.AddMinEquality(need[v], terms or [end])
        for v in movable:
            op = nodes[v].output_of
            m.Add(self.gap[v] == need[op if op in need else v])
        return movable

    def _storage_interval(self, R: int, K: int, horizon: int, is_grad: bool, add) -> None:
        """Storage R is live from the start (saved) or its recompute (or its op's) to the
        last step that touches it: a core reader, a recompute reading it, the end."""
        problem, m = self.problem, self.model
        nodes = problem.nodes
        op = nodes[R].output_of
        maker = op if op is not None else R
        kept = self.kept[R]
        present = m.NewBoolVar(f"live{R}")
        sources = [kept] + [self.r[v] for v in {R, maker} if v in self.time]
        for lit in sources:
            m.Add(present >= lit)
        m.Add(present <= sum(sources))
        start = m.NewIntVar(0, horizon, f"start{R}")
        m.Add(start == 0).OnlyEnforceIf(kept)
        if maker in self.time:
            m.Add(start == self.time[maker]).OnlyEnforceIf(kept.Not())
        last_terms = [start]
        if is_grad:
            last_terms.append(horizon - 1)
        elif R in self.use:
            k = self.use[R][1]
            last_terms.append(k * K + K - 1 if k < len(self.core) else horizon - 1)
        members = self.members[R]
        # a re-run of R's op writes a second buffer (``rw``): it does not read R
        touchers = {u for v in members for u in self.users[v]} | set(members) - {R}
        for u in sorted(touchers):
            if u in self.time:
                t = m.NewIntVar(-1, horizon, f"touch{R}_{u}")
                m.Add(t == self.time[u]).OnlyEnforceIf(self.r[u])
                m.Add(t == -1).OnlyEnforceIf(self.r[u].Not())
                last_terms.append(t)
        last = m.NewIntVar(0, horizon, f"last{R}")
        m.AddMaxEquality(last, last_terms)
        size = m.NewIntVar(0, horizon, f"size{R}")
        add(start, size, last + 1, present, nodes[R].bytes, f"live{R}")

    def add_point(self, k: int, x: int | None = None) -> bool:
        """The backward's memory at one step, exactly: during core step k, or (``x``)
        while the recompute x runs in the gap before core step k, in every plan that
        places it there. A cut every plan satisfies, added where an answer overflowed
        (the prefix chains miss recomputes pulled early by recomputed consumers, saved
        values read late by recomputes, and what a gap holds while its recomputes run).
        Returns False if the point is already there."""
        key = k if x is None else (k, x)
        if key in self.points:
            return False
        self.points.add(key)
        m, nodes, terms = self.model, self.problem.nodes, []
        rank = None if x is None else self.problem.rank[x]
        for R in sorted(self.kept):
            if nodes[R].bytes:
                live = self._live_at(R, k, rank)
                if live is not None:
                    terms.append(nodes[R].bytes * live)
        if x is None:
            if terms:  # (without, the chains already hold the backward's own bytes under it)
                m.Add(sum(terms) <= self.limit - self.base_live[k])
            return True
        # x's own buffers and scratch, on what the backward alone holds in the gap
        made = nodes[x].workspace + sum(size for _, size in self.problem.allocations[x])
        # (the exact "needed by" literals: ``_placed``'s are only bounded from below)
        here = [self.r[x], self._early_by(x, k)]
        if k > 0:
            here.append(self._early_by(x, k - 1).Not())
        m.Add(sum(terms) <= self.limit - self.across[k] - made).OnlyEnforceIf(here)
        return True

    def _live_at(self, R: int, k: int, rank: int | None = None):
        """A literal true in every plan where forward storage R is live during core step
        k (or None if it never is): made by then (saved, or its op recomputed in a gap
        <= k) and touched later (a core reader at >= k, or a recompute in a gap > k).
        With ``rank``: while the recompute of that rank runs in the gap before core step
        k instead, where "by then" and "later" split that gap by rank (``schedule`` runs
        each gap in rank order)."""
        m, nodes = self.model, self.problem.nodes
        op = nodes[R].output_of
        maker = op if op is not None else R
        made = [self.kept[R]]
        by = self._relative(maker, k, rank, by=True) if maker in self._movable else None
        if by is not None:
            made.append(by)
        if self.use.get(R, (0, -1))[1] >= k:
            later = None  # a core step at or after k reads it
        else:
            members = self.members[R]
            readers = {u for v in members for u in self.users[v]} - set(members)
            touchers = readers | set(members) - {R}  # not its op: a re-run writes anew
            later_lits = [
                self._relative(u, k, rank, by=False) for u in sorted(touchers) if u in self._movable
            ]
            if not later_lits:
                return None
            later = m.NewBoolVar(f"later{R}_{k}_{rank}")
            for lit in later_lits:
                m.Add(later >= lit)
            self._derive(later, lambda x: max(x[lit] for lit in later_lits))
        live = m.NewBoolVar(f"live{R}_{k}_{rank}")
        # Where R's own op makes it, "kept" and "recomputed by then" exclude each other
        # (a saved member forbids re-running R: ``_structure``), so their max is their
        # sum in every plan; given the sum, the LP cannot count an R half saved and half
        # recomputed as half live (see docs/solver-notes.md, "Adopted": a point's liveness)
        for lit in [sum(made)] if maker == R else made:
            m.Add(live >= lit if later is None else live >= lit + later - 1)
        if later is not None and R not in self.use:
            # R is read by recomputes only: kept, a recompute needs it, so it is dead at
            # k only if one of its readers ran by then. In the LP ``kept + later - 1``
            # is 0 for an R half kept and half read later; this keeps it half live
            # (see docs/solver-notes.md, "Adopted": LP-binding points)
            ran = [
                self._relative(u, k, rank, by=True) for u in sorted(readers) if u in self._movable
            ]
            m.Add(live >= self.kept[R] - sum(lit for lit in ran if lit is not None))
        self._derive(live, lambda x: max(x[lit] for lit in made) and (later is None or x[later]))
        return live

    def _relative(self, u: int, k: int, rank: int | None, *, by: bool):
        """A literal: u is recomputed and runs by (``by``) or after core step k (``rank``
        None), or the recompute of that rank in the gap before core step k (u itself too:
        it reads its inputs then). None where it never can."""
        if rank is None or self.problem.rank[u] < rank:
            return self._placed(u, k, by=by)
        if k == 0:  # every gap is at or after the first
            return None if by else self.r[u]
        return self._placed(u, k - 1, by=by)

    def _placed(self, v: int, k: int, *, by: bool):
        """A literal: v is recomputed and runs before core step k (``by``), or after it.
        "before" is exact (``_live_at``'s cut for storages read by recomputes needs its
        upper side); "after" is only bounded from below (only that side is used).
        Made once per (v, k, by): v may touch several storages live at k."""
        if (v, k, by) in self._placed_lits:
            return self._placed_lits[v, k, by]
        early = self._early_by(v, k)
        lit = self._placed_lits[v, k, by] = self.model.NewBoolVar(
            f"{'by' if by else 'after'}{v}_{k}"
        )
        r = self.r[v]
        if by:
            self.model.Add(lit >= r + early - 1)
            self.model.AddImplication(lit, r)
            self.model.AddImplication(lit, early)
            self._derive(lit, lambda x: x[r] and x[early])
        else:
            self.model.Add(lit >= r - early)
            self._derive(lit, lambda x: x[r] and not x[early])
        return lit

    def _early_by(self, v: int, k: int):
        """``gap[v] <= k`` as a literal, by the recursion that defines the gap (see
        ``_placement``): read by core step k, or needed by a recomputed consumer placed
        by then. Booleans only, not the gap integers (see docs/solver-notes.md,
        "Adopted": points as booleans)."""
        op = self.problem.nodes[v].output_of
        return self._needed_by(op if op in self._movable else v, k)

    def _needed_by(self, v: int, k: int):
        """``need[v] <= k`` (see ``_placement``), made for v's recomputable consumers
        first (iteratively: chains run thousands of nodes deep)."""
        early, stack = self._early, [v]
        while stack:
            x = stack[-1]
            if (x, k) in early:
                stack.pop()
                continue
            if self.first_read.get(x, NEVER) <= k:
                early[x, k] = self.model.NewConstant(1)
                self._derive(early[x, k], lambda _: 1)
                stack.pop()
                continue
            sooner = [self._sooner_key(x, u) for u in self.users[x] if u in self._movable]
            todo = [y for y in sooner if (y, k) not in early]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            early[x, k] = self._any_pull(x, k, sooner)
        return early[v, k]

    def _sooner_key(self, v: int, u: int) -> int:
        """Whose need places consumer u: its own op's, unless u is one of v's outputs."""
        op = self.problem.nodes[u].output_of
        if op == v:
            return u
        return op if op in self._movable else u

    def _any_pull(self, v: int, k: int, sooner: list[int]):
        m, pulls = self.model, []
        for u, y in zip((u for u in self.users[v] if u in self._movable), sooner, strict=True):
            pull, r, sooner_lit = m.NewBoolVar(f"pull{v}_{u}_{k}"), self.r[u], self._early[y, k]
            m.AddBoolAnd([r, sooner_lit]).OnlyEnforceIf(pull)
            m.AddBoolOr([r.Not(), sooner_lit.Not(), pull])
            self._derive(pull, lambda x, r=r, e=sooner_lit: x[r] and x[e])
            pulls.append(pull)
        lit = m.NewBoolVar(f"early{v}_{k}")
        if pulls:  # lit == max(pulls), as clauses, so that both LPs see ``lit <= sum(pulls)``
            # (see docs/solver-notes.md, "Adopted": LP-binding points)
            for pull in pulls:
                m.AddImplication(pull, lit)
            m.AddBoolOr([lit.Not(), *pulls])
        else:
            m.Add(lit == 0)
        self._derive(lit, lambda x: max((x[p] for p in pulls), default=0))
        return lit
