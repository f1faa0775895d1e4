"""Walk a Schedule and account every byte: the predicted memory timeline.

The accounting mirrors how the rewritten fx programs run: a node's output is
allocated when it (or, for a multi-output op's outputs, the op) runs; a
storage is freed right after the last node that reads it or any of its views,
unless the program returns it. The forward returns its outputs and the saved
values; the backward starts with them live and returns the gradients. Forward
outputs are assumed held by the caller until the step ends (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    fwd = _run(problem, "fwd", sched.forward, (), fwd_keep)
    bwd_keep = held_by_caller | {storage[i] for i in problem.grads}
    bwd = _run(problem, "bwd", sched.backward, tuple(fwd_keep), bwd_keep)
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
    start: tuple[int, ...],
    keep: set[int],
) -> _Run:
    """Run one program with the storages ``start`` live; storages in ``keep`` survive it.

    Vectorised, as the heuristics spend most of their time here (see docs/solver-notes.md,
    "Adopted": vectorised simulator): a storage is live from the step that allocates it
    (or the start) through its last use, so the bytes live at each step are a running
    sum of allocations minus the frees after each last use. Each storage is allocated
    by one node, which runs at most once per program: a storage allocated while live
    is a saved output its op re-runs over, a second buffer counted at that step only.
    """
    if len(set(order)) < len(order):
        return _run_copies(problem, phase, order, start, keep)
    packed, size = problem.packed, len(problem.nodes)
    steps = np.array(order, dtype=np.int64)
    kept = np.zeros(size, dtype=bool)
    kept[list(keep)] = True
    live = np.array(start, dtype=np.int64)
    was_live = np.zeros(size, dtype=bool)
    was_live[live] = True
    alloc_step, alloc_at = _gather(packed.alloc_ptr, steps)
    roots, sizes = packed.alloc_roots[alloc_at], packed.alloc_bytes[alloc_at]
    again = was_live[roots]
    touch_step, touch_at = _gather(packed.touch_ptr, steps)
    touch_roots = packed.touch_roots[touch_at]
    if again.any():  # an op re-run over a value handed over writes anew: not a read of it
        rewrite = np.isin(touch_step * size + touch_roots, alloc_step[again] * size + roots[again])
        touch_step, touch_roots = touch_step[~rewrite], touch_roots[~rewrite]
    last_use = np.full(size, -1, dtype=np.int64)
    np.maximum.at(last_use, touch_roots, touch_step)
    live = live[kept[live] | (last_use[live] >= 0)]
    if not len(steps):
        return _Run(phase, int(packed.bytes[live].sum()), -1, frozenset(live.tolist()), ())
    scratch = packed.workspace[steps]
    np.add.at(scratch, alloc_step[again], sizes[again])
    born, born_step, born_bytes = roots[~again], alloc_step[~again], sizes[~again]
    delta = np.zeros(len(steps) + 1, dtype=np.int64)
    np.add.at(delta, born_step, born_bytes)
    freed = ~kept[born]
    np.add.at(delta, last_use[born[freed]] + 1, -born_bytes[freed])
    dropped = live[~kept[live]]
    np.add.at(delta, last_use[dropped] + 1, -packed.bytes[dropped])
    during = packed.bytes[live].sum() + np.cumsum(delta[:-1]) + scratch

    pos = int(np.argmax(during))  # the first step at the peak
    there = np.concatenate((live, born[born_step <= pos]))
    alive = there[kept[there] | (last_use[there] >= pos)]
    trace = tuple(zip([phase] * len(order), order, during.tolist(), strict=True))
    return _Run(phase, int(during[pos]), order[pos], frozenset(alive.tolist()), trace)


def _run_copies(
    problem: Problem,
    phase: str,
    order: tuple[int, ...],
    start: tuple[int, ...],
    keep: set[int],
) -> _Run:
    """``_run`` for an order that runs some nodes more than once (multiple recomputation).

    Each run of a node makes new copies of the storages it allocates. A node that ran
    reads as the copy it made (a view: the copy its base read as when the view ran; an
    output of a multi-output op: the copy its op's latest run wrote); a node that did
    not run reads as the storage live at the start. A copy lives from its making
    through its last read; a kept storage's copy from the start (else its last one)
    lives to the end. With no repeats this accounts as ``_run`` does.
    """
    copies, workspace = _walk_copies(problem, order, start)
    return _account_copies(phase, order, copies, workspace, keep)


@dataclass
class _Copies:
    """The copies of storages one program starts with or makes, by index: ``roots`` (the
    storage), ``sizes``, ``made`` (the step it is made at, -1: live at the start) and
    ``last`` (the step of its last read, -1: none); ``at_start`` and ``written``: the
    copy of each storage live at the start, and the one its latest allocation made."""

    roots: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    made: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    at_start: dict[int, int] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)

    def new(self, root: int, nbytes: int, step: int) -> int:
        self.sizes.append(nbytes)
        self.roots.append(root)
        self.made.append(step)
        self.last.append(-1)
        return len(self.sizes) - 1


def _walk_copies(
    problem: Problem, order: tuple[int, ...], start: tuple[int, ...]
) -> tuple[_Copies, np.ndarray]:
    """Run ``order`` from the storages ``start``: the copies made and read (the rules in
    ``_run_copies``), and each step's workspace."""
    nodes, storage, allocations = problem.nodes, problem.storage, problem.allocations
    copies = _Copies()
    at_start, written = copies.at_start, copies.written
    reads_as: dict[int, int] = {}  # node (that ran) -> its copy

    def copy_of(j: int) -> int:
        return reads_as[j] if j in reads_as else at_start.get(storage[j], -1)

    for root in start:
        at_start[root] = copies.new(root, int(nodes[root].bytes), -1)
    workspace = np.zeros(len(order), dtype=np.int64)
    for t, i in enumerate(order):
        node = nodes[i]
        touched = [copy_of(j) for j in node.inputs]
        for root, nbytes in allocations[i]:  # a re-run writes new copies, reading none
            written[root] = copies.new(root, nbytes, t)
            touched.append(written[root])
        if node.alias_of is not None:
            reads_as[i] = copy_of(node.alias_of)
        elif node.output_of is not None:
            reads_as[i] = written.get(i, at_start.get(i, -1))
        else:
            reads_as[i] = written.get(i, at_start.get(storage[i], -1))
        touched.append(reads_as[i])
        for c in touched:
            if c >= 0:
                copies.last[c] = t
        workspace[t] = node.workspace
    return copies, workspace


def _account_copies(
    phase: str, order: tuple[int, ...], copies: _Copies, workspace: np.ndarray, keep: set[int]
) -> _Run:
    """The bytes live at each step of ``order``, its peak and the storages live there:
    each copy from its making through its last read, a kept storage's last copy to the
    end; copies live at the start that nothing reads or keeps are not this program's."""
    sizes, roots, made, last = copies.sizes, copies.roots, copies.made, copies.last
    at_start, written = copies.at_start, copies.written
    final = {at_start[r] if r in at_start else written[r] for r in keep
             if r in at_start or r in written}  # fmt: skip
    delta = np.zeros(len(order) + 1, dtype=np.int64)
    base = 0
    counted = []
    for c, nbytes in enumerate(sizes):
        if made[c] < 0 and c not in final and last[c] < 0:
            continue  # live at the start, never read, not kept: not this program's
        counted.append(c)
        if made[c] < 0:
            base += nbytes
        else:
            delta[made[c]] += nbytes
        if c not in final:
            delta[max(last[c], made[c]) + 1] -= nbytes
    during = base + np.cumsum(delta[:-1]) + workspace
    pos = int(np.argmax(during))
    # a re-run over a storage live at the start that nothing reads after is a second
    # buffer for its step only, as ``_run`` counts it: bytes, not a live storage
    second = {c for c in counted if made[c] >= 0 and roots[c] in at_start and last[c] <= made[c]}
    alive = frozenset(
        roots[c] for c in counted
        if made[c] <= pos and (c in final or max(last[c], made[c]) >= pos) and c not in second
    )  # fmt: skip
    trace = tuple(zip([phase] * len(order), order, during.tolist(), strict=True))
    return _Run(phase, int(during[pos]), order[pos], alive, trace)


def _gather(ptr: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For per-node lists in CSR form (``ptr``), each entry of the nodes ``steps`` run:
    the step it belongs to and its index into the flat list, in step order."""
    first = ptr[steps]
    counts = ptr[steps + 1] - first
    ends = np.cumsum(counts)
    step = np.repeat(np.arange(len(steps)), counts)
    return step, np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - counts - first, counts)
