"""Hand-built tiny problems: exact program orders, saved sets, costs and memory timelines.

Every number below is worked out by hand in the comments from the documented
memory model (problem.py / simulate.py docstrings), then checked against both
``simulate`` and the independent oracle. Byte sizes are powers of ten (plus a
1-byte tangent and a 5-byte loss) so a sum can be read back into its parts.
"""

from __future__ import annotations

import oracle
import pytest

from remat.solvers import InvalidPlan, Node, Problem, evaluate, recompute_all, schedule, store_all


def plan_for(problem: Problem, saved):
    return evaluate(problem, saved, solver="test")


def check_exact(problem, plan, *, forward, backward, saved, recomputed, fwd_steps, bwd_steps, cost):
    sched = plan.schedule
    assert sched.forward == forward
    assert sched.backward == backward
    assert plan.saved == frozenset(saved)
    assert plan.recomputed == frozenset(recomputed)
    assert plan.recompute_cost == pytest.approx(cost)
    fsteps = tuple(("fwd", i, b) for i, b in fwd_steps)
    bsteps = tuple(("bwd", i, b) for i, b in bwd_steps)
    assert plan.timeline.steps == fsteps + bsteps
    fpeak = max(b for _, b in fwd_steps)
    bpeak = max(b for _, b in bwd_steps)
    assert plan.timeline.forward_peak == fpeak
    assert plan.timeline.backward_peak == bpeak
    assert plan.peak == max(fpeak, bpeak)
    # the oracle agrees with the hand-worked numbers too (this also tests the oracle)
    mem = oracle.check(problem, sched, plan.timeline)
    assert mem.forward.steps + mem.backward.steps == fsteps + bsteps


# ----------------------------------------------------------------------------- a 3-layer chain


def chain3() -> Problem:
    # h1 -> h2 -> h3 -> loss; the backward of layer k reads the layer's activation h_k.
    return Problem(
        (
            Node("t", "bwd", 1),  # 0 tangent
            Node("h1", "fwd", 10, 1.0),  # 1
            Node("h2", "fwd", 100, 2.0, (1,)),  # 2
            Node("h3", "fwd", 1000, 3.0, (2,)),  # 3
            Node("loss", "fwd", 5, 0.5, (3,)),  # 4 output, held by the caller
            Node("g3", "bwd", 20, 1.0, (0, 3)),  # 5
            Node("g2", "bwd", 30, 1.0, (5, 2)),  # 6
            Node("g1", "bwd", 40, 1.0, (6, 1)),  # 7 the gradient
        ),
        outputs=(4,),
        grads=(7,),
        name="chain3",
    )


def test_chain_store_all():
    p = chain3()
    # saved {h1,h2,h3}: the backward reads them; the loss is held, never saved.
    # forward keeps h1,h2,h3,loss:  h1 10 | h2 110 | h3 1110 | loss 1115
    # backward starts with 1115 live:
    #   t 1116 | g3 1136, then t and h3 die -> 135 | g2 165, g3 and h2 die -> 45
    #   | g1 85 (g1 kept, loss held)
    check_exact(
        p,
        store_all(p),
        forward=(1, 2, 3, 4),
        backward=(0, 5, 6, 7),
        saved={1, 2, 3},
        recomputed=set(),
        fwd_steps=[(1, 10), (2, 110), (3, 1110), (4, 1115)],
        bwd_steps=[(0, 1116), (5, 1136), (6, 165), (7, 85)],
        cost=0.0,
    )
    tl = store_all(p).timeline
    assert (tl.peak, tl.peak_phase, tl.peak_node) == (1136, "bwd", 5)
    assert tl.live_at_peak == {0, 1, 2, 3, 4, 5}


def test_chain_recompute_all():
    p = chain3()
    # forward keeps only the loss: h1 10 | h2 110, h1 dies -> 100 | h3 1100, h2 dies -> 1000
    #   | loss 1005, h3 dies -> 5
    # backward rebuilds the whole chain before g3 (inputs first), starting from the loss (5):
    #   t 6 | h1 16 | h2 116 | h3 1116 | g3 1136 -> t,h3 die: 135 | g2 165 -> 45 | g1 85
    # recompute cost: h1+h2+h3 all also run in the forward = 1+2+3
    check_exact(
        p,
        recompute_all(p),
        forward=(1, 2, 3, 4),
        backward=(0, 1, 2, 3, 5, 6, 7),
        saved=set(),
        recomputed={1, 2, 3},
        fwd_steps=[(1, 10), (2, 110), (3, 1100), (4, 1005)],
        bwd_steps=[(0, 6), (1, 16), (2, 116), (3, 1116), (5, 1136), (6, 165), (7, 85)],
        cost=6.0,
    )


def test_chain_save_middle_layer():
    p = chain3()
    # save h2: h3 is rebuilt from h2 just before g3; h1 (no inputs) just before g1.
    # forward keeps h2, loss: h1 10 | h2 110 -> 100 | h3 1100 | loss 1105 -> 105
    # backward from h2+loss = 105: t 106 | h3 1106 | g3 1126 -> 125 | g2 155 -> 35
    #   | h1 45 | g1 85 -> 45
    check_exact(
        p,
        plan_for(p, {2}),
        forward=(1, 2, 3, 4),
        backward=(0, 3, 5, 6, 1, 7),
        saved={2},
        recomputed={1, 3},
        fwd_steps=[(1, 10), (2, 110), (3, 1100), (4, 1105)],
        bwd_steps=[(0, 106), (3, 1106), (5, 1126), (6, 155), (1, 45), (7, 85)],
        cost=4.0,
    )


def chain3_with_workspace() -> Problem:
    p = chain3()
    nodes = list(p.nodes)
    nodes[2] = Node("h2", "fwd", 100, 2.0, (1,), workspace=3000)  # scratch while h2 runs
    return Problem(tuple(nodes), outputs=p.outputs, grads=p.grads)


def test_workspace_counts_at_its_own_step_only():
    p = chain3_with_workspace()
    # store-all: as test_chain_store_all, plus 3000 at h2's step in the forward only:
    #   h1 10 | h2 110+3000 = 3110 | h3 1110 | loss 1115; backward unchanged
    check_exact(
        p,
        store_all(p),
        forward=(1, 2, 3, 4),
        backward=(0, 5, 6, 7),
        saved={1, 2, 3},
        recomputed=set(),
        fwd_steps=[(1, 10), (2, 3110), (3, 1110), (4, 1115)],
        bwd_steps=[(0, 1116), (5, 1136), (6, 165), (7, 85)],
        cost=0.0,
    )
    assert (store_all(p).timeline.peak_phase, store_all(p).timeline.peak_node) == ("fwd", 2)
    # recompute-all runs h2 twice, and its workspace twice:
    #   forward h1 10 | h2 3110 | h3 1100 | loss 1005
    #   backward t 6 | h1 16 | h2 116+3000 = 3116 | h3 1116 | g3 1136 | g2 165 | g1 85
    check_exact(
        p,
        recompute_all(p),
        forward=(1, 2, 3, 4),
        backward=(0, 1, 2, 3, 5, 6, 7),
        saved=set(),
        recomputed={1, 2, 3},
        fwd_steps=[(1, 10), (2, 3110), (3, 1100), (4, 1005)],
        bwd_steps=[(0, 6), (1, 16), (2, 3116), (3, 1116), (5, 1136), (6, 165), (7, 85)],
        cost=6.0,
    )


def test_values_the_backward_never_reads_are_not_saved():
    p = chain3()
    # the loss (4) is requested but the backward never reads it: dropped, so this is
    # exactly recompute-all.
    sched = schedule(p, {4})
    assert sched == recompute_all(p).schedule
    assert sched.saved == frozenset()


def test_invalid_saved_values():
    p = chain3()
    with pytest.raises(InvalidPlan, match="not a forward node"):
        schedule(p, {0})  # the tangent
    with pytest.raises(InvalidPlan, match="not a forward node"):
        schedule(p, {99})
    with pytest.raises(InvalidPlan, match="not a forward node"):
        schedule(p, {-1})


# ----------------------------------------------------------------------------- a view


def view_problem() -> Problem:
    return Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("a", "fwd", 100, 1.0),  # 1
            Node("v", "fwd", 0, 0.5, (1,), alias_of=1),  # 2 a view of a
            Node("b", "fwd", 10, 1.0, (1,)),  # 3
            Node("loss", "fwd", 5, 0.5, (3,)),  # 4 output
            Node("g", "bwd", 20, 1.0, (0, 2)),  # 5 reads the view only
        ),
        outputs=(4,),
        grads=(5,),
    )


def test_saved_view_keeps_its_base_alive():
    p = view_problem()
    plan = plan_for(p, {2})
    # only the view is saved, but its storage is a's, so a stays alive:
    # forward: a 100 | v 100 (no bytes) | b 110 | loss 115, b dies -> 105 (a stays: v is saved)
    # backward from a+loss = 105: t 106 | g 126
    check_exact(
        p,
        plan,
        forward=(1, 2, 3, 4),
        backward=(0, 5),
        saved={2},
        recomputed=set(),
        fwd_steps=[(1, 100), (2, 100), (3, 110), (4, 115)],
        bwd_steps=[(0, 106), (5, 126)],
        cost=0.0,
    )
    assert 1 not in plan.saved
    assert 1 in plan.timeline.live_at_peak  # the base's storage is what is live


def test_store_all_takes_a_view_only_the_backward_reads_from_its_base():
    p = view_problem()
    # v is outside the forward closure (loss does not need it): store-all saves a and
    # makes the view in the backward, at no cost.
    # forward keeps a, loss: a 100 | b 110 | loss 115, b dies -> 105
    # backward from 105: t 106 | v 106 | g 126
    check_exact(
        p,
        store_all(p),
        forward=(1, 3, 4),
        backward=(0, 2, 5),
        saved={1},
        recomputed={2},
        fwd_steps=[(1, 100), (3, 110), (4, 115)],
        bwd_steps=[(0, 106), (2, 106), (5, 126)],
        cost=0.0,
    )


def test_recomputed_view_costs_nothing_outside_the_forward():
    p = view_problem()
    # forward needs only a, b, loss: a 100 | b 110, a dies -> 10 | loss 15 -> 5
    # backward: t 6 | a 106 | v 106 (a view allocates nothing) | g 126
    # cost: a is in the forward (1.0); v is not (the forward never ran it), so 0.
    check_exact(
        p,
        recompute_all(p),
        forward=(1, 3, 4),
        backward=(0, 1, 2, 5),
        saved=set(),
        recomputed={1, 2},
        fwd_steps=[(1, 100), (3, 110), (4, 15)],
        bwd_steps=[(0, 6), (1, 106), (2, 106), (5, 126)],
        cost=1.0,
    )


# ----------------------------------------------------------------------------- multi-output op


def multi_problem() -> Problem:
    return Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("m", "fwd", 0, 4.0, (1,)),  # 2 a two-output op
            Node("m.0", "fwd", 100, 0.0, (2,), output_of=2),  # 3
            Node("m.1", "fwd", 1000, 0.0, (2,), output_of=2),  # 4
            Node("loss", "fwd", 5, 0.5, (3,)),  # 5 output, from m.0
            Node("g", "bwd", 20, 1.0, (0, 4)),  # 6 reads m.1
        ),
        outputs=(5,),
        grads=(6,),
    )


def test_multi_output_one_output_saved():
    p = multi_problem()
    # m.1 is saved (not the op, not m.0). Both outputs are written when m runs.
    # forward keeps m.1 and loss:
    #   x 10 | m 10+0+100+1000 = 1110, x dies -> 1100 | m.0 1100 | m.1 1100, m dies
    #   | loss 1105, m.0 dies -> 1005
    # backward from m.1+loss = 1005: t 1006 | g 1026
    check_exact(
        p,
        plan_for(p, {4}),
        forward=(1, 2, 3, 4, 5),
        backward=(0, 6),
        saved={4},
        recomputed=set(),
        fwd_steps=[(1, 10), (2, 1110), (3, 1100), (4, 1100), (5, 1105)],
        bwd_steps=[(0, 1006), (6, 1026)],
        cost=0.0,
    )


def test_store_all_saves_a_multi_output_part_only_the_backward_reads():
    # Like layer norm's mean/rstd: m.1 is written by the forward's own run of m, only the
    # backward reads it. Saving it is what eager does and costs no recompute; not saving
    # it re-runs m (cost 4) in the backward and peaks higher (1116 > 1110).
    p = multi_problem()
    plan = store_all(p)
    assert plan.recompute_cost == 0.0
    assert 2 not in plan.recomputed
    assert plan.saved == {4}
    assert plan.peak == 1110


def test_multi_output_recomputed_writes_every_output():
    p = multi_problem()
    # forward (loss only needs m.0): x 10 | m 1110 (m.1 is written too, then dies at once
    #   with x) -> 100 | m.0 100 | loss 105 -> 5
    # backward re-runs m for m.1, which writes m.0 again:
    #   t 6 | x 16 | m 16+100+1000 = 1116, x and m.0 die -> 1006 | m.1 1006 | g 1026
    # cost: x and m run in the forward (1+4); m.1 never ran there (0).
    check_exact(
        p,
        recompute_all(p),
        forward=(1, 2, 3, 5),
        backward=(0, 1, 2, 4, 6),
        saved=set(),
        recomputed={1, 2, 4},
        fwd_steps=[(1, 10), (2, 1110), (3, 100), (5, 105)],
        bwd_steps=[(0, 6), (1, 16), (2, 1116), (4, 1006), (6, 1026)],
        cost=5.0,
    )


def test_multi_output_op_cannot_be_saved():
    with pytest.raises(InvalidPlan, match="multi-output op; save its outputs"):
        schedule(multi_problem(), {2})


def test_non_recomputable_multi_output_op_reached_is_an_error():
    p = Problem(
        (
            Node("t", "bwd", 1),
            Node("m", "fwd", 0, 1.0, recomputable=False),
            Node("m.0", "fwd", 10, 0.0, (1,), output_of=1),  # recomputable, its op is not
            Node("loss", "fwd", 5, 0.5, (2,)),
            Node("g", "bwd", 20, 1.0, (0, 2)),
        ),
        outputs=(3,),
        grads=(4,),
    )
    assert store_all(p).saved == {2}
    with pytest.raises(InvalidPlan, match="may not be recomputed and cannot be saved"):
        recompute_all(p)


# ----------------------------------------------------------------------------- random op


def random_problem() -> Problem:
    return Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("dropout", "fwd", 100, 1.0, (1,), recomputable=False),  # 2
            Node("y", "fwd", 1000, 2.0, (2,)),  # 3
            Node("loss", "fwd", 5, 0.5, (3,)),  # 4 output
            Node("g", "bwd", 20, 1.0, (0, 3)),  # 5 reads y
        ),
        outputs=(4,),
        grads=(5,),
    )


def test_random_node_is_saved_even_if_not_requested():
    p = random_problem()
    plan = recompute_all(p)  # requests nothing
    # y is rebuilt from dropout, which may not run again: dropout is saved.
    # forward keeps dropout, loss: x 10 | dropout 110, x dies -> 100 | y 1100 | loss 1105 -> 105
    # backward from 105: t 106 | y 1106, dropout dies -> 1006 | g 1026
    check_exact(
        p,
        plan,
        forward=(1, 2, 3, 4),
        backward=(0, 3, 5),
        saved={2},
        recomputed={3},
        fwd_steps=[(1, 10), (2, 110), (3, 1100), (4, 1105)],
        bwd_steps=[(0, 106), (3, 1106), (5, 1026)],
        cost=2.0,
    )


def test_random_node_not_needed_is_not_saved():
    p = random_problem()
    # saving y means the backward never needs the dropout: nothing else is added.
    # forward keeps y, loss: x 10 | dropout 110 -> 100 | y 1100, dropout dies -> 1000 | 1005
    # backward from y+loss = 1005: t 1006 | g 1026
    check_exact(
        p,
        store_all(p),
        forward=(1, 2, 3, 4),
        backward=(0, 5),
        saved={3},
        recomputed=set(),
        fwd_steps=[(1, 10), (2, 110), (3, 1100), (4, 1005)],
        bwd_steps=[(0, 1006), (5, 1026)],
        cost=0.0,
    )


def test_store_all_saves_what_a_forced_save_makes_the_forward_run():
    p = Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("loss", "fwd", 5, 0.5, (1,)),  # 2 output
            Node("a", "fwd", 100, 2.0, (1,)),  # 3 outside the forward closure
            Node("r", "fwd", 1000, 1.0, (3,), recomputable=False),  # 4 random, also outside
            Node("g", "bwd", 20, 1.0, (0, 3, 4)),  # 5 reads a and r
        ),
        outputs=(2,),
        grads=(5,),
    )
    plan = store_all(p)
    # r must be saved, so the forward runs a to make it. Store-all ("save everything
    # the backward reads, no recompute") should then save a too, as eager does; it
    # saves x instead and recomputes a in the backward: cost 2.0, and a is made twice.
    assert plan.schedule.forward == (1, 2, 3, 4)
    assert plan.recompute_cost == 0.0
    assert plan.saved == {3, 4}


# ----------------------------------------------------------------------------- backward-only value


def backward_only_problem() -> Problem:
    return Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("loss", "fwd", 5, 1.0, (1,)),  # 2 output
            Node("z", "fwd", 100, 7.0, (1,)),  # 3 only the backward reads z
            Node("g", "bwd", 20, 1.0, (0, 3)),  # 4
        ),
        outputs=(2,),
        grads=(4,),
    )


def test_value_only_the_backward_needs_costs_nothing_to_recompute():
    p = backward_only_problem()
    # save x: z is computed in the backward only, so moving it there is free (cost 0),
    # and the forward never holds z. This is also what store-all does (z is outside the
    # forward closure).
    # forward keeps x, loss: x 10 | loss 15
    # backward from 15: t 16 | z 116, x dies -> 106 | g 126
    expected = dict(
        forward=(1, 2),
        backward=(0, 3, 4),
        saved={1},
        recomputed={3},
        fwd_steps=[(1, 10), (2, 15)],
        bwd_steps=[(0, 16), (3, 116), (4, 126)],
        cost=0.0,
    )
    check_exact(p, plan_for(p, {1}), **expected)
    check_exact(p, store_all(p), **expected)


def test_backward_only_value_saved_or_recomputed_from_scratch():
    p = backward_only_problem()
    # save z: the forward runs z: x 10 | loss 15 | z 115, x dies -> 105
    # backward from z+loss = 105: t 106 | g 126
    check_exact(
        p,
        plan_for(p, {3}),
        forward=(1, 2, 3),
        backward=(0, 4),
        saved={3},
        recomputed=set(),
        fwd_steps=[(1, 10), (2, 15), (3, 115)],
        bwd_steps=[(0, 106), (4, 126)],
        cost=0.0,
    )
    # recompute-all: forward x 10 | loss 15 -> 5; backward t 6 | x 16 | z 116 -> 106 | g 126
    # cost: x ran in the forward (1.0); z did not (0).
    check_exact(
        p,
        recompute_all(p),
        forward=(1, 2),
        backward=(0, 1, 3, 4),
        saved=set(),
        recomputed={1, 3},
        fwd_steps=[(1, 10), (2, 15)],
        bwd_steps=[(0, 6), (1, 16), (3, 116), (4, 126)],
        cost=1.0,
    )


# ----------------------------------------------------------------------------- forward gradient


def forward_grad_problem() -> Problem:
    return Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("loss", "fwd", 5, 0.5, (1,)),  # 2 output
            Node("w", "fwd", 100, 3.0, (1,)),  # 3 a gradient that does not need the tangent
            Node("g", "bwd", 20, 1.0, (0, 1)),  # 4 a gradient that does
        ),
        outputs=(2,),
        grads=(4, 3),
    )


def test_forward_gradient_saved():
    p = forward_grad_problem()
    # save x (read by g) and w (a gradient). forward: x 10 | loss 15 | w 115
    # backward from x+loss+w = 115: t 116 | g 136, t and x die -> 125 (w and g returned)
    check_exact(
        p,
        plan_for(p, {1, 3}),
        forward=(1, 2, 3),
        backward=(0, 4),
        saved={1, 3},
        recomputed=set(),
        fwd_steps=[(1, 10), (2, 15), (3, 115)],
        bwd_steps=[(0, 116), (4, 136)],
        cost=0.0,
    )


def test_store_all_computes_a_forward_gradient_in_the_backward():
    p = forward_grad_problem()
    # w is outside the forward closure: store-all saves x only and makes w last, free.
    # forward: x 10 | loss 15; backward from 15: t 16 | g 36, t dies -> 35 | w 135, x dies
    check_exact(
        p,
        store_all(p),
        forward=(1, 2),
        backward=(0, 4, 3),
        saved={1},
        recomputed={3},
        fwd_steps=[(1, 10), (2, 15)],
        bwd_steps=[(0, 16), (4, 36), (3, 135)],
        cost=0.0,
    )


def test_forward_gradient_recomputed_goes_last():
    p = forward_grad_problem()
    # forward: x 10 | loss 15 -> 5
    # backward: t 6 | x 16 | g 36, t dies -> 35 | w 135, x dies -> 125
    # cost: x ran in the forward (1.0); w did not (0).
    check_exact(
        p,
        recompute_all(p),
        forward=(1, 2),
        backward=(0, 1, 4, 3),
        saved=set(),
        recomputed={1, 3},
        fwd_steps=[(1, 10), (2, 15)],
        bwd_steps=[(0, 6), (1, 16), (4, 36), (3, 135)],
        cost=1.0,
    )


# ----------------------------------------------------------------------------- live storages
#
# A value whose storage is already live in the backward (a forward output the
# caller holds, the base of a saved view) is handed over, not rebuilt into a
# second buffer; a re-run multi-output op that rewrites a saved sibling output
# holds that second buffer only while it runs. Each test checks the last
# backward step, where only what is read, run or kept is live.


def test_rerun_op_rewrites_a_saved_sibling_only_while_it_runs():
    p = Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("m", "fwd", 0, 4.0, (1,)),  # 2
            Node("m.0", "fwd", 100, 0.0, (2,), output_of=2),  # 3
            Node("m.1", "fwd", 1000, 0.0, (2,), output_of=2),  # 4
            Node("loss", "fwd", 5, 0.5, (3,)),  # 5 output
            Node("g0", "bwd", 20, 1.0, (0, 3)),  # 6 reads m.0
            Node("g1", "bwd", 40, 1.0, (6, 4)),  # 7 reads m.1
        ),
        outputs=(5,),
        grads=(7,),
    )
    plan = plan_for(p, {4})  # save m.1; m is re-run for m.0 and writes m.1 again
    assert plan.schedule.backward == (0, 1, 2, 3, 6, 7)
    # while m re-runs: saved m.1 1000 + loss 5 + t 1 + x 10 + m.0 100
    # + the rewritten m.1, a second buffer, 1000 = 2116
    assert ("bwd", 2, 2116) in plan.timeline.steps
    # at g1: saved m.1 (read) 1000 + loss 5 + g0 (read) 20 + g1 40 = 1065
    assert plan.timeline.steps[-1] == ("bwd", 7, 1065)


def test_caller_held_output_is_handed_over_not_recomputed():
    p = Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("x", "fwd", 10, 1.0),  # 1
            Node("y", "fwd", 100, 1.0, (1,)),  # 2 output, read by the backward
            Node("g", "bwd", 20, 1.0, (0, 2)),  # 3
            Node("g2", "bwd", 40, 1.0, (3,)),  # 4
        ),
        outputs=(2,),
        grads=(4,),
    )
    plan = recompute_all(p)
    assert plan.saved == {2}  # held by the caller anyway: handed over, not recomputed
    assert plan.schedule.backward == (0, 3, 4)
    # at g2: y held by the caller 100 + g (read) 20 + g2 40 = 160
    assert plan.timeline.steps[-1] == ("bwd", 4, 160)


def test_base_of_saved_view_is_handed_over_not_recomputed():
    p = Problem(
        (
            Node("t", "bwd", 1),  # 0
            Node("a", "fwd", 100, 1.0),  # 1
            Node("v", "fwd", 0, 0.0, (1,), alias_of=1),  # 2
            Node("loss", "fwd", 5, 0.5, (1,)),  # 3 output
            Node("g", "bwd", 20, 1.0, (0, 1, 2)),  # 4 reads a and its view
            Node("g2", "bwd", 40, 1.0, (4,)),  # 5
        ),
        outputs=(3,),
        grads=(5,),
    )
    plan = plan_for(p, {2})  # save the view only: its base a stays allocated anyway
    assert plan.saved == {1, 2}
    assert plan.schedule.backward == (0, 4, 5)
    # at g2: loss 5 + g (read) 20 + g2 40 = 65
    assert plan.timeline.steps[-1] == ("bwd", 5, 65)
