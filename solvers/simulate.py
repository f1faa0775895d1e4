"""Walk a Schedule and account every byte: the predicted memory timeline.

The accounting mirrors how the rewritten fx programs run: a node's output is
allocated when it (or, for a multi-output op's outputs, the op) runs; a
storage is freed right after the last node that reads it or any of its views,
unless the program returns it. The forward returns its outputs and the saved
values; the backward starts with them live and returns the gradients. Forward
outputs are assumed held by the caller until the step ends (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem
from .schedule import Schedule


@dataclass(frozen=True)
class Timeline:
    """Bytes live while each node runs (its outputs and workspace included), over both
    programs.

    ``steps`` holds ``(phase, node, live_bytes)``; ``live_at_peak`` the storages
    (owner nodes) live at the peak, which is what a solver must shrink.
    """

    peak: int
    forward_peak: int
    backward_peak: int
    peak_phase: str
    peak_node: int
    live_at_peak: frozenset[int]
    steps: tuple[tuple[str, int, int], ...]


def simulate(problem: Problem, sched: Schedule) -> Timeline:
    storage = problem.storage
    held_by_caller = {storage[i] for i in problem.outputs}
    fwd_keep = held_by_caller | {storage[i] for i in sched.saved}
    fwd = _run(problem, "fwd", sched.forward, {}, fwd_keep)
    bwd_keep = held_by_caller | {storage[i] for i in problem.grads}
    start = {r: problem.nodes[r].bytes for r in fwd_keep}
    bwd = _run(problem, "bwd", sched.backward, start, bwd_keep)
    top = fwd if fwd.peak >= bwd.peak else bwd
    return Timeline(
        peak=top.peak,
        forward_peak=fwd.peak,
        backward_peak=bwd.peak,
        peak_phase=top.phase,
        peak_node=top.peak_node,
        live_at_peak=top.live_at_peak,
        steps=fwd.steps + bwd.steps,
    )


@dataclass(frozen=True)
class _Run:
    phase: str
    peak: int
    peak_node: int
    live_at_peak: frozenset[int]
    steps: tuple[tuple[str, int, int], ...]


def _run(
    problem: Problem,
    phase: str,
    order: tuple[int, ...],
    live: dict[int, int],
    keep: set[int],
) -> _Run:
    """Run one program from ``live`` (storage -> bytes); storages in ``keep`` survive it."""
    touches, allocations, nodes = problem.touches, problem.allocations, problem.nodes
    last_use: dict[int, int] = {}
    for pos, i in enumerate(order):
        for root in touches[i]:
            last_use[root] = pos
    frees: dict[int, list[int]] = {}
    for root, pos in last_use.items():
        if root not in keep:
            frees.setdefault(pos, []).append(root)

    live = {r: b for r, b in live.items() if r in keep or r in last_use}
    start = frozenset(live)
    current = sum(live.values())
    peak, peak_pos = current, -1
    born: dict[int, int] = {}  # storage -> position it was allocated at
    steps = []
    for pos, i in enumerate(order):
        scratch = nodes[i].workspace
        for new, size in allocations[i]:
            if new in live:  # a re-run op rewrites an output handed over as saved:
                scratch += size  # a second buffer, dropped at once
            else:
                live[new] = size
                born[new] = pos
                current += size
        during = current + scratch
        steps.append((phase, i, during))
        if during > peak or peak_pos < 0:
            peak, peak_pos = during, pos
        for root in frees.get(pos, ()):
            current -= live.pop(root, 0)
    if peak_pos < 0:
        return _Run(phase, peak, -1, start, ())
    alive = _alive_at(peak_pos, start, born, last_use, keep)
    return _Run(phase, peak, order[peak_pos], alive, tuple(steps))


def _alive_at(
    pos: int, start: frozenset[int], born: dict[int, int], last_use: dict[int, int], keep: set[int]
) -> frozenset[int]:
    """Storages live while step ``pos`` runs: there from the start or allocated by then,
    and not freed before it. Rebuilt once from the lifetimes, not copied at every new peak."""
    return frozenset(
        r
        for r in (*start, *(r for r, b in born.items() if b <= pos))
        if r in keep or last_use[r] >= pos
    )
