"""``as_given.eager_peak`` on random joint graphs: the module's eager step put in the
graph's place, phase by phase."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import joint_graphs

from remat.as_given import Phases, graph_eager_peak, stored_phases
from remat.solvers import store_all


@settings(deadline=None, max_examples=60)
@given(joint_graphs(max_forward=60), st.integers(0, 4096), st.integers(0, 4096))
def test_the_eager_step_in_the_graphs_place_is_bounded_by_what_it_holds(problem, less, less2):
    """Phase by phase (``graph_eager_peak``): the module's eager figures equal to the
    store-all program's give that program's peak; lower ones lower it by no more than the
    most any phase came down, never raise it."""
    stored = store_all(problem)
    same = stored_phases(problem, stored)
    assert graph_eager_peak(problem, stored, same) == stored.peak
    lower = Phases(
        max(0, same.forward - less), max(0, same.held - less2), max(0, same.backward - less)
    )
    got = graph_eager_peak(problem, stored, lower)
    assert stored.peak - max(less, less2) <= got <= stored.peak
