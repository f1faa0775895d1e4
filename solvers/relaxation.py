"""The CP-SAT model behind the ``cpsat`` solver: a relaxation of the real schedule's memory.

Variables, for the forward values the backward may need (everything else is fixed):

- ``s[v]``: v is saved (handed from the forward to the backward);
- ``r[v]``: v is recomputed in the backward;
- ``f[v]``: v runs in the forward (constant for what the outputs need);
- ``kept[R]``: storage R stays allocated from the forward into the backward.

The constraints make ``(s, r)`` exactly what ``schedule`` derives from a saved set:
a value the backward reads is saved or recomputed, a recomputed value's inputs are
too, nothing nobody needs is saved or recomputed, random ops are never recomputed,
and a storage that stays allocated anyway (a caller-held output, the base of a saved
view) is never rebuilt. So every saved set has exactly one assignment, its
*canonical* one, and the objective is its recompute cost (costs floored to integers,
which keeps the bound a bound).

Memory, two layers:

- a **lower bound** of the simulator's, checked at points that exist in every plan:
  each forward step the outputs need, each backward step the gradients need, each
  recompute's own step, the backward's first step. Lifetimes are what every plan
  guarantees: a saved storage lives until its last backward reader, a recomputed one
  at least from its first to its last, and earlier when a recomputed consumer needs
  it earlier. The sums run as prefix chains (one integer per step, O(n) terms), the
  encoding CP-SAT solves fastest (docs/solver-notes.md). Alone (``exact=False``) this
  is a linear relaxation whose optimum bounds every plan's cost;
- the **exact backward** (``_exact_backward``): every backward step, as one cumulative
  over the schedule's own order. The forward stays a lower bound.
- **exact points** (``add_point``), added between solves where an answer overflowed:
  the backward's memory during one core step, or while one recompute runs in its gap,
  exactly, with booleans for "recomputed by then" that follow ``schedule``'s placement
  (the chains miss recomputes pulled early by recomputed consumers, saved values read
  late only by recomputes, and what a gap holds while its recomputes run).

Every feasible plan's canonical assignment satisfies the model, so the model's
optimum bounds the true optimum from below. The solver checks each answer with the
simulator; where the forward was too loose, ``explain`` names the saved values that
provably overflow it together, and the solver forbids them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from ortools.sat.python import cp_model

from .graph import reachable
from .plan import Plan, evaluate
from .problem import Problem, free_views, without_free_views
from .schedule import _backward_core, _forward_program
from .simulate import _run

COST_RESOLUTION = 10**6  # the costliest node is worth this many integer units
NEVER = math.inf


def _chain(model: cp_model.CpModel, upper: int, name: str, length: int, deltas: dict):
    """A running sum over positions, ``value[k] = value[k-1] + sum(deltas[k])``, as
    CP-SAT integers made only where it changes. Returns the per-position variables
    and their definitions ``(var, [(coef, var)])``."""
    values, defs, current = [], [], None
    for k in range(length):
        terms = list(deltas.get(k, ()))
        if terms or current is None:
            var = model.NewIntVar(0, upper, f"{name}{k}")
            terms = ([] if current is None else [(1, current)]) + terms
            model.Add(var == sum(c * x for c, x in terms))
            defs.append((var, terms))
            current = var
        values.append(current)
    return values, defs


class Relaxation:
    """The model for one (problem, budget); cuts are added between solves.

    ``exact=False`` leaves out the exact backward (a cumulative over every step):
    the rest is a pure linear relaxation CP-SAT often solves to optimality fast,
    and its optimum is a valid lower bound on every plan's cost.
    """

    def __init__(self, problem: Problem, budget: int, *, exact: bool = True) -> None:
        self.problem, self.budget, self.exact = problem, budget, exact
        nodes, storage = problem.nodes, problem.storage
        core, reads = _backward_core(problem)
        self.core, self.reads = core, frozenset(reads)
        self.pos = {c: k for k, c in enumerate(core)}
        n_core = len(core)
        self.held = {storage[i] for i in problem.outputs}
        self.relevant = self._relevant(reads)
        self.members: dict[int, list[int]] = {}  # storage root -> relevant nodes sharing it
        for v in sorted(self.relevant):
            self.members.setdefault(storage[v], []).append(v)
        self._timings(core)
        self.free_views = free_views(problem) & self.relevant
        self.base_order = _forward_program(problem, frozenset())
        self.in_base = frozenset(self.base_order)

        m = self.model = cp_model.CpModel()
        self.points: set = set()  # core steps k and recomputes (k, x) made exact (``add_point``)
        self._early: dict = {}  # (node, k) -> its recompute is needed by core step k
        self._derived: list = []  # (var, values -> its value), in the order made: hints
        self._placed_lits: dict = {}  # (node, k, by) -> ``_placed``'s literal
        rel = sorted(self.relevant)
        self.s = {v: m.NewBoolVar(f"s{v}") for v in rel}
        self.r = {v: m.NewBoolVar(f"r{v}") for v in rel}
        self._movable = frozenset(v for v in rel if nodes[v].recomputable)  # may be re-run
        self.f = {v: m.NewBoolVar(f"f{v}") for v in rel if v not in self.in_base}
        roots = sorted({storage[v] for v in rel} - self.held)
        self.kept = {R: m.NewBoolVar(f"kept{R}") for R in roots}
        self._structure()
        self._objective()
        total = sum(n.bytes + n.workspace for n in nodes) + 1
        self.upper = total
        self._forward_memory()
        self._backward_memory(n_core)
        if exact:
            self._exact_backward(n_core)

    # ------------------------------------------------------------------ static facts

    def _relevant(self, reads: list[int]) -> frozenset[int]:
        """Forward values some backward read depends on: the only ones a plan decides."""
        return frozenset(reachable(reads, self.problem.producers))

    def _timings(self, core: list[int]) -> None:
        """Core positions where each value is first read, and where each forward
        storage is first and last used; ``latest[v]``: the latest position a
        recompute of v can be placed at, whatever else is recomputed."""
        problem = self.problem
        nodes, storage = problem.nodes, problem.storage
        end = len(core)  # forward values returned as gradients are placed last
        first_read: dict[int, int] = {}
        use: dict[int, list[int]] = {}

        def touch(j: int, k: int) -> None:
            root = storage[j]
            if nodes[root].phase == "fwd":
                span = use.setdefault(root, [k, k])
                span[0], span[1] = min(span[0], k), max(span[1], k)

        for k, c in enumerate(core):
            for j in nodes[c].inputs:
                if nodes[j].phase == "fwd":
                    first_read.setdefault(j, k)
                touch(j, k)
            touch(c, k)
        for g in problem.grads:
            if nodes[g].phase == "fwd":
                first_read.setdefault(g, end)
                touch(g, end)
        self.first_read, self.use = first_read, use
        self.users = {
            v: [u for u in problem.consumers[v] if u in self.relevant] for v in self.relevant
        }
        latest: dict[int, float] = {}
        for v in sorted(self.relevant, reverse=True):
            if v in first_read:  # placed by then, or earlier for a recomputed consumer
                latest[v] = first_read[v]
            else:  # placed for some recomputed consumer, no later than the latest one
                latest[v] = max((latest[u] for u in self.users[v]), default=NEVER)
        self.latest = latest

    # ------------------------------------------------------------------ constraints

    def _structure(self) -> None:
        """(s, r) is the schedule's: needed values saved or recomputed, nothing else."""
        problem, m = self.problem, self.model
        nodes, storage = problem.nodes, problem.storage
        s, r = self.s, self.r
        for v in sorted(self.relevant):
            node, users = nodes[v], self.users[v]
            m.Add(s[v] + r[v] <= 1)
            if v in self.reads:
                m.Add(s[v] + r[v] == 1)
            else:
                m.Add(s[v] + r[v] <= sum(r[u] for u in users))
            for u in users:
                m.Add(s[v] + r[v] >= r[u])
            if problem.outputs_of[v]:
                m.Add(s[v] == 0)  # a multi-output op hands over its outputs instead
            if v in self.free_views:
                m.Add(s[v] == 0)  # the same plan as saving its base (``free_views``)
            if not node.recomputable or (storage[v] == v and v in self.held):
                m.Add(r[v] == 0)
            root = storage[v]
            if root != v:
                if root in self.r:
                    m.Add(r[root] + s[v] <= 1)  # a saved view keeps its base allocated
            if v in self.f:
                m.Add(self.f[v] >= s[v])
                for u in users:
                    if u in self.f:
                        m.Add(self.f[v] >= self.f[u])
            if root in self.kept:
                m.Add(self.kept[root] >= s[v])
        for R, var in self.kept.items():
            m.Add(var <= sum(s[v] for v in self.members[R]))

    def _objective(self) -> None:
        """Recompute cost of what the forward also runs, floored to integer units."""
        nodes, m = self.problem.nodes, self.model
        top = max((nodes[v].cost for v in self.relevant), default=0.0)
        self.scale = COST_RESOLUTION / top if top > 0 else 1.0
        terms, self.paid = [], {}
        for v in sorted(self.relevant):
            units = math.floor(nodes[v].cost * self.scale)
            if units <= 0 or not nodes[v].recomputable:
                continue
            if v in self.f:
                paid = self.paid[v] = m.NewBoolVar(f"paid{v}")
                m.Add(paid >= self.r[v] + self.f[v] - 1)
                terms.append(units * paid)
            else:
                terms.append(units * self.r[v])
        m.Minimize(sum(terms))

    def _forward_memory(self) -> None:
        """At each step of the forward the outputs need: what it holds with nothing
        saved, plus saved storages it would otherwise have freed by then."""
        problem = self.problem
        nodes, storage, parts = problem.nodes, problem.storage, problem.outputs_of
        order = self.base_order
        run = _run(problem, "fwd", order, (), self.held)
        last, self.forward_made = {}, {}
        for p, i in enumerate(order):
            for j in (*nodes[i].inputs, i, *parts[i]):
                last[storage[j]] = p
            for j in (i, *parts[i]):
                self.forward_made.setdefault(storage[j], p)
        self.forward_last = last
        deltas: dict[int, list] = {}
        for R, var in self.kept.items():
            if R in last:  # allocated with nothing saved: kept past its last use
                start = last[R] + 1
            else:  # runs only to be saved: kept from when it (or its op) runs
                made = nodes[R].output_of if nodes[R].output_of is not None else R
                start = bisect.bisect_right(order, made)  # the forward runs in problem order
            if start < len(order) and nodes[R].bytes:
                deltas.setdefault(start, []).append((nodes[R].bytes, var))
        chain, defs = _chain(self.model, self.upper, "F", len(order), deltas)
        self._derive_sums(defs)
        for p, (_, _, live) in enumerate(run.steps):
            self.model.Add(chain[p] <= self.budget - live)

    def _backward_memory(self, n_core: int) -> None:
        """At each backward step the gradients need: the backward's own values, saved
        storages until their last reader, recomputed ones over the span every plan
        holds them; and at each recompute, its output, inputs and what stays saved."""
        problem, m = self.problem, self.model
        nodes, storage, parts = problem.nodes, problem.storage, problem.outputs_of
        grads = {storage[g] for g in problem.grads}
        run = _run(problem, "bwd", tuple(self.core), tuple(self.held), self.held | grads)
        self.base_live = [live for _, _, live in run.steps]
        self.held_bytes = sum(nodes[R].bytes for R in self.held)

        # saved storages: live from the start until their last core use
        drops: dict[int, list] = {}
        for R, var in self.kept.items():
            if R in self.use and nodes[R].bytes:
                drops.setdefault(0, []).append((nodes[R].bytes, var))
                drops.setdefault(self.use[R][1] + 1, []).append((-nodes[R].bytes, var))
        kept_chain, defs = _chain(m, self.upper, "P", n_core + 1, drops)
        self._derive_sums(defs)

        # recomputed storages: live over [first use, last use], earlier when a
        # recomputed consumer is placed earlier
        deltas: dict[int, list] = {}
        for R in sorted(self.r):
            if storage[R] != R or R not in self.use or not nodes[R].bytes:
                continue
            size, (first, last) = nodes[R].bytes, self.use[R]
            deltas.setdefault(last + 1, []).append((-size, self.r[R]))
            steps = self._earlier_steps(R, first)
            prev = None
            for k, var in steps:
                deltas.setdefault(k, []).append((size, var))
                if prev is not None:
                    deltas[k].append((-size, prev))
                prev = var
            deltas.setdefault(first, []).append((size, self.r[R]))
            if prev is not None:
                deltas[first].append((-size, prev))
        rec_chain, defs = _chain(m, self.upper, "Q", n_core + 1, deltas)
        self._derive_sums(defs)
        for k in range(n_core):
            m.Add(kept_chain[k] + rec_chain[k] <= self.budget - self.base_live[k])
        # at the backward's first step every saved storage is live (each is read later)
        everything = [nodes[R].bytes * var for R, var in self.kept.items() if nodes[R].bytes]
        if everything or self.budget < self.held_bytes:
            m.Add(sum(everything) <= self.budget - self.held_bytes)

        # each recompute's own step: its outputs, its inputs, saved storages read later;
        # and, if no consumer pulls it earlier, what the backward holds in its gap
        across = self.across = self._across()
        for v in sorted(self.r):
            node = nodes[v]
            if self.latest[v] is NEVER or not node.recomputable or node.alias_of is not None:
                continue
            if node.output_of is not None:
                continue
            made = node.bytes + node.workspace + sum(nodes[p].bytes for p in parts[v])
            inputs = sorted({storage[j] for j in node.inputs} - self.held)
            k = int(self.latest[v])
            m.Add(
                self._step_memory(kept_chain, k, inputs) <= self.budget - self.held_bytes - made
            ).OnlyEnforceIf(self.r[v])
            if v in self.first_read and not parts[v]:
                k = self.first_read[v]
                pullers = [self.r[u].Not() for u in self.users[v] if nodes[u].recomputable]
                m.Add(
                    self._step_memory(kept_chain, k, inputs) <= self.budget - across[k] - made
                ).OnlyEnforceIf([self.r[v], *pullers])

    def _step_memory(self, kept_chain: list, k: int, inputs: list[int]):
        """Saved storages read at or after core position k, plus ``inputs`` (live
        however they are made), each counted once."""
        nodes, terms, const = self.problem.nodes, [], 0
        for R in inputs:
            size = nodes[R].bytes
            if R in self.kept and self.use.get(R, (0, -1))[1] >= k:
                terms.append((-size, self.kept[R]))  # already in kept_chain[k] if kept
            const += size
        return kept_chain[k] + sum(c * x for c, x in terms) + const

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
        m.AddCumulative(intervals, demands, self.budget)

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
                m.Add(sum(terms) <= self.budget - self.base_live[k])
            return True
        # x's own buffers and scratch, on what the backward alone holds in the gap
        made = nodes[x].workspace + sum(size for _, size in self.problem.allocations[x])
        # (the exact "needed by" literals: ``_placed``'s are only bounded from below)
        here = [self.r[x], self._early_by(x, k)]
        if k > 0:
            here.append(self._early_by(x, k - 1).Not())
        m.Add(sum(terms) <= self.budget - self.across[k] - made).OnlyEnforceIf(here)
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
            touchers = readers | set(members) - {R}
            if op is not None:
                touchers.add(op)  # re-running its op rewrites R
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
        for lit in made:
            m.Add(live >= lit if later is None else live >= lit + later - 1)
        if later is not None and R not in self.use:
            # R is read by recomputes only: kept, a recompute needs it, so it is dead at
            # k only if one of its readers ran by then. In the LP ``kept + later - 1``
            # is 0 for an R half kept and half read later; this keeps it half live
            # (docs/solver-notes.md)
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
        by then. Booleans only: the gap integers slowed the relaxation 4x."""
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
        if pulls:  # lit == max(pulls), as clauses: the LPs see ``lit <= sum(pulls)`` then,
            # which lin_max hid from both (linear_bound leaves it out; with it the
            # 12-layer gpt's exact points raised no LP bound, docs/solver-notes.md)
            for pull in pulls:
                m.AddImplication(pull, lit)
            m.AddBoolOr([lit.Not(), *pulls])
        else:
            m.Add(lit == 0)
        self._derive(lit, lambda x: max((x[p] for p in pulls), default=0))
        return lit

    def _derive_sums(self, defs: list) -> None:
        """``_derive`` for a chain's ``(var, [(coef, var)])`` definitions."""
        for var, terms in defs:
            self._derive(var, lambda x, terms=terms: sum(c * x[v] for c, v in terms))

    def _derive(self, var, value) -> None:
        """Record how a plan's values give ``var``'s (``value(values)``), for hints:
        a hint CP-SAT must complete itself is often one it cannot use."""
        self._derived.append((var, value))

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
        touchers = {u for v in members for u in self.users[v]} | set(members) - {R}
        if op is not None:
            touchers.add(op)
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

    def _across(self) -> list[int]:
        """Bytes the backward alone holds in each gap (before each core step, and after
        the last): what the previous step left live."""
        problem = self.problem
        nodes, storage, parts = problem.nodes, problem.storage, problem.outputs_of
        keep = self.held | {storage[g] for g in problem.grads}
        last: dict[int, int] = {}
        for k, c in enumerate(self.core):
            for j in (*nodes[c].inputs, c, *parts[c]):
                last[storage[j]] = k
        live = {R: nodes[R].bytes for R in self.held}
        result = []
        for k, c in enumerate(self.core):
            result.append(sum(live.values()))
            if nodes[c].output_of is None:
                for new in (c, *parts[c]):
                    if nodes[new].alias_of is None and nodes[new].phase == "bwd":
                        live[new] = nodes[new].bytes
            for R in [R for R in live if R not in keep and last.get(R, -1) <= k]:
                del live[R]
        result.append(sum(live.values()))
        return result

    def _earlier_steps(self, R: int, first: int) -> list[tuple[int, object]]:
        """Staircase booleans ``(k, a)``: R is recomputed and some recomputed consumer
        of its storage is placed by position k < first, so R is live from k on."""
        storage = self.problem.storage
        by_step: dict[int, list[int]] = {}
        for v in self.members[R]:
            for u in self.users[v]:
                if storage[u] != R and self.latest[u] < first:
                    by_step.setdefault(int(self.latest[u]), []).append(u)
        steps, prev, pulling = [], None, []
        for k in sorted(by_step):
            a = self.model.NewBoolVar(f"a{R}_{k}")
            self.model.Add(a <= self.r[R])
            if prev is not None:
                self.model.Add(a >= prev)
            for u in by_step[k]:
                self.model.Add(a >= self.r[R] + self.r[u] - 1)
            pulling = pulling + by_step[k]
            r, pullers = self.r[R], tuple(self.r[u] for u in pulling)
            self._derive(a, lambda x, r=r, us=pullers: x[r] and any(x[u] for u in us))
            steps.append((k, a))
            prev = a
        return steps

    # ------------------------------------------------------------------ plans <-> model

    def canonical(self, plan: Plan) -> dict:
        """The model's assignment of a plan (of its equivalent without saved free views,
        which has the same peak and cost): its hint, and what the tests check."""
        storage = self.problem.storage
        if plan.saved & self.free_views:
            plan = evaluate(self.problem, without_free_views(self.problem, plan.saved), solver="")
        forward = set(plan.schedule.forward)
        values = {}
        for v in self.relevant:
            values[self.s[v]] = int(v in plan.saved)
            values[self.r[v]] = int(v in plan.recomputed)
        for v, var in self.f.items():
            values[var] = int(v in forward)
        for v, var in self.paid.items():
            values[var] = int(v in forward and v in plan.recomputed)
        kept_roots = {storage[i] for i in plan.saved}
        for R, var in self.kept.items():
            values[var] = int(R in kept_roots)
        for var, value in self._derived:
            values[var] = int(value(values))
        return values

    def hint(self, plan: Plan) -> None:
        self.model.ClearHints()
        for var, value in self.canonical(plan).items():
            self.model.AddHint(var, value)

    def saved_set(self, value: Callable[[cp_model.IntVar], float]) -> frozenset[int]:
        """The values an answer saves: ``value`` reads a variable (``solver.Value``), or
        an LP's fractional answer, rounded at one half."""
        return frozenset(v for v, var in self.s.items() if value(var) >= 0.5)

    # ------------------------------------------------------------------ cuts

    def explain(self, plan: Plan) -> list | None:
        """Decisions of ``plan`` that overflow the budget in *every* plan sharing them.

        Only the forward needs this (the backward is exact): at the plan's forward
        peak t, what every forward holds there, plus storages this one holds only
        because of a saved value, each pinned by that value's saved literal: a saved
        storage, or one that a node run only to compute a saved value touches at or
        after t (the relaxation's forward chains miss those temporaries). Returns the
        fewest literals whose bytes, with the rest and t's scratch, exceed the budget
        (``[]``: every plan does); None if the forward fits.
        """
        if plan.timeline.peak_phase != "fwd":
            return None
        return self._explain_forward(plan)

    def _explain_forward(self, plan: Plan) -> list | None:
        problem = self.problem
        nodes, t = problem.nodes, plan.timeline.peak_node
        order = plan.schedule.forward
        at = order.index(t)
        last = {}  # storage -> position of its last toucher in this forward
        for q, v in enumerate(order):
            for R in problem.touches[v]:
                last[R] = q
        forcing = self._forcing_literals(plan)
        lits, total = [], nodes[t].workspace
        if t not in self.in_base:  # t itself runs only for a saved value: always pinned
            if t not in forcing:
                return None
            lits.append(forcing[t])
        pins: dict[int, list] = {}  # literal index -> [bytes it pins, literal]
        for R in sorted(plan.timeline.live_at_peak):
            if self._live_in_every_forward(R, t):
                total += nodes[R].bytes
                continue
            lit = self._kept_literal(plan, R)
            if lit is None and last.get(R, -1) >= at:
                lit = forcing.get(order[last[R]])
            if lit is not None:
                pins.setdefault(lit.Index(), [0, lit])[0] += nodes[R].bytes
        for lit in lits:
            total += pins.pop(lit.Index(), [0])[0]
        # the fewest literals that still overflow: the cut then forbids the most plans
        for size, lit in sorted(pins.values(), key=lambda pin: (-pin[0], pin[1].Index())):
            if total > self.budget:
                break
            total += size
            lits.append(lit)
        return lits if total > self.budget else None

    def _live_in_every_forward(self, R: int, t: int) -> bool:
        """Storage R is live while node t runs in every forward: the forward without
        saved values (which every forward runs, in problem order) holds it then."""
        if R not in self.forward_made:
            return False
        made = self.base_order[self.forward_made[R]]
        return made <= t and (R in self.held or self.base_order[self.forward_last[R]] >= t)

    def _forcing_literals(self, plan: Plan) -> dict:
        """For each node ``plan``'s forward runs beyond the forward without saved values:
        the saved literal of the lowest saved value whose computation runs it. One walk
        in all: a node already claimed had its inputs claimed by a lower value."""
        forcing: dict = {}

        def claimed(i: int) -> bool:
            return i in forcing or i in self.in_base

        for v in sorted(plan.saved):
            if v in self.s:
                for i in reachable((v,), self.problem.producers, claimed):
                    forcing[i] = self.s[v]
        return forcing

    def _kept_literal(self, plan: Plan, R: int):
        saved = [v for v in sorted(plan.saved) if self.problem.storage[v] == R and v in self.s]
        return self.s[saved[0]] if saved else None

    def forbid(self, literals: list) -> None:
        """Never take all of ``literals`` together again."""
        self.model.AddBoolOr([lit.Not() for lit in literals])

    def forbid_saved_set(self, saved: frozenset[int]) -> None:
        """The weakest cut: never this exact saved set again."""
        self.model.AddBoolOr(
            [self.s[v].Not() for v in sorted(saved) if v in self.s]
            + [self.s[v] for v in sorted(self.s) if v not in saved]
        )
