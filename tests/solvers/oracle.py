"""An independent check of a Schedule: validity rules and a brute-force memory peak.

Written from the module docstrings of ``problem.py``, ``schedule.py`` and
``simulate.py``, not from their code. It deliberately does not use
``Problem.storage``, ``Problem.outputs_of`` or ``Problem.consumers``: the storage
owner of a node is found by following ``alias_of`` here, and the memory at each
step is recomputed from scratch as a set of live storages, instead of with a
running counter and a free list.

Memory rules used (one program at a time):

- a node that is not a view allocates its own storage when it runs; a view
  allocates nothing and its storage is its base's (followed through chains);
- a multi-output op (a node other nodes name in ``output_of``) allocates the
  storages of all its outputs when it runs; running a getitem allocates nothing;
- running a node *touches* its own storage, the storages of its inputs, and (for
  a multi-output op) the storages of all its outputs, but one handed over that it
  re-runs over: the kernel writes a second buffer (live at that step only) and does
  not read the first;
- a node's ``workspace`` bytes count at its own step only;
- a storage is live at step ``p`` if it was allocated at or before ``p`` (or came
  in live at the program's start) and it is kept by the program or touched at
  some step ``>= p``;
- the forward starts empty and keeps the storages of the outputs and the saved
  values; the backward starts with exactly those live and keeps the storages of
  the outputs (held by the caller until the step ends) and of the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.solvers import Problem, Schedule, Timeline


def storage_owner(problem: Problem, i: int) -> int:
    """Follow ``alias_of`` to the node that owns the storage ``i`` lives in."""
    seen = set()
    while problem.nodes[i].alias_of is not None:
        assert i not in seen, f"alias cycle through node {i}"
        seen.add(i)
        i = problem.nodes[i].alias_of
    return i


def multi_outputs(problem: Problem, op: int) -> list[int]:
    """The getitem nodes that name ``op`` in ``output_of``."""
    return [k for k, n in enumerate(problem.nodes) if n.output_of == op]


def _ancestors(problem: Problem, roots, through) -> set[int]:
    """Nodes reachable from ``roots`` along inputs, expanding only nodes where ``through``."""
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        if through(i):
            todo.extend(problem.nodes[i].inputs)
    return seen


# ----------------------------------------------------------------------------- validity


def validity_errors(
    problem: Problem, sched: Schedule, requested: frozenset[int] | None = None
) -> list[str]:
    """Every rule the schedule breaks, as readable lines (empty when valid).

    ``requested`` is the saved set the schedule was asked for, when known.
    """
    nodes = problem.nodes
    errors: list[str] = []
    err = errors.append

    def phase(i: int) -> str:
        return nodes[i].phase

    # forward program: forward nodes only, each once, inputs earlier in the forward
    fpos: dict[int, int] = {}
    for p, i in enumerate(sched.forward):
        if not 0 <= i < len(nodes):
            err(f"forward step {p}: {i} is not a node")
            continue
        if i in fpos:
            err(f"forward runs node {i} twice")
        if phase(i) != "fwd":
            err(f"forward runs backward node {i}")
        for j in nodes[i].inputs:
            if j not in fpos:
                err(f"forward runs {i} before its input {j}")
        fpos[i] = p
    for o in problem.outputs:
        if o not in fpos:
            err(f"output {o} is not computed by the forward")
    for s in sched.saved:
        if phase(s) != "fwd":
            err(f"saved value {s} is not a forward node")
        if s not in fpos:
            err(f"saved value {s} is not computed by the forward")

    # backward program
    bpos: dict[int, int] = {}
    for p, i in enumerate(sched.backward):
        if not 0 <= i < len(nodes):
            err(f"backward step {p}: {i} is not a node")
            continue
        if i in bpos:
            err(f"backward runs node {i} twice")
        if phase(i) == "fwd":
            if not nodes[i].recomputable:
                err(f"backward recomputes non-recomputable node {i} ({nodes[i].name})")
            if i not in sched.recomputed:
                err(f"backward runs forward node {i} but it is not listed as recomputed")
        for j in nodes[i].inputs:
            if j in bpos:
                continue
            if phase(j) == "fwd" and j in sched.saved:
                continue
            err(f"backward runs {i} before its input {j} (not earlier, not saved)")
        bpos[i] = p

    in_bwd_fwd = {i for i in sched.backward if phase(i) == "fwd"}
    if set(sched.recomputed) != in_bwd_fwd:
        err(
            f"recomputed {sorted(sched.recomputed)} != forward nodes in backward "
            f"{sorted(in_bwd_fwd)}"
        )
    if sched.saved & sched.recomputed:
        err(f"saved and recomputed overlap: {sorted(sched.saved & sched.recomputed)}")
    for g in problem.grads:
        if g in bpos:
            continue
        if phase(g) == "fwd" and g in sched.saved:
            continue
        err(f"gradient {g} is never computed")

    # exactness of what each program runs (schedule.py's docstring)
    bwd_core = _ancestors(problem, problem.grads, lambda i: phase(i) == "bwd")
    bwd_core = {i for i in bwd_core if phase(i) == "bwd"}
    ran_bwd = [i for i in sched.backward if phase(i) == "bwd"]
    if set(ran_bwd) != bwd_core:
        err(f"backward nodes run {sorted(ran_bwd)} != those the gradients need {sorted(bwd_core)}")
    if ran_bwd != sorted(ran_bwd):
        err(f"backward nodes not in problem order: {ran_bwd}")
    need_fwd = _ancestors(problem, [*problem.outputs, *sched.saved], lambda i: True)
    if set(sched.forward) != need_fwd:
        err(
            f"forward runs {sorted(sched.forward)} != what outputs and saved need "
            f"{sorted(need_fwd)}"
        )
    readers: dict[int, list[int]] = {}
    for p, i in enumerate(sched.backward):
        for j in nodes[i].inputs:
            readers.setdefault(j, []).append(p)
    for s in sched.saved:
        if s not in readers and s not in problem.grads:
            err(f"saved value {s} is never read by the backward")
    for r in sched.recomputed:
        if r not in readers and r not in problem.grads:
            err(f"recomputed value {r} is never read by the backward")
    if requested is not None:
        forced = {s for s in sched.saved if s not in requested}
        # Besides non-recomputable values, a value whose own storage stays allocated
        # through the backward anyway (a caller-held output, the base of a saved view)
        # is handed over rather than rebuilt into a second buffer.
        owners = {storage_owner(problem, i) for i in (*problem.outputs, *sched.saved)}
        for s in forced:
            if nodes[s].recomputable and not (nodes[s].alias_of is None and s in owners):
                err(f"saved value {s} was not requested and could be recomputed")
        if requested & sched.recomputed:
            err(f"requested values recomputed: {sorted(requested & sched.recomputed)}")

    expected = math.fsum(nodes[i].cost for i in sched.recomputed if i in fpos)
    if not math.isclose(sched.recompute_cost, expected, rel_tol=1e-9, abs_tol=1e-9):
        err(f"recompute_cost {sched.recompute_cost} != {expected}")
    return errors


def placement_errors(problem: Problem, sched: Schedule) -> list[str]:
    """A recompute runs just before its first reader: only recomputes in between.

    Getitems of a recomputed multi-output op are exempt: they follow the op at once.
    """
    nodes = problem.nodes
    errors = []
    pos = {i: p for p, i in enumerate(sched.backward)}
    for r in sched.recomputed:
        if nodes[r].output_of is not None:
            continue
        first = min((pos[i] for i in sched.backward if r in nodes[i].inputs), default=None)
        if first is None:
            continue  # a gradient nobody reads
        between = sched.backward[pos[r] + 1 : first]
        late = [i for i in between if nodes[i].phase == "bwd"]
        if late:
            errors.append(f"recompute of {r} runs before backward nodes {late}, not just in time")
    return errors


def assert_valid(problem: Problem, sched: Schedule, requested=None) -> None:
    errors = validity_errors(problem, sched, requested)
    assert not errors, "invalid schedule:\n  " + "\n  ".join(errors)


# ----------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class ProgramMemory:
    phase: str
    steps: tuple[tuple[str, int, int], ...]  # (phase, node, bytes live at that step)
    live: tuple[frozenset[int], ...]  # storages live at each step
    peak: int
    reallocated: tuple[tuple[int, int], ...]  # (node run, storage) allocated while live


@dataclass(frozen=True)
class Memory:
    forward: ProgramMemory
    backward: ProgramMemory

    @property
    def peak(self) -> int:
        return max(self.forward.peak, self.backward.peak)

    @property
    def reallocated(self) -> tuple[tuple[int, int], ...]:
        return self.forward.reallocated + self.backward.reallocated


def _program(
    problem: Problem, phase: str, order, incoming: set[int], keep: set[int]
) -> ProgramMemory:
    nodes = problem.nodes
    allocated_at: dict[int, int] = {r: -1 for r in incoming}
    touched: dict[int, list[int]] = {}
    reallocated = []
    rewritten: dict[int, int] = {}  # step -> bytes of a saved output its re-run op rewrites
    for p, i in enumerate(order):
        node = nodes[i]
        touch = {storage_owner(problem, i)} | {storage_owner(problem, j) for j in node.inputs}
        if node.output_of is None:
            for w in [i, *multi_outputs(problem, i)]:
                owner = storage_owner(problem, w)
                if nodes[w].alias_of is None and owner in allocated_at and w != i:
                    # the kernel writes a second buffer for an output already handed
                    # over, without reading that one; nothing reads it, it dies with
                    # the step
                    rewritten[p] = rewritten.get(p, 0) + nodes[w].bytes
                    continue
                touch.add(owner)
                if nodes[w].alias_of is None:
                    if owner in allocated_at:
                        reallocated.append((i, owner))
                    else:
                        allocated_at[owner] = p
        for owner in touch:
            touched.setdefault(owner, []).append(p)

    steps, lives = [], []
    for p, i in enumerate(order):
        live = frozenset(
            s
            for s, at in allocated_at.items()
            if at <= p and (s in keep or max(touched.get(s, [-1])) >= p)
        )
        lives.append(live)
        # workspace: scratch the kernel holds while it runs, this step only
        scratch = nodes[i].workspace + rewritten.get(p, 0)
        steps.append((phase, i, sum(nodes[s].bytes for s in live) + scratch))
    if steps:
        peak = max(b for _, _, b in steps)
    else:  # an empty program holds only what it keeps of what came in
        peak = sum(nodes[s].bytes for s in incoming if s in keep)
    return ProgramMemory(phase, tuple(steps), tuple(lives), peak, tuple(reallocated))


def memory(problem: Problem, sched: Schedule) -> Memory:
    held = {storage_owner(problem, o) for o in problem.outputs}
    handed = held | {storage_owner(problem, s) for s in sched.saved}
    fwd = _program(problem, "fwd", sched.forward, set(), handed)
    grads = {storage_owner(problem, g) for g in problem.grads}
    bwd = _program(problem, "bwd", sched.backward, set(handed), held | grads)
    return Memory(fwd, bwd)


def assert_memory_matches(problem: Problem, sched: Schedule, timeline: Timeline) -> Memory:
    """The simulator's timeline, step by step, equals the brute-force one."""
    mem = memory(problem, sched)
    assert timeline.forward_peak == mem.forward.peak, (timeline.forward_peak, mem.forward.peak)
    assert timeline.backward_peak == mem.backward.peak, (timeline.backward_peak, mem.backward.peak)
    assert timeline.peak == mem.peak, (timeline.peak, mem.peak)
    expected_steps = mem.forward.steps + mem.backward.steps
    assert list(timeline.steps) == list(expected_steps), _first_diff(timeline.steps, expected_steps)
    prog = mem.forward if timeline.peak_phase == "fwd" else mem.backward
    assert prog.peak == timeline.peak
    if prog.steps:
        at = [k for k, (_, i, _) in enumerate(prog.steps) if i == timeline.peak_node]
        assert at, f"peak node {timeline.peak_node} is not run in {timeline.peak_phase}"
        assert prog.steps[at[0]][2] == timeline.peak
        assert timeline.live_at_peak == prog.live[at[0]], (
            sorted(timeline.live_at_peak),
            sorted(prog.live[at[0]]),
        )
    return mem


def _first_diff(got, want) -> str:
    for k, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"step {k}: simulate {a} != oracle {b}"
    return f"lengths differ: simulate {len(got)} != oracle {len(want)}"


def check(problem: Problem, sched: Schedule, timeline: Timeline, requested=None) -> Memory:
    """Validity plus exact memory agreement: what every property test asserts."""
    assert_valid(problem, sched, requested)
    errors = placement_errors(problem, sched)
    assert not errors, "\n".join(errors)
    return assert_memory_matches(problem, sched, timeline)
