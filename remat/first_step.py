"""What a graph's first-step plan is held to, before the rest of its step is known: room
for the code after it (``outside_reserve``), whether it is the whole step (``only_a_loss``,
with ``Planner``'s ``alone``), and its refusal in the step's terms (``with_the_rest``)."""

from __future__ import annotations

from remat.passes.extract import Extracted, is_root_tangent, is_tangent
from remat.solvers import InfeasibleBudget, format_bytes

# What code after a graph holds in a step not measured yet (its first): a loss over an
# output the backward takes a gradient of holds about twice that output's bytes, its own
# intermediate and the gradient it computes (measured: 1.75-1.8x on cross-entropy over
# logits; docs/guide.md, "What the budget covers").
OUTSIDE_PER_OUTPUT = 2


def outside_reserve(extracted: Extracted) -> int:
    """Bytes a first-step plan of the graph leaves free for the code after it: for each
    output with a gradient that is not a scalar loss's, ``OUTSIDE_PER_OUTPUT`` times its
    bytes. The step's joint plan, made once the step is measured, frees it."""
    return OUTSIDE_PER_OUTPUT * sum(
        node.bytes
        for node, n in zip(extracted.problem.nodes, extracted.fx_nodes, strict=True)
        if is_tangent(n) and not is_root_tangent(n)
    )


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
    where no step is planned as one: under inductor)."""
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
