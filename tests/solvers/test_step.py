"""A step of several runs composed into one problem (``solvers.step``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.solvers import Node, Problem, evaluate, greedy, store_all
from remat.solvers.step import Link, Outside, Step, compose, joint_saved, split
from tests.solvers.test_properties import joint_graphs


def _layer(width: int = 100) -> Problem:
    """x -> h -> y (output); backward: tangent -> dh -> grad, reading h and x."""
    nodes = (
        Node("x", "fwd", bytes=width, cost=1.0),
        Node("h", "fwd", bytes=width, cost=1.0, inputs=(0,)),
        Node("y", "fwd", bytes=width, cost=1.0, inputs=(1,)),
        Node("tangent", "bwd", bytes=width),
        Node("dh", "bwd", bytes=width, cost=1.0, inputs=(3, 1)),
        Node("dx", "bwd", bytes=width, cost=1.0, inputs=(4, 0)),
    )
    return Problem(nodes, outputs=(2,), grads=(5,), name="layer")


@settings(max_examples=60, deadline=None)
@given(joint_graphs(max_forward=30))
def test_one_run_composes_to_its_own_plans(problem):
    """With nothing outside it, a step of one run is that run: every saved set gives the
    same programs and peak."""
    composed = compose(Step((problem,), (0,)))
    for plan in (store_all(problem), greedy(problem)):
        again = evaluate(composed.problem, joint_saved(composed, (plan.saved,)), solver="x")
        assert again.peak == plan.peak
        assert split(composed, again) == (plan.saved,)


def test_a_gradient_fed_to_an_earlier_run_is_one_storage():
    """run 1's input gradient is run 0's tangent: without the link it counts twice and is
    held to the step's end."""
    runs = (_layer(), _layer())
    order = (1, 0)
    apart = store_all(compose(Step(runs, order)).problem).timeline
    linked = store_all(compose(Step(runs, order, (Link(1, 5, 0, 3),))).problem).timeline
    # run 0's last node: run 1's gradient is freed once run 0's first reads it
    assert linked.steps[-1][2] == apart.steps[-1][2] - 100
    assert linked.peak <= apart.peak


def test_earlier_runs_hold_their_saved_values_through_later_ones():
    one = store_all(_layer()).peak
    two = compose(Step((_layer(), _layer()), (1, 0), (Link(1, 5, 0, 3),))).problem
    # run 0 keeps x, h (saved) and y (returned) while run 1 runs
    assert store_all(two).peak >= one + 300


def test_outside_memory_is_held_through_the_sections_it_spans():
    runs = (_layer(),)
    base = store_all(compose(Step(runs, (0,))).problem).peak
    # 1,000 bytes live from the end of the forward until the backward starts, 5,000 at peak
    outside = Outside(level=(0, 0), peak=(0, 5000, 0))
    transient = store_all(compose(Step(runs, (0,), outside=outside)).problem).peak
    held = Outside(level=(0, 1000), peak=(0, 1000, 0))
    through = store_all(_composed(held)).peak
    assert transient == 300 + 5000  # x, h, y held by the forward, then the loss's peak
    assert through == base + 1000


def test_an_output_the_caller_dropped_is_freed_after_its_sections_peak():
    """y (the logits beside a loss) dropped in the code before the backward: alive through
    that section's peak, then freed, not held to the step's end."""
    outside = Outside(level=(0, 0), peak=(0, 5000, 0))
    held = store_all(compose(Step((_layer(),), (0,), outside=outside)).problem)
    dropped = store_all(
        compose(Step((_layer(),), (0,), outside=outside, released=((0, 2, 1),))).problem
    )
    assert dropped.timeline.peak == held.timeline.peak == 300 + 5000  # y alive at the peak
    # the backward: x, h saved, the tangent, dh; y no longer among them
    assert [live for phase, _, live in dropped.timeline.steps if phase == "bwd"] == [
        live - 100 for phase, _, live in held.timeline.steps if phase == "bwd"
    ]


def test_an_output_counts_through_the_peak_before_it_died_not_the_one_after():
    """A loss's forward (2,000 B beside the logits y) then its backward (5,000 B, y
    already dead, as ``F.cross_entropy(model(x), y)`` frees the logits): y counts at the
    first peak only. Without ``early`` it counted through the second; held (not
    released), it counts through both."""

    def peak(early: tuple[int, ...], released: tuple = ((0, 2, 1),)) -> int:
        outside = Outside(level=(0, 0), peak=(0, 5000, 0), early=early)
        step = Step((_layer(),), (0,), outside=outside, released=released)
        return store_all(compose(step).problem).peak

    assert peak((0, 2000, 0)) == 200 + 5000  # x, h saved; y died before the 5,000 B
    assert peak(()) == 300 + 5000  # when it died unknown: through the peak
    assert peak((0, 8000, 0)) == 300 + 8000  # the peak before it died is the higher
    assert peak((0, 2000, 0), released=()) == 300 + 5000  # held to the end
    with pytest.raises(ValueError, match="early"):
        Step((_layer(),), (0,), outside=Outside((0, 0), (0, 0, 0), early=(0,)))


def _composed(outside: Outside) -> Problem:
    return compose(Step((_layer(),), (0,), outside=outside)).problem


def test_no_plan_drops_outside_memory():
    outside = Outside(level=(0, 1000), peak=(0, 1000, 0))
    problem = _composed(outside)
    held = [i for i, n in enumerate(problem.nodes) if n.name.startswith("outside:held")]
    assert held and all(i in greedy(problem).saved for i in held)


@given(st.lists(st.integers(0, 50), min_size=2, max_size=8))
def test_intervals_sum_to_each_level(levels):
    from remat.solvers.step import _intervals

    spans = _intervals(tuple(levels))
    for s, h in enumerate(levels):
        assert sum(b for start, end, b in spans if start <= s < end) == h


def test_bad_steps_are_refused():
    with pytest.raises(ValueError, match="permutation"):
        Step((_layer(),), (1,))
    with pytest.raises(ValueError, match="runs later"):
        Step((_layer(), _layer()), (0, 1), (Link(1, 5, 0, 3),))
    with pytest.raises(ValueError, match="levels"):
        Step((_layer(),), (0,), outside=Outside((0,), (0, 0)))
    with pytest.raises(ValueError, match="released"):
        Step((_layer(),), (0,), released=((0, 1, 1),))  # h is not an output
    with pytest.raises(ValueError, match="released"):
        Step((_layer(),), (0,), released=((0, 2, 2),))  # dropped after the backward began
