"""What each rank of the 2-rank tests runs (``test_distributed.py`` spawns it): a tiny GPT
trained a few steps under remat with DDP or FSDP2 on gloo, each rank writing what it saw
(plan hash, peaks, predicted peak, budget, gradients against a one-process reference) to
a JSON file the test reads."""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import signal
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import remat
from remat import memory
from remat.errors import InfeasibleBudget
from remat.keys import digest
from remat.passes._torch_compat import cpu_allocations
from remat.solvers import greedy, min_peak_plan
from remat.tools import examples

# 1.5 MB of parameters, most in the (tied) embedding: dynamo's DDP optimizer wants buckets of
# at least 1 MiB (DDP's first bucket), and this makes two of them
SIZES = dict(layers=2, d_model=64, heads=2, seq=32, vocab=4096, dropout=0.0)
BATCH = 4  # per rank
WORLD = 2
STEPS = 4  # the first plans; peaks are measured from the second on


def rank_dependent(problem, budget):
    """Plans that differ by rank (rank 0: the greedy's; others: the lowest peak), as CP-SAT
    out of time or the profile cost model may on real machines."""
    if dist.get_rank() == 0:
        return greedy(problem, budget)
    return min_peak_plan(problem)


HANG = 300  # seconds: a rank still running then prints every thread's stack and exits


def run(rank: int, world: int, init_file: str, out: str, case: str) -> None:
    os.environ.setdefault("REMAT_CACHE", "0")
    faulthandler.dump_traceback_later(HANG, exit=True)  # a hung collective fails the test
    # the first rank to time out ends the spawn, which terminates the others: they print
    # their stacks too, so a hang shows where each rank waits
    faulthandler.register(signal.SIGTERM, chain=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        result = CASES[case](rank, world)
        Path(out, f"{case}-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the whole batch of all ranks (equal on every rank)."""
    gen = torch.Generator().manual_seed(1)
    vocab, seq = SIZES["vocab"], SIZES["seq"]
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (world * BATCH, seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _train(model, optimized, reference, rank: int, world: int, local_grad) -> dict:
    """Train ``optimized`` (the parameters are ``model``'s) on this rank's slice of each
    batch beside ``reference``, one process's copy, on the whole batch: peaks, and the
    largest gradient difference at every step."""
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    peaks, diffs = [], []
    for step, (x, y) in enumerate(_batches(world)):
        model.zero_grad(set_to_none=True)
        if step == 0:  # planned now: not inside a profiler, which hides kernels' scratch
            optimized(x[mine], y[mine]).backward()
        else:
            measured = memory.peak(lambda x=x, y=y: optimized(x[mine], y[mine]).backward())
            peaks.append(measured.peak_bytes)
        reference.zero_grad(set_to_none=True)
        reference(x, y).backward()
        diffs.append(max(
            (local_grad(p) - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ))  # fmt: skip
        with torch.no_grad():  # one SGD step on both, so later steps see new weights
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
    report = optimized.remat.report()
    plans = [(s.graphs, s.programs, sorted(s.plan.saved)) for s in report.steps]
    return {
        "peaks": peaks,
        "predicted": report.predicted_peak,
        "budget": max(s.limit for s in report.steps),
        "graphs": len(report.graphs),
        "runs": report.steps[-1].runs,
        "solvers": [s.plan.solver for s in report.steps],
        "digest": digest(plans),  # compared across ranks by the test, from the files
        "grad_diffs": diffs,
        "params": sum(q.numel() * q.element_size() for q in reference.parameters()),
    }


def ddp(rank: int, world: int, solver="auto") -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model, _ = examples.load("gpt", batch=BATCH, **SIZES)
    reference = copy.deepcopy(model)
    # dynamo's DDP optimizer compiles one graph per bucket
    wrapped = DistributedDataParallel(model, bucket_cap_mb=1)
    optimized = remat.optimize(wrapped, budget=0.9, solver=solver)
    return _train(model, optimized, reference, rank, world, local_grad=lambda p: p.grad)


def ddp_in_use(rank: int, world: int) -> dict:
    """``ddp``'s training measured as memory in use: one profiler session from before DDP
    is built, so the buckets DDP replaces when it rebuilds them (in the second step's
    forward) are seen freed; a window per step (``memory.peak``) sees the new buckets
    allocated and not the old ones freed, allocated before it. Per step from the second,
    the peak over what was live at its start (after ``zero_grad``). Planning runs inside
    the session, so kernels' scratch is not measured: the model has none that matters."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, _ = examples.load("gpt", batch=BATCH, **SIZES)
        optimized = remat.optimize(DistributedDataParallel(model, bucket_cap_mb=1), budget=0.9)
        for step, (x, y) in enumerate(_batches(world)):
            model.zero_grad(set_to_none=True)
            torch.empty(_MARKS[step], dtype=torch.uint8)  # where the step starts
            optimized(x[mine], y[mine]).backward()
    report = optimized.remat.report()
    return {
        "in_use": _peaks_over_starts(cpu_allocations(prof))[1:],
        "predicted": report.predicted_peak,
        "budget": max(s.limit for s in report.steps),
    }


_MARKS = tuple(7_777_777 + 2 * k for k in range(STEPS))  # odd sizes no step allocates


def _peaks_over_starts(events: list[tuple[int, int, int, int]]) -> list[int]:
    """Per step, the peak of live bytes over those live at its start mark."""
    live: dict[int, int] = {}
    running, starts, peaks = 0, [], []
    for _, _, ptr, size in sorted(events):
        if size in _MARKS:
            starts.append(running)
            peaks.append(running)
        elif -size in _MARKS:
            continue
        elif size > 0:
            live[ptr] = size
            running += size
        elif ptr in live:
            running -= live.pop(ptr)
        if peaks:
            peaks[-1] = max(peaks[-1], running)
    return [p - s for p, s in zip(peaks, starts, strict=True)]


def ddp_twice(rank: int, world: int) -> dict:
    """``ddp`` with remat's default solver, then with ``rank_dependent``, then
    ``ddp_in_use``, then ``ddp_lengths`` (one spawn)."""
    first = ddp(rank, world)
    torch._dynamo.reset()
    second = ddp(rank, world, solver=rank_dependent)
    torch._dynamo.reset()
    in_use = ddp_in_use(rank, world)
    torch._dynamo.reset()
    lengths = ddp_lengths(rank, world)
    return {"auto": first, "rank_dependent": second, "in_use": in_use, "lengths": lengths}


# Per step, each rank's length, as padding each rank's own batch to its longest row gives:
# they differ across ranks, and each rank's grows once after its symbolic trace (step 2)
LENGTHS = ((24, 28), (20, 16), (30, 31), (26, 25))


def ddp_lengths(rank: int, world: int) -> dict:
    """DDP on batches each rank cuts to its own length per step (``_lengths``)."""
    from torch.nn.parallel import DistributedDataParallel

    model, _ = examples.load("gpt", batch=BATCH, **SIZES)
    reference = copy.deepcopy(model)
    budget = 6_600_000  # bytes, on each rank: binding at 31 tokens (store-all 7.2 MB)
    optimized = remat.optimize(DistributedDataParallel(model, bucket_cap_mb=1), budget=budget)
    return _lengths(model, optimized, reference, rank, world, budget, lambda p: p.grad)


def fsdp2_lengths(rank: int, world: int) -> dict:
    """FSDP2 on batches each rank cuts to its own length per step (``_lengths``)."""
    model, reference = _sharded()
    budget = 7_600_000  # bytes, on each rank: binding at 31 tokens (store-all 8.3 MB)
    optimized = remat.optimize(model, budget=budget)
    return _lengths(model, optimized, reference, rank, world, budget, _full_grad)


def _lengths(model, optimized, reference, rank: int, world: int, budget: int, local_grad):
    """``optimized`` trained on batches each rank cuts to its own length per step
    (``LENGTHS``) under an absolute ``budget``, beside one process's copy on both ranks'
    batches (the mean of the ranks' losses, as the ranks average their gradients): per
    step the largest gradient difference, and from the third (the first two trace) the
    measured peak and whether this rank's length was longer than any before."""
    peaks, diffs, grew, longest = [], [], [], 0
    for step, ((x, y), lengths) in enumerate(zip(_batches(world), LENGTHS, strict=True)):
        rows = [slice(r * BATCH, (r + 1) * BATCH) for r in range(world)]
        mine = (x[rows[rank], : lengths[rank]], y[rows[rank], : lengths[rank]])
        model.zero_grad(set_to_none=True)
        if step < 2:  # traced and planned: not inside a profiler
            optimized(*mine).backward()
        else:
            peaks.append(memory.peak(lambda m=mine: optimized(*m).backward()).peak_bytes)
            grew.append(lengths[rank] > longest)
        longest = max(longest, lengths[rank])
        reference.zero_grad(set_to_none=True)
        sum(reference(x[r, :n], y[r, :n]) for r, n in zip(rows, lengths, strict=True)).div(
            world
        ).backward()
        diffs.append(max(
            (local_grad(p) - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ))  # fmt: skip
    report = optimized.remat.report()
    return {
        "peaks": peaks,
        "grew": grew,
        "budget": budget,
        "grad_diffs": diffs,
        "planned at": [dict(g.binding) for g in report.graphs if g.binding],
    }


def _sharded():
    """The tiny GPT (the same weights on every rank and every call), ``fully_shard`` per
    block and at the root, and an unsharded copy of it."""
    from torch.distributed.fsdp import fully_shard

    model, _ = examples.load("gpt", batch=BATCH, **SIZES)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, reference


def _full_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.full_tensor()


def fsdp2(rank: int, world: int) -> dict:
    model, reference = _sharded()
    optimized = remat.optimize(model, budget=0.9)
    result = _train(model, optimized, reference, rank, world, local_grad=_full_grad)
    torch._dynamo.reset()
    fraction = _first_step(rank, world, 0.9)
    torch._dynamo.reset()
    # the same budget in bytes: the first step's plans get what the step's own limit leaves
    # them, where a fraction is of the store-all peak seen so far (the graph's, smaller)
    in_bytes = _first_step(rank, world, fraction["budget"])
    gathers, refused = _all_gather_bytes(model, world), _refused_then_fits(model, rank)
    torch._dynamo.reset()
    return {
        **result,
        "gathers": gathers,
        "refused": refused,
        "first": {"fraction": fraction, "bytes": in_bytes},
        "lengths": fsdp2_lengths(rank, world),
    }


def _first_step(rank: int, world: int, budget: float | int) -> dict:
    """The first step of a fresh FSDP2 model under ``budget``, measured on its own: an
    identical step fills a plan cache (this rank's own folder: it reads back exactly the
    problems this rank measured, its kernels' scratch included, with no second writer),
    and then, from a reset dynamo, a new model's first step runs the plans a first step
    runs, from that cache, inside ``memory.peak`` (planning inside the profiler would
    measure no kernel scratch). Its peak, the step's budget in bytes, what the recorded
    first step predicts, the compile-time plan's limit, peak and reserve, the cache's counts,
    and
    its gradients against one process's on the whole batch. ``room``: what the block
    graph's first-step plan kept free for the code after it (``GraphPlan.room``)."""
    x, y = _batches(world)[0]
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    with tempfile.TemporaryDirectory() as cache:
        model, _ = _sharded()
        remat.optimize(model, budget=budget, cache=cache)(x[mine], y[mine]).backward()
        torch._dynamo.reset()
        model, reference = _sharded()
        optimized = remat.optimize(model, budget=budget, cache=cache)
        peak = memory.peak(lambda: optimized(x[mine], y[mine]).backward()).peak_bytes
    reference(x, y).backward()
    report = optimized.remat.report()
    graph = report.graphs[0]  # the block graph's compile-time plan
    return {
        "peak": peak,
        "budget": max(s.limit for s in report.steps),
        "first_predicted": report.first_step_peak,
        "predicted": report.predicted_peak,
        "graph_limit": graph.limit,
        "graph_peak": graph.plan.peak,
        "reserve": graph.reserve,
        "room": graph.room,
        "cache": dict(optimized.remat.cache.counts),
        "grad_diff": max(
            (_full_grad(p) - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ),
    }


def _all_gather_bytes(model, world: int) -> list[int]:
    """Bytes of each FSDP2 module's all-gather output: its parameters' padded shards, as
    FSDP2 gathers them, from every rank."""
    from torch.distributed.fsdp import FSDPModule

    groups = [
        m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)
    ]
    return [
        world
        * sum(
            p._sharded_param_data.numel() * p._sharded_param_data.element_size()
            for p in g.fsdp_params
        )
        for g in groups
    ]


def _refused_then_fits(model, rank: int) -> dict:
    """A budget below the step's minimum (3/4 of its store-all peak; the block graph alone
    fits 3/4 of its own) is refused naming that minimum; then the step under a budget of
    exactly that minimum: its peaks and prediction."""
    x, y = (t[rank * BATCH : (rank + 1) * BATCH] for t in _batches(WORLD)[0])
    step = lambda optimized: lambda: optimized(x, y).backward()  # noqa: E731
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    try:
        step(remat.optimize(model, budget=0.75))()
        return {"minimum": None}
    except InfeasibleBudget as refusal:
        minimum = refusal.minimum
    torch._dynamo.reset()
    fits = remat.optimize(model, budget=minimum)
    peaks = []
    for k in range(3):  # step 0 plans, 1 and 2 are measured
        model.zero_grad(set_to_none=True)
        if k:
            peaks.append(memory.peak(step(fits)).peak_bytes)
        else:
            step(fits)()
    return {"minimum": minimum, "peaks": peaks, "predicted": fits.remat.report().predicted_peak}


CASES = {"ddp": ddp_twice, "fsdp2": fsdp2}
