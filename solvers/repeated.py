"""Planning a deep graph block by block: one saved pattern shared by its middle blocks.

The optimum of a model that repeats one block N times saves nearly the same positions
in every block (docs/solver-notes.md, "Repeated blocks"). So, with
``blocks.find_blocks``:

1. the whole graph's linear relaxation (``linear_bound``): its bound is a
   valid lower bound on every plan, so the reported gap is honest, and its answer
   says, per position of a block, the share of middle blocks that save it;
2. outside the middle blocks (blocks 0 and N - 1, the embedding, the head) the LP's
   answer rounded; in the middle blocks a *pattern*, the positions saved most first:
   the longest such pattern that fits, shared by every middle block;
3. the next longer pattern, which overflows, given to as many blocks as still fit,
   the lower blocks keeping the shorter one (bisection again), for each of the next
   few positions by share: a plan between two patterns;
4. beside them, each position saved by as many middle blocks as the LP's share says
   (spread evenly), and the LP's answer rounded node by node, each with the saves the
   LP was least sure of dropped until the plan fits (bisection): where the optimum
   mixes several patterns, or the blocks' edges weigh;
5. where the best of those is not proven within the gap limit (``cpsat``'s),
   ``exchange.exchange``: one more costly save for a few cheap ones, while that fits
   (the families give a position to whole runs of blocks; the optimum also trades
   single values, say one block's projection saved for four blocks' small values);
6. where it is still not proven, the LP once more, with the backward step where its
   rounded answer overflows most made exact (an exact point, as ``cpsat`` seeds its
   search): a higher bound. (The candidates read off its answer were never cheaper:
   not read.)

The full graph is only simulated: a few dozen times, against thousands for a search
on every node. Where the graph has no repeated blocks, or no pattern fits, ``cpsat``
on the whole graph.

Prior art: Rockmate (Zhao et al., ICML 2023) finds a model's blocks in its graph and
plans each (an ILP per block, then rotor's chain DP over them); here one saved pattern
for every middle block, read off the whole graph's LP.
"""

from __future__ import annotations

import logging
import time

from .blocks import Blocks, find_blocks
from .cpsat import GAP_LIMIT, cpsat
from .exact import add_points
from .exchange import exchange
from .heuristics import savable
from .linear_bound import solve_lp
from .plan import Plan, evaluate, with_bound
from .problem import Problem
from .relaxation import Relaxation

log = logging.getLogger("remat")

NEXT_POSITIONS = 4  # positions tried as the one the longer pattern adds
LP_SECONDS = 120.0  # wall-clock guard on the whole graph's LP
# The pointed LP's wall-clock guard, as a multiple of the time spent before it (the first
# LP and the patterns): room for its usual cost, not for a point far harder than that
# (see docs/solver-notes.md, "Adopted": one pointed LP).
POINTED_FACTOR = 4.0


def repeated(problem: Problem, limit: int | None = None, **cpsat_options) -> Plan:
    """The cheapest pattern plan that fits ``limit`` (see the module docstring), with
    the whole graph's LP bound; ``cpsat`` (given ``cpsat_options``) where the graph
    repeats no block, no pattern fits, or there is no budget."""
    start = time.perf_counter()
    blocks = find_blocks(problem) if limit is not None else None
    if blocks is None:
        return cpsat(problem, limit, **cpsat_options)
    relax = Relaxation(problem, limit, exact=False)
    lp = solve_lp(relax.model, LP_SECONDS)
    if lp is None:
        return cpsat(problem, limit, **cpsat_options)
    values = {v: lp.value(var) for v, var in relax.s.items()}
    best = _Patterns(problem, blocks, values, limit).best()
    if best is None:  # no candidate fits: the whole graph's search
        return cpsat(problem, limit, **cpsat_options)
    bound = lp.bound / relax.scale
    gap_limit = cpsat_options.get("gap_limit", GAP_LIMIT)
    if best.cost - bound > gap_limit * best.cost:
        best = exchange(problem, best, limit)
    if best.cost - bound > gap_limit * best.cost:
        log.info(
            "remat %s: the pattern plan is %.1f%% over the LP's bound; the LP again, with an "
            "exact point",
            problem.name or "graph",
            100 * (best.cost - bound) / best.cost,
        )
        guard = POINTED_FACTOR * (time.perf_counter() - start)
        bound = _pointed_bound(problem, relax, lp, guard)
    log.info(
        "remat %s: %d repeated blocks of %d nodes, planned by pattern",
        problem.name or "graph",
        blocks.count,
        len(blocks.members[0]),
    )
    seconds = time.perf_counter() - start
    return with_bound(best, bound, solver="repeated", limit=limit, seconds=seconds)


def _pointed_bound(problem: Problem, relax: Relaxation, lp, seconds: float) -> float:
    """The module docstring's step 6: the LP's bound with one exact point added where its
    rounded answer overflows most; the first LP's where that answer fits or the pointed
    LP does not finish within ``seconds``."""
    bound = lp.bound
    rounded = evaluate(problem, relax.saved_set(lp.value), solver="repeated")
    if add_points(relax, rounded, count=1):
        pointed = solve_lp(relax.model, seconds, after=lp)
        if pointed is not None:
            bound = max(bound, pointed.bound)
    return bound / relax.scale


class _Patterns:
    """Candidate plans read off the LP's answer (the module docstring's families), each
    simulated on the full graph; ``best`` the cheapest that fits."""

    def __init__(self, problem: Problem, blocks: Blocks, values: dict, limit: int) -> None:
        self.problem, self.blocks, self.limit = problem, blocks, limit
        block_of, position_of = blocks.block_of, blocks.position_of
        last = blocks.count - 1
        self.middle = range(1, last)
        self.fixed = frozenset(
            v for v, x in values.items() if x >= 0.5 and not 0 < block_of.get(v, 0) < last
        )
        share: dict[int, float] = {}
        movable = savable(problem)
        for v, x in values.items():
            if 0 < block_of.get(v, 0) < last and v in movable:
                q = position_of[v]
                share[q] = share.get(q, 0.0) + x / len(self.middle)
        # positions by share, most saved first; those no middle block saves left out
        self.values, self.share = values, share
        self.order = sorted((q for q, x in share.items() if x > 0), key=lambda q: (-share[q], q))
        self.fits: list[Plan] = []

    def saving(self, saved) -> Plan:
        """The plan saving ``saved``, kept among the candidates if it fits."""
        plan = evaluate(self.problem, saved, solver="repeated")
        if plan.peak <= self.limit:
            self.fits.append(plan)
        return plan

    def plan(self, patterns: list) -> Plan:
        """The plan giving middle block ``k`` the pattern ``patterns[k - 1]``."""
        members = self.blocks.members
        saved = set(self.fixed)
        for k, pattern in zip(self.middle, patterns, strict=True):
            saved.update(members[k][q] for q in pattern)
        return self.saving(saved)

    def uniform(self, pattern: frozenset[int]) -> Plan:
        return self.plan([pattern] * len(self.middle))

    def best(self) -> Plan | None:
        self._least_sure_dropped(self._rounded())
        self._least_sure_dropped(self._shares())
        longest = self._longest_uniform()
        if longest is not None:
            for q in self.order[longest : longest + NEXT_POSITIONS]:
                short = frozenset(self.order[:longest])
                self._mixed(short, short | {q})
        return min(self.fits, key=lambda p: (p.cost, p.peak), default=None)

    def _rounded(self) -> list[tuple]:
        """The LP's answer rounded, node by node, as ``(value, seconds per byte, node)``."""
        nodes, movable = self.problem.nodes, savable(self.problem)
        return [
            (x, nodes[v].cost / (nodes[v].bytes + 1), v)
            for v, x in self.values.items()
            if x >= 0.5 and v in movable
        ]

    def _shares(self) -> list[tuple]:
        """Each position saved by as many middle blocks as its LP share says (spread
        evenly), beside the rounded answer outside them, as ``_rounded`` lists it."""
        n, members, nodes = len(self.middle), self.blocks.members, self.problem.nodes
        units = [(1.0, 0.0, v) for v in self.fixed]  # kept: dropped last
        for q, share in self.share.items():
            count = max(0, min(n, round(share * n)))
            spread = [m for m in range(n) if (m + 1) * count // n > m * count // n]
            for m in spread:
                v = members[m + 1][q]
                units.append((share, nodes[v].cost / (nodes[v].bytes + 1), v))
        return units

    def _least_sure_dropped(self, units: list[tuple]) -> None:
        """The plan saving every node of ``units``; where it overflows, the saves the LP
        was least sure of (lowest value, then least recompute time per byte) dropped, as
        few as fit (bisection)."""
        units = sorted(units)

        def dropping(k: int) -> Plan:
            return self.saving(v for _, _, v in units[k:])

        if dropping(0).peak <= self.limit:
            return
        low, high = 0, len(units)  # dropping ``low`` overflows, dropping all may fit
        while high - low > 1:
            mid = (low + high) // 2
            if dropping(mid).peak <= self.limit:
                high = mid
            else:
                low = mid

    def _longest_uniform(self) -> int | None:
        """The most positions (a prefix of ``order``) a uniform pattern saves and fits.
        Scanned from the longest down: saving too little peaks high too (the backward
        rebuilds long chains at once), so the peak is not monotone in the length."""
        for length in range(len(self.order), -1, -1):
            if self.uniform(frozenset(self.order[:length])).peak <= self.limit:
                return length
        return None

    def _mixed(self, short: frozenset[int], long: frozenset[int]) -> None:
        """The fewest lower middle blocks on the ``short`` pattern, the rest on ``long``,
        that fit (bisection over how many)."""
        n = len(self.middle)
        low, high = 0, n  # ``high`` blocks on short fits (the uniform short plan)
        while high - low > 1:
            mid = (low + high) // 2
            if self.plan([short] * mid + [long] * (n - mid)).peak <= self.limit:
                high = mid
            else:
                low = mid
