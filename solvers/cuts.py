"""What a simulated answer whose forward overflowed adds to a ``Relaxation``'s model.

The model's forward is a lower bound only. Where an answer overflows there, ``explain``
names the saved values that overflow it in *every* plan sharing them, and ``forbid``
rules that combination out (``forbid_saved_set``, the weakest cut, that one saved set).

Functions of the relaxation: they read its model, its ``s`` variables and the forward
without saved values it sets up (``base_order``, ``in_base``, ``forward_made``,
``forward_last``). This module imports nothing of ``relaxation``, which needs none of it.
"""

from __future__ import annotations

from .graph import reachable
from .plan import Plan


def explain(relax, plan: Plan) -> list | None:
    """Decisions of ``plan`` that overflow ``relax``'s budget in *every* plan sharing them.

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
    return _explain_forward(relax, plan)


def forbid(relax, literals: list) -> None:
    """Never take all of ``literals`` together again."""
    relax.model.AddBoolOr([lit.Not() for lit in literals])


def forbid_saved_set(relax, saved: frozenset[int]) -> None:
    """The weakest cut: never this exact saved set again."""
    relax.model.AddBoolOr(
        [relax.s[v].Not() for v in sorted(saved) if v in relax.s]
        + [relax.s[v] for v in sorted(relax.s) if v not in saved]
    )


def _explain_forward(relax, plan: Plan) -> list | None:
    """``explain`` of a plan that peaks in its forward."""
    problem = relax.problem
    nodes, t = problem.nodes, plan.timeline.peak_node
    order = plan.schedule.forward
    at = order.index(t)
    last = {}  # storage -> position of its last toucher in this forward
    for q, v in enumerate(order):
        for R in problem.touches[v]:
            last[R] = q
    forcing = _forcing_literals(relax, plan)
    lits, total = [], nodes[t].workspace
    if t not in relax.in_base:  # t itself runs only for a saved value: always pinned
        if t not in forcing:
            return None
        lits.append(forcing[t])
    pins: dict[int, list] = {}  # literal index -> [bytes it pins, literal]
    for R in sorted(plan.timeline.live_at_peak):
        if _live_in_every_forward(relax, R, t):
            total += nodes[R].bytes
            continue
        lit = _kept_literal(relax, plan, R)
        if lit is None and last.get(R, -1) >= at:
            lit = forcing.get(order[last[R]])
        if lit is not None:
            pins.setdefault(lit.Index(), [0, lit])[0] += nodes[R].bytes
    for lit in lits:
        total += pins.pop(lit.Index(), [0])[0]
    # the fewest literals that still overflow: the cut then forbids the most plans
    for size, lit in sorted(pins.values(), key=lambda pin: (-pin[0], pin[1].Index())):
        if total > relax.limit:
            break
        total += size
        lits.append(lit)
    return lits if total > relax.limit else None


def _live_in_every_forward(relax, R: int, t: int) -> bool:
    """Storage R is live while node t runs in every forward: the forward without
    saved values (which every forward runs, in problem order) holds it then."""
    if R not in relax.forward_made:
        return False
    made = relax.base_order[relax.forward_made[R]]
    return made <= t and (R in relax.held or relax.base_order[relax.forward_last[R]] >= t)


def _forcing_literals(relax, plan: Plan) -> dict:
    """For each node ``plan``'s forward runs beyond the forward without saved values:
    the saved literal of the lowest saved value whose computation runs it. One walk
    in all: a node already claimed had its inputs claimed by a lower value."""
    forcing: dict = {}

    def claimed(i: int) -> bool:
        return i in forcing or i in relax.in_base

    for v in sorted(plan.saved):
        if v in relax.s:
            for i in reachable((v,), relax.problem.producers, claimed):
                forcing[i] = relax.s[v]
    return forcing


def _kept_literal(relax, plan: Plan, R: int):
    """The saved literal of the lowest value ``plan`` saves in storage R, if any."""
    saved = [v for v in sorted(plan.saved) if relax.problem.storage[v] == R and v in relax.s]
    return relax.s[saved[0]] if saved else None
