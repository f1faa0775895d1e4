"""The one graph walk the solvers share: everything reachable from some nodes.

A plain function over index lists rather than networkx: the greedy runs this walk
hundreds of thousands of times over a few nodes each, where networkx's per-call cost is
several times the walk's (see docs/solver-notes.md, "Adopted": one graph walk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def reachable(
    starts: Iterable[int],
    successors: Sequence[Iterable[int]],
    stop: Callable[[int], bool] | None = None,
) -> set[int]:
    """The nodes reachable from ``starts`` (themselves included) along ``successors[i]``,
    neither entering nor walking past a node where ``stop`` holds (starts included).

    Depth-first, in a fixed order: the same arguments give a set built in the same
    order, so iterating it (a sum of float costs) gives the same result every time.
    """
    seen: set[int] = set()
    stack = list(starts)
    if stop is None:
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(successors[i])
        return seen
    while stack:
        i = stack.pop()
        if i in seen or stop(i):
            continue
        seen.add(i)
        stack.extend(successors[i])
    return seen
