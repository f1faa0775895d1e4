"""Repeated blocks of a joint graph: where a deep model repeats one layer.

A deep model repeats one block N times (a transformer layer), and its joint graph
repeats the block's forward N times and its backward N times in reverse. Found from
the graph alone (not module names): the forward section and the backward section are
each scanned for the period their nodes' local signatures repeat with, backward runs
are paired with the forward runs their reads fall in, and the result is kept only if
every middle block reads the same positions of its neighbours (shift invariance).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .problem import Problem

MIN_BLOCKS = 4  # fewer: too few middle blocks to share a pattern


@dataclass(frozen=True)
class Blocks:
    """``members[k][q]``: the node at position ``q`` of block ``k`` (forward positions
    first, then backward ones); ``block_of``/``position_of`` the inverse (absent for
    nodes outside every block)."""

    members: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.members)

    @cached_property
    def block_of(self) -> dict[int, int]:
        return {i: k for k, nodes in enumerate(self.members) for i in nodes}

    @cached_property
    def position_of(self) -> dict[int, int]:
        return {i: q for nodes in self.members for q, i in enumerate(nodes)}


def find_blocks(problem: Problem) -> Blocks | None:
    """The graph's repeated blocks, or None where it has fewer than ``MIN_BLOCKS`` or
    they are not shift invariant."""
    # where the backward starts: its first node that computes (tangents are read-only)
    split = next((i for i in problem.backward_core[0] if problem.nodes[i].inputs), None)
    if split is None:
        return None
    labels = _labels(problem)
    forward = _periodic_run(labels[:split])
    backward = _periodic_run(labels[split:])
    if forward is None or backward is None:
        return None
    fwd_blocks = _runs(range(split), *forward)
    bwd_blocks = _runs(range(split, len(problem)), *backward)
    members = _pair(problem, fwd_blocks, bwd_blocks)
    if members is None or len(members) < MIN_BLOCKS:
        return None
    blocks = Blocks(tuple(members))
    return blocks if _shift_invariant(problem, blocks) else None


def _labels(problem: Problem) -> np.ndarray:
    """A local signature per node, as small integers: what it is, not where."""
    ids: dict[tuple, int] = {}
    out = np.empty(len(problem), dtype=np.int64)
    for i, n in enumerate(problem.nodes):
        key = (
            n.phase,
            n.op,
            n.bytes,
            n.workspace,
            n.recomputable,
            n.alias_of is not None,
            n.output_of is not None,
            len(n.inputs),
        )
        out[i] = ids.setdefault(key, len(ids))
    return out


def _periodic_run(labels: np.ndarray) -> tuple[int, int, int] | None:
    """``(start, period, repeats)`` of the longest stretch of ``labels`` that repeats one
    period, the shortest period among equally long stretches; None below MIN_BLOCKS."""
    n, best = len(labels), None
    for period in range(1, n // MIN_BLOCKS + 1):
        same = labels[:-period] == labels[period:]
        start, length = _longest_true_run(same)
        repeats = (length + period) // period
        covered = repeats * period
        if repeats >= MIN_BLOCKS and (best is None or covered > best[0]):
            best = (covered, start, period, repeats)
    return None if best is None else best[1:]


def _longest_true_run(flags: np.ndarray) -> tuple[int, int]:
    padded = np.concatenate(([False], flags, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    if not len(edges):
        return 0, 0
    starts, ends = edges[::2], edges[1::2]
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def _runs(indices: range, start: int, period: int, repeats: int) -> list[tuple[int, ...]]:
    return [tuple(indices[start + r * period : start + (r + 1) * period]) for r in range(repeats)]


def _pair(problem: Problem, fwd: list[tuple[int, ...]], bwd: list[tuple[int, ...]]):
    """Each forward run with the backward run whose forward reads fall in it (backward
    run ``j`` reads forward run ``c - j`` for one ``c``); None where no ``c`` holds."""
    run_of = {i: r for r, nodes in enumerate(fwd) for i in nodes}
    votes = Counter()
    for j, nodes in enumerate(bwd):
        for i in nodes:
            for x in problem.nodes[i].inputs:
                if x in run_of:
                    votes[run_of[x] + j] += 1
    if not votes:
        return None
    c = votes.most_common(1)[0][0]
    pairs = [(k, c - k) for k in range(len(fwd)) if 0 <= c - k < len(bwd)]
    if not pairs:
        return None
    return [fwd[k] + bwd[j] for k, j in pairs]


def _shift_invariant(problem: Problem, blocks: Blocks) -> bool:
    """Every middle block (all but the first and the last) reads the same positions of
    blocks at the same distance, or the same nodes outside the blocks. The first and the
    last may differ (the first reads the embedding, the last the head): plans treat
    them as the nodes outside the blocks."""
    block_of, position_of = blocks.block_of, blocks.position_of

    def reads(k: int, i: int) -> tuple:
        return tuple(
            (block_of[x] - k, position_of[x]) if x in block_of else ("outside", x)
            for x in problem.nodes[i].inputs
        )

    middle = range(1, blocks.count - 1)
    return all(
        len({reads(k, blocks.members[k][q]) for k in middle}) == 1
        for q in range(len(blocks.members[0]))
    )
