"""A training step of several graph runs as one Problem, so that one solve plans them all.

A step runs the forwards of its runs in order (graph breaks, a module called twice, a
graph rerun in a loop), then their backwards, each holding what the runs before it
saved. ``compose`` lays those sections end to end as one ``Problem``:

- each run's forward nodes, in run order, then each run's backward nodes, in the order
  the backwards ran; a run's nodes keep their relative order, so the schedule of the
  composed problem, restricted to one run, is that run's own schedule under the same
  saved set (``split`` relies on it);
- a gradient one run's backward returns that another run's backward is fed as a tangent
  (the logits' gradient from a loss graph after a graph break) is one storage:
  the tangent becomes a view of it, freed after its last reader;
- ``accumulate``: a transient at the end of a run's backward, for autograd summing a
  gradient into one a later run left in ``.grad`` (a new tensor before the old is freed);
- ``Outside``: memory that code between the runs holds (a loss computed on the returned
  logits, the glue at a graph break), measured per section, as synthetic values that
  no plan can drop: a level live through each section and a peak just before it;
- ``released``: a run's output the caller dropped before the backwards began (the
  logits a Hugging Face model returns beside its loss, or a loss's input once the loss
  is computed) is freed where it died in the code outside: after that code's peak before
  it died (``Outside.early``) and before its peak after, not held to the end like the
  outputs the caller keeps.

Synthetic nodes are named ``outside:*`` and ``accumulate:*``; they cost nothing and are
never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import Plan
from .problem import Node, Problem


@dataclass(frozen=True)
class Link:
    """Run ``source``'s gradient node ``grad`` is what run ``target``'s backward is fed as
    its tangent node ``tangent`` (node indices in each run's own problem)."""

    source: int
    grad: int
    target: int
    tangent: int


@dataclass(frozen=True)
class Outside:
    """Bytes code outside the runs holds, per section of the step (the forwards in run
    order, then the backwards in ``backward_order``): ``level[s]`` live while section
    ``s`` runs; ``peak[s]`` the most live just before it (``peak`` has one more entry:
    after the last section). Where a run's output the caller dropped died in that code
    (``Step.released``), ``peak[s]`` is the most live after it died and ``early[s]`` the
    most live before (by entry as ``peak``; empty: when it died is not known, so it is
    alive through ``peak[s]``)."""

    level: tuple[int, ...]
    peak: tuple[int, ...]
    early: tuple[int, ...] = ()

    @classmethod
    def nothing(cls, sections: int) -> Outside:
        return cls((0,) * sections, (0,) * (sections + 1))

    def before(self, s: int) -> int:
        """The most live in the code before section ``s`` before an output died there."""
        return self.early[s] if self.early else self.peak[s]


@dataclass(frozen=True)
class Step:
    """The runs of one step (their problems in forward order) and how they connect."""

    runs: tuple[Problem, ...]
    backward_order: tuple[int, ...]
    links: tuple[Link, ...] = ()
    accumulate: tuple[int, ...] = ()  # per run, bytes; empty means none
    outside: Outside | None = None
    # (run, output node, section): the caller dropped that output in the code before
    # section ``section`` (at most the first backward's)
    released: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.runs)
        if sorted(self.backward_order) != list(range(n)):
            raise ValueError(
                f"backward_order must be a permutation of the {n} runs, got {self.backward_order}"
            )
        if self.accumulate and len(self.accumulate) != n:
            raise ValueError("accumulate needs one entry per run")
        if self.outside is not None:
            o = self.outside
            if len(o.level) != 2 * n or len(o.peak) != 2 * n + 1:
                raise ValueError(f"outside needs {2 * n} levels and {2 * n + 1} peaks")
            if o.early and len(o.early) != 2 * n + 1:
                raise ValueError(f"outside needs {2 * n + 1} early peaks, or none")
        for r, i, section in self.released:
            if not 0 <= r < n or i not in self.runs[r].outputs or not r < section <= n:
                raise ValueError(
                    f"released ({r}, {i}, {section}): an output of a run, dropped after its "
                    f"forward and before the first backward (section {r + 1} to {n})"
                )
        done = set()
        for r in self.backward_order:
            done.add(r)
            for link in self.links:
                if link.target == r and link.source not in done:
                    raise ValueError(
                        f"run {r}'s backward is fed by run {link.source}'s, which runs later"
                    )


@dataclass(frozen=True)
class Composed:
    """The step as one problem, and where each run's nodes went (``index[r][i]``)."""

    problem: Problem
    index: tuple[tuple[int, ...], ...]


def compose(step: Step, name: str = "step") -> Composed:
    """One ``Problem`` whose plans are the step's plans (module docstring)."""
    runs, n = step.runs, len(step.runs)
    outside = step.outside or Outside.nothing(2 * n)
    intervals = _intervals(outside.level)
    nodes: list[Node] = []
    outputs: list[int] = []
    grads: list[int] = []
    index: list[list[int | None]] = [[None] * len(p) for p in runs]
    alive: dict[int, list[int]] = {}  # interval end -> its synthetic nodes
    # a tangent no node reads keeps nothing alive: its gradient stays a gradient
    links = [k for k in step.links if runs[k.target].consumers[k.tangent]]
    feeds = {(link.target, link.tangent): link for link in links}
    fed = {(link.source, link.grad) for link in links}
    released = {(r, i): section for r, i, section in step.released}

    def add(node: Node, *, keep: bool = False) -> int:
        nodes.append(node)
        i = len(nodes) - 1
        if keep:  # synthetic: kept in a program by being an output or a gradient
            (outputs if node.phase == "fwd" else grads).append(i)
        return i

    def outside_before(s: int) -> None:
        phase = "fwd" if s <= n else "bwd"
        ending = alive.pop(s, [])
        if ending:
            add(Node(f"outside:free{s}", phase, inputs=tuple(ending)), keep=True)
        continuing = sum(b for start, end, b in intervals if start < s < end)
        dropped = [index[r][i] for (r, i), section in released.items() if section == s]
        peak = outside.peak[s]
        if dropped:  # alive through the peak before they died, not the one after
            if outside.before(s) > continuing:
                early = outside.before(s) - continuing
                add(Node(f"outside:early{s}", phase, workspace=early), keep=True)
            add(Node(f"outside:drop{s}", phase, inputs=tuple(dropped)), keep=True)
        else:  # held through it all (an output not released is held to the end)
            peak = max(peak, outside.before(s))
        if peak > continuing:
            add(Node(f"outside:peak{s}", phase, workspace=peak - continuing), keep=True)
        for k, (start, end, b) in enumerate(intervals):
            if start == s:
                node = Node(f"outside:held{s}.{k}", phase, bytes=b, recomputable=False)
                alive.setdefault(end, []).append(add(node))

    for s, r in enumerate(range(n)):
        outside_before(s)
        for i, node in enumerate(runs[r].nodes):
            if node.phase == "fwd":
                index[r][i] = add(_moved(node, index[r]))
    for s, r in enumerate(step.backward_order, start=n):
        outside_before(s)
        for i, node in enumerate(runs[r].nodes):
            if node.phase != "bwd":
                continue
            link = feeds.get((r, i))
            if link is None:
                index[r][i] = add(_moved(node, index[r]))
            else:  # the same storage as the gradient it is
                source = index[link.source][link.grad]
                view = Node(node.name, "bwd", inputs=(source,), alias_of=source, op="alias")
                index[r][i] = add(view)
        if step.accumulate and step.accumulate[r]:
            add(Node(f"accumulate:{r}", "bwd", workspace=step.accumulate[r]), keep=True)
    outside_before(2 * n)
    for r, problem in enumerate(runs):
        outputs += [index[r][i] for i in problem.outputs if (r, i) not in released]
        grads += [index[r][i] for i in problem.grads if (r, i) not in fed]
    problem = Problem(
        tuple(nodes),
        outputs=tuple(sorted(outputs)),
        grads=tuple(sorted(grads)),
        resident_bytes=max((p.resident_bytes for p in runs), default=0),
        name=name,
    )
    return Composed(problem, tuple(tuple(i) for i in index))


def split(composed: Composed, plan: Plan) -> tuple[frozenset[int], ...]:
    """Each run's saved set (its own node indices) under ``plan`` of the composed problem."""
    return tuple(
        frozenset(i for i, j in enumerate(where) if j in plan.saved) for where in composed.index
    )


def joint_order(composed: Composed, plans: tuple[Plan, ...]) -> tuple[int, ...]:
    """The composed problem's backward order running each run's ``plans[r]`` backward:
    each run's recomputes right before the same core node as in its own order (how a
    plan that recomputes some value more than once is carried into the step)."""
    core = composed.problem.backward_core[0]
    in_core = set(core)
    before: dict[int, list[int]] = {}
    for where, plan in zip(composed.index, plans, strict=True):
        pending: list[int] = []
        for i in plan.schedule.backward:
            j = where[i]
            if j not in in_core:
                pending.append(j)
            else:
                before.setdefault(j, []).extend(pending)
                pending = []
    order: list[int] = []
    for c in core:
        order += before.get(c, [])
        order.append(c)
    return tuple(order)


def split_orders(composed: Composed, plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Each run's backward order (its own node indices) under ``plan`` of the composed
    problem: the inverse of ``joint_order``."""
    owner = {j: (r, i) for r, where in enumerate(composed.index) for i, j in enumerate(where)}
    orders: list[list[int]] = [[] for _ in composed.index]
    for j in plan.schedule.backward:
        if j in owner:
            r, i = owner[j]
            orders[r].append(i)
    return tuple(tuple(o) for o in orders)


def joint_saved(composed: Composed, saved: tuple[frozenset[int], ...]) -> frozenset[int]:
    """The composed problem's saved set for each run's ``saved`` (the inverse of ``split``)."""
    return frozenset(composed.index[r][i] for r, run in enumerate(saved) for i in run)


def _moved(node: Node, where: list[int | None]) -> Node:
    """``node`` with its references renumbered into the composed problem."""

    def at(i: int | None) -> int | None:
        return None if i is None else where[i]

    return Node(
        node.name,
        node.phase,
        bytes=node.bytes,
        cost=node.cost,
        inputs=tuple(sorted(where[i] for i in node.inputs)),
        recomputable=node.recomputable,
        alias_of=at(node.alias_of),
        output_of=at(node.output_of),
        op=node.op,
        workspace=node.workspace,
        save_cost=node.save_cost,
    )


def _intervals(level: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(start, end, bytes)`` with, for every section s, the intervals start <= s < end
    summing to ``level[s]``: a stack, so memory taken last is given back first."""
    stack: list[tuple[int, int]] = []
    out: list[tuple[int, int, int]] = []
    total = 0
    for s, h in enumerate(level):
        while total > h:
            start, b = stack.pop()
            total -= b
            keep = max(0, h - total)
            out.append((start, s, b - keep))
            if keep:
                stack.append((start, keep))
                total += keep
        if h > total:
            stack.append((s, h - total))
            total = h
    out += [(start, len(level), b) for start, b in stack]
    return out
