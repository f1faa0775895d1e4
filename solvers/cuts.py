"""What a simulated answer whose forward overflowed adds to ``Relaxation``'s model.

The model's forward is a lower bound only. Where an answer overflows there, ``explain``
names the saved values that overflow it in *every* plan sharing them, and ``forbid``
rules that combination out (``forbid_saved_set``, the weakest cut, that one saved set).

Methods of ``Relaxation`` (a mixin): they read the model, its ``s`` variables and the
forward without saved values that ``Relaxation.__init__`` sets up.
"""

from __future__ import annotations

from .graph import reachable
from .plan import Plan


class Cuts:
    """The forward cuts of ``Relaxation``'s model."""

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
            if total > self.limit:
                break
            total += size
            lits.append(lit)
        return lits if total > self.limit else None

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
