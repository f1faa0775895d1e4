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
*canonical* one, and the objective is its cost, recompute plus save seconds (floored
to integers, which keeps the bound a bound).

Memory, in layers:

- a **lower bound** of the simulator's, checked at points that exist in every plan:
  each forward step the outputs need, each backward step the gradients need, each
  recompute's own step, the backward's first step. Lifetimes are what every plan
  guarantees: a saved storage lives until its last backward reader, a recomputed one
  at least from its first to its last, and earlier when a recomputed consumer needs
  it earlier. The sums run as prefix chains (one integer per step, O(n) terms), the
  encoding CP-SAT solves fastest (see docs/solver-notes.md, "Adopted"). Alone
  (``exact=False``) this is a linear relaxation whose optimum bounds every plan's cost;
- the **exact backward** and **exact points** (``exact``): every backward step as one
  cumulative over the schedule's own order, and single steps made exact between
  solves where an answer overflowed. The forward stays a lower bound;
- **forward cuts** (``cuts``): saved values that provably overflow the forward
  together, forbidden after the simulator finds an answer overflowing there.

Every feasible plan's canonical assignment satisfies the model, so the model's
optimum bounds the true optimum from below.

Three modules, one job each: this one builds the model (variables, structure,
objective, the lower bound) and holds what the others read, and maps plans to
assignments (hints, and what the tests check); ``exact`` adds the exact backward and
the exact points, ``cuts`` the forward cuts, as functions of a ``Relaxation``.

Prior art, and what this model takes from it:

- Checkmate (Jain et al., MLSys 2020): a MILP over a recompute schedule, its LP
  relaxation rounded to a plan; here the saved set alone decides, O(n) variables.
- Moccasin (Bartan et al., ICML 2023): CP-SAT, a retention interval per value, O(n)
  variables; here the exact backward's cumulative, placed by ``schedule``, not free
  (free placement did not scale: docs/solver-notes.md, "Adopted": prefix-sum chains).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from ortools.sat.python import cp_model

from .exact import NEVER, add_exact_backward
from .graph import reachable
from .plan import Plan, evaluate
from .problem import Problem, free_views, without_free_views
from .schedule import _backward_core, _forward_program
from .simulate import _run

COST_RESOLUTION = 10**6  # the costliest node is worth this many integer units


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
    """The model for one (problem, limit); points and cuts are added between solves
    (``exact.add_point``, ``cuts.forbid``), by functions that read its attributes.

    ``exact=False`` leaves out the exact backward (a cumulative over every step):
    the rest is a pure linear relaxation CP-SAT often solves to optimality fast,
    and its optimum is a valid lower bound on every plan's cost.
    """

    def __init__(self, problem: Problem, limit: int, *, exact: bool = True) -> None:
        self.problem, self.limit, self.exact = problem, limit, exact
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
        self.needed: dict = {}  # (node, k) -> its recompute is needed by core step k
        self.placed: dict = {}  # (node, k, by) -> it is recomputed by / after core step k
        self._derived: list = []  # (var, values -> its value), in the order made: hints
        rel = sorted(self.relevant)
        self.s = {v: m.NewBoolVar(f"s{v}") for v in rel}
        self.r = {v: m.NewBoolVar(f"r{v}") for v in rel}
        self.movable = frozenset(v for v in rel if nodes[v].recomputable)  # may be re-run
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
            add_exact_backward(self)

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
        """Recompute cost of what the forward also runs plus the save cost of each kept
        storage (``Plan.cost``), floored to integer units."""
        nodes, m = self.problem.nodes, self.model
        top = max(
            max((nodes[v].cost for v in self.relevant), default=0.0),
            max((nodes[R].save_cost for R in self.kept), default=0.0),
        )
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
        for R, kept in self.kept.items():
            units = math.floor(nodes[R].save_cost * self.scale)
            if units > 0:
                terms.append(units * kept)
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
            self.model.Add(chain[p] <= self.limit - live)

    def _backward_memory(self, n_core: int) -> None:
        """At each backward step the gradients need: the backward's own values, saved
        storages until their last reader, recomputed ones over the span every plan
        holds them; and at each recompute, its output, inputs and what stays saved."""
        problem, m = self.problem, self.model
        nodes, storage = problem.nodes, problem.storage
        grads = {storage[g] for g in problem.grads}
        run = _run(problem, "bwd", tuple(self.core), tuple(self.held), self.held | grads)
        self.base_live = [live for _, _, live in run.steps]
        self.held_bytes = sum(nodes[R].bytes for R in self.held)
        kept_chain = self._saved_chain(n_core)
        rec_chain = self._recomputed_chain(n_core)
        for k in range(n_core):
            m.Add(kept_chain[k] + rec_chain[k] <= self.limit - self.base_live[k])
        # at the backward's first step every saved storage is live (each is read later)
        everything = [nodes[R].bytes * var for R, var in self.kept.items() if nodes[R].bytes]
        if everything or self.limit < self.held_bytes:
            m.Add(sum(everything) <= self.limit - self.held_bytes)
        self.across = self._across()
        self._recompute_steps(kept_chain)

    def _saved_chain(self, n_core: int) -> list:
        """Bytes of saved storages at each core step: live from the start until their
        last core use."""
        nodes = self.problem.nodes
        drops: dict[int, list] = {}
        for R, var in self.kept.items():
            if R in self.use and nodes[R].bytes:
                drops.setdefault(0, []).append((nodes[R].bytes, var))
                drops.setdefault(self.use[R][1] + 1, []).append((-nodes[R].bytes, var))
        chain, defs = _chain(self.model, self.upper, "P", n_core + 1, drops)
        self._derive_sums(defs)
        return chain

    def _recomputed_chain(self, n_core: int) -> list:
        """Bytes of recomputed storages at each core step: live over [first use, last
        use], earlier when a recomputed consumer is placed earlier."""
        nodes, storage = self.problem.nodes, self.problem.storage
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
        chain, defs = _chain(self.model, self.upper, "Q", n_core + 1, deltas)
        self._derive_sums(defs)
        return chain

    def _recompute_steps(self, kept_chain: list) -> None:
        """At each recompute's own step: its outputs, its inputs, saved storages read
        later; and, if no consumer pulls it earlier, what the backward holds in its gap."""
        problem, m, across = self.problem, self.model, self.across
        nodes, storage, parts = problem.nodes, problem.storage, problem.outputs_of
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
                self._step_memory(kept_chain, k, inputs) <= self.limit - self.held_bytes - made
            ).OnlyEnforceIf(self.r[v])
            if v in self.first_read and not parts[v]:
                k = self.first_read[v]
                pullers = [self.r[u].Not() for u in self.users[v] if nodes[u].recomputable]
                m.Add(
                    self._step_memory(kept_chain, k, inputs) <= self.limit - across[k] - made
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

    def _derive_sums(self, defs: list) -> None:
        """``derive`` for a chain's ``(var, [(coef, var)])`` definitions."""
        for var, terms in defs:
            self.derive(var, lambda x, terms=terms: sum(c * x[v] for c, v in terms))

    def derive(self, var, value) -> None:
        """Record how a plan's values give ``var``'s (``value(values)``), for hints:
        a hint CP-SAT must complete itself is often one it cannot use."""
        self._derived.append((var, value))

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
            self.derive(a, lambda x, r=r, us=pullers: x[r] and any(x[u] for u in us))
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
