"""One plan on every rank of a distributed job, and the solver as remat runs it.

Ranks of a DDP or FSDP2 job trace the same graphs, but a solver with a time limit
(CP-SAT) may stop at different plans on different machines, and the ``profile`` cost
model times kernels per machine. Each plan is therefore compared across ranks (a hash
each) and where they differ every rank takes rank 0's, derived again from its
saved values on its own problem (``solvers.solve`` then checks it like any other plan).
Ranks that traced other sizes (each pads its own batch) have problems of other bytes:
each keeps its own plan, which rank 0's need not fit, and a refusal on any stops all.
Every rank must plan the same graphs in the same order, as it does when all trace one
model: each solve is one round on the default process group's key-value store.

The store, not a collective: the backend's worker thread releases a collective's
Python-made tensors, taking the GIL there, which hangs or aborts ranks (gloo, torch 2.13:
docs/pipelines.md "Plan agreements go through the store"). The store moves bytes, no
tensors, and needs no fake-mode guard inside a compile.
"""

from __future__ import annotations

import pickle

import torch.distributed as dist

from remat.cache import PlanCache
from remat.keys import digest
from remat.solvers import InfeasibleBudget, Plan, Problem, evaluate, min_peak_plan, store_all
from remat.solvers.solve import Solver, solver_for


def planning_solver(
    solver: str | Solver, cache: PlanCache | None, agree: bool = True
) -> str | Solver:
    """``solver`` answering from ``cache`` where it can, and agreed across ranks unless
    ``agree`` is False: a graph with symbolic sizes is planned when its rank's own sizes
    grow, which other ranks need not do at the same time, so it cannot take part in a
    round every rank must join; each rank plans it for its own sizes."""
    if cache is not None:
        solver = cache.solver(solver)
    return agreeing(solver) if agree and distributed() else solver


def agreeing(solver: str | Solver) -> Solver:
    """``solver`` whose outcome is rank 0's wherever ranks' outcomes differ: its plan, or
    its refusal (``InfeasibleBudget``), so every rank goes on alike."""
    run = solver_for(solver)

    def agreed(problem: Problem, limit: int) -> Plan:
        plan, refusal = None, None
        try:
            plan = run(problem, limit)
        except InfeasibleBudget as verdict:  # a refusal is an outcome: still compared
            refusal = verdict
        chosen = agree(problem, plan, limit)
        if chosen is not None:
            return chosen
        raise refusal or InfeasibleBudget(
            limit, min_peak_plan(problem).peak, store_all(problem).peak, problem.name,
            note="Another rank found no plan under it, and every rank stops alike.",
        )  # fmt: skip

    agreed.__name__ = getattr(run, "__name__", "solver")
    return agreed


def agree(problem: Problem, plan: Plan | None, limit: int) -> Plan | None:
    """``plan`` (None: refused) if every rank's is the same, else rank 0's, derived on this
    rank's problem; each rank's own where the ranks' problems differ in bytes (each rank
    traced its own sizes: a DDP job whose ranks pad their own batches), as rank 0's plan
    need not fit another rank's sizes."""
    mine = None if plan is None else (
        sorted(plan.saved), list(plan.schedule.backward) if plan.ordered else None
    )  # fmt: skip
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    # the n-th agreement of every rank is one round; the count lives in the store, so a new
    # process group starts again at 1
    round_ = f"remat/agree/{store.add(f'remat/agreements/{rank}', 1)}"
    store.set(f"{round_}/{rank}", digest(mine))
    store.set(f"{round_}/{rank}/bytes", digest([n.bytes for n in problem.nodes]))
    keys = [f"{round_}/{r}" for r in range(dist.get_world_size())]
    sizes = [f"{k}/bytes" for k in keys]
    store.wait(keys + sizes)
    plans = store.multi_get(keys)
    if len(set(store.multi_get(sizes))) > 1:
        refused = digest(None).encode() in plans
        return None if refused else plan  # a refusal anywhere stops every rank alike
    if len(set(plans)) == 1:
        return plan
    if rank == 0:
        store.set(f"{round_}/chosen", pickle.dumps(_outcome(mine, plan)))
        return plan
    decided, solver, status, bound = pickle.loads(store.get(f"{round_}/chosen"))
    if decided is None:
        return None
    saved, order = decided
    return evaluate(
        problem, saved, backward=order, solver=f"{solver} (rank 0's)", status=status,
        limit=limit, bound=bound,
    )  # fmt: skip


def _outcome(mine, plan: Plan | None) -> tuple:
    if plan is None:
        return None, "", "", None
    return mine, plan.solver, plan.status, plan.bound


def distributed() -> bool:
    """Whether plans are made on several ranks (and so must be agreed)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
