"""The first step's room for the code after a graph: what a loss over its outputs holds,
before anything of the step was measured.

A graph's compile-time plan runs the first step; the step's joint plan, made from
measurements once it ended, runs the rest (``remat.runtime``). Code after the graph (a
loss on returned logits) holds memory the graph's problem does not see, so the first
step's plan leaves room for it: ``outside_reserve`` bytes, live just before the graph's
backward begins (the loss's forward and backward run there, while everything the forward
saved is alive), as the step's own plan later counts the measured code outside
(``solvers.step.Outside``). Room at that one moment, not through the whole step: the
forward's peak and the backward's are the graph's own.

Where the code after the graph is not a loss on its outputs but code nothing has seen yet
(a caller's frame that runs on eagerly when the graph returns: FSDP2's root module, whose
head and loss follow its blocks' graphs), no estimate of it holds: the first step's plan
then keeps as much room there as a plan within the graph's share can (``widest_room``),
holding the fewest bytes it can into that code, at the cost of recomputing more in the
first step only.

Also here: whether a graph is the whole step (``only_a_loss``, with ``Planner``'s
``alone``), and a graph's refusal in the step's terms (``with_the_rest``).
"""

from __future__ import annotations

import dataclasses

from remat.passes.extract import Extracted, is_root_tangent, is_tangent
from remat.solvers import InfeasibleBudget, Plan, Problem, evaluate, format_bytes
from remat.solvers.heuristics import least_held
from remat.solvers.step import Composed, Outside, Step, compose, joint_saved, split, split_orders

# What a loss over an output peaks at between the graph's forward and its backward, in
# that output's bytes: cross-entropy's saved log-softmax, its gradient and the output's
# gradient (measured 3.0x over float32 logits; docs/guide.md, "What the budget covers").
OUTSIDE_PER_OUTPUT = 3


def outside_reserve(extracted: Extracted) -> int:
    """Bytes a first-step plan of the graph leaves free for the code after it: for each
    output with a gradient that is not a scalar loss's, ``OUTSIDE_PER_OUTPUT`` times its
    bytes."""
    return OUTSIDE_PER_OUTPUT * sum(
        node.bytes
        for node, n in zip(extracted.problem.nodes, extracted.fx_nodes, strict=True)
        if is_tangent(n) and not is_root_tangent(n)
    )


def with_room(problem: Problem, reserve: int, after: int = 0) -> Composed:
    """``problem`` as a step of one run whose code outside peaks at ``reserve`` bytes
    between its forward and its backward and at ``after`` bytes once its backward returned
    (``passes.layouts.copied_into_grad``); its plans are ``problem``'s (``own_plan``)."""
    outside = Outside(level=(0, 0), peak=(0, reserve, after))
    return compose(Step((problem,), (0,), outside=outside), name=problem.name)


def widest_room(problem: Problem, total: int, reserve: int) -> int:
    """The room a first-step plan of ``problem`` keeps between its forward and its backward
    for code after it that nothing has seen: as much as a plan peaking within ``total``
    bytes can keep, ``total`` less the fewest bytes such a plan holds there
    (``solvers.heuristics.least_held``); never less than ``reserve``."""
    least = least_held(problem, total)
    if least is None:
        return reserve
    probe = total + 1  # above every peak within ``total``: the room's moment is the peak
    room = with_room(problem, probe)
    held = evaluate(room.problem, in_room(room, least.saved), solver=least.solver).peak - probe
    return max(reserve, total - held)


def first_step_peak(room: Composed | None, plan: Plan) -> int:
    """``plan``'s peak in the graph's first step: its own peak, or, with ``room`` (the
    graph ``with_room``), the most the graph and the room for the code after it hold
    together. Not its own peak plus the room: a plan whose peak is in its forward or its
    backward (the user's checkpointing) holds little where the room is."""
    if room is None:
        return plan.peak
    return evaluate(room.problem, in_room(room, plan.saved), solver=plan.solver).peak


def in_room(composed: Composed, saved: frozenset[int]) -> frozenset[int]:
    """A saved set of the graph's problem as one of ``with_room``'s."""
    return joint_saved(composed, (saved,))


def own_plan(composed: Composed, plan: Plan, problem: Problem) -> Plan:
    """``plan`` of ``with_room(problem, ...)`` as a plan of ``problem`` (its peak the
    graph's own, without the room), keeping the solver's status and bound."""
    (saved,) = split(composed, plan)
    order = split_orders(composed, plan)[0] if plan.ordered else None
    own = evaluate(problem, saved, backward=order, solver=plan.solver, limit=plan.limit)
    return dataclasses.replace(own, status=plan.status, bound=plan.bound)


_SCALAR_BYTES = 8  # one element of the widest float a loss is in (float64)


def only_a_loss(extracted: Extracted) -> bool:
    """Whether the graph returns a scalar loss and nothing else: then its problem holds
    what the step's would (an output it holds to the step's end, the step may free)."""
    outputs = extracted.problem.outputs
    return len(outputs) == 1 and extracted.problem.nodes[outputs[0]].bytes <= _SCALAR_BYTES


def with_the_rest(
    refusal: InfeasibleBudget, held: int, reference: int | None = None
) -> InfeasibleBudget:
    """A graph's refusal in the budget's terms: its limit and minimum with ``held``, what
    the rest of the step is counted to hold beside it (a graph's plan is its last word
    where no step is planned as one: ``remat.partitioner``)."""
    r = refusal
    if not held:
        return InfeasibleBudget(
            r.limit, r.minimum, r.store_all, r.graph, r.proven, r.note,
            lowest_proven=r.lowest_proven, reference=reference,
        )  # fmt: skip
    note = (
        f"That counts {format_bytes(held)} for the rest of the step beside the graph (what "
        "earlier graphs keep, and room for the code after it: docs/guide.md, 'What the "
        "budget covers')."
    )
    return InfeasibleBudget(
        r.limit + held, r.minimum + held, r.store_all + held, r.graph, r.proven, note=note,
        lowest_proven=r.lowest_proven,
        reference=None if reference is None else reference + held,
    )  # fmt: skip
