"""The program as given: what a module's own eager step holds, phase by phase, found by
running it once under fake tensors (no kernels run, nothing is allocated).

A compiled program can hold more than the module's eager one: where the model's code
takes another path when dynamo traces it (transformers' Mamba runs a parallel scan
compiled and a loop eagerly), storing everything the traced graph saves can need far
more than the step the user had. These figures cap what a fraction of the budget is of,
so budget 1.0 never plans above the program as given (docs/guide.md, "What the budget
means")."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from remat.costs.graph import allocated_bytes
from remat.passes._torch_compat import FakeTensorMode, storage_key, tree_flatten, tree_map
from remat.passes.extract import Extracted
from remat.solvers import (
    InfeasibleBudget,
    Plan,
    Problem,
    evaluate,
    format_bytes,
    held_bytes,
    store_all,
)
from remat.solvers.simulate import Timeline
from remat.solvers.step import Composed, joint_saved
from remat.storages import StorageCounter, fresh

log = logging.getLogger("remat")


@dataclass(frozen=True)
class Phases:
    """Bytes a step holds above what was resident before it, per phase: the peak while
    the forward runs (its outputs included), what is live when it returns (its outputs
    and what autograd saved), the peak while the backward runs (from that on, with the
    tangents and the gradients; the outputs held to its end), as remat's simulator
    splits a plan's timeline."""

    forward: int
    held: int
    backward: int


def eager_peak(
    timeline: Timeline, forward: set[int], backward: set[int], stored: Phases, eager: Phases
) -> int:
    """The peak of a step around the module run eagerly, from ``timeline``, the step with
    the module's graph storing everything (its nodes there: ``forward``, ``backward``;
    its own ``stored`` phases): while the graph's forward runs, the step holds what it
    holds then less the graph's forward peak plus the eager one; between its forward and
    its backward, the same with what each holds; in its backward, with their backward
    peaks. The code around the module holds the same either way, and nothing else runs
    during the module's forward or backward, so this is the eager step's peak wherever
    the eager step holds its outputs as the graph does."""
    peak = 0
    started = ended = False
    for _, node, live in timeline.steps:
        if node in forward:
            started = True
            live += eager.forward - stored.forward
        elif node in backward:
            ended = True
            live += eager.backward - stored.backward
        elif started and not ended:
            live += eager.held - stored.held
        peak = max(peak, live)
    return peak


def stored_phases(problem: Problem, plan: Plan) -> Phases:
    """A plan's peak in its forward, what it holds between its programs, and its peak in
    its backward, as ``as_given`` measures the eager step."""
    timeline = plan.timeline
    return Phases(timeline.forward_peak, held_bytes(problem, plan), timeline.backward_peak)


def as_measured(extracted: Extracted, stored: Plan, eager: Phases) -> Phases:
    """``eager`` with what the graph's kernels hold beyond their tensors' sizes added, phase
    by phase: the fake run counts tensors as fake tensors size them and sees no kernel's
    scratch, where remat measured both (``KernelMemory``: CPU ``mse_loss`` keeps its scalar
    in an input-sized buffer). The graph storing everything (``stored``), counted both
    ways, says how much they add to each phase; a module whose compiled program is its
    eager one comes out at exactly ``stored``'s phases, so nothing is capped."""
    problem = extracted.problem
    plain = _nominal(extracted)
    real, counted = stored_phases(problem, stored), stored_phases(plain, store_all(plain))
    return Phases(
        eager.forward + real.forward - counted.forward,
        eager.held + real.held - counted.held,
        eager.backward + real.backward - counted.backward,
    )


def _nominal(extracted: Extracted) -> Problem:
    """``extracted``'s problem with each kernel's output its tensors' own size and no
    scratch, as a fake run counts them."""
    nodes = []
    for node, fx_node in zip(extracted.problem.nodes, extracted.fx_nodes, strict=True):
        nbytes = node.bytes
        if nbytes and _single_output_kernel(fx_node):
            nbytes = min(nbytes, allocated_bytes(fx_node))
        nodes.append(dataclasses.replace(node, bytes=nbytes, workspace=0))
    return dataclasses.replace(extracted.problem, nodes=tuple(nodes))


def _single_output_kernel(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is not operator.getitem
        and not isinstance(node.meta.get("val"), (list, tuple))
    )


def graph_eager_peak(
    problem: Problem, stored: Plan, eager: Phases, room: Composed | None = None
) -> int:
    """The peak of the graph's step had the module run eagerly (``eager_peak``; ``eager``
    as measured: ``as_measured``), from ``stored``, its plan storing everything; with
    ``room`` (the graph ``first_step.with_room``), the code after the graph holding its
    room between the graph's forward and its backward."""
    forward = {i for i, node in enumerate(problem.nodes) if node.phase == "fwd"}
    backward = set(range(len(problem))) - forward
    timeline = stored.timeline
    if room is not None:
        (where,) = room.index
        forward, backward = {where[i] for i in forward}, {where[i] for i in backward}
        timeline = evaluate(
            room.problem, joint_saved(room, (stored.saved,)), solver="store-all"
        ).timeline
    return eager_peak(timeline, forward, backward, stored_phases(problem, stored), eager)


def below_eager(refusal: InfeasibleBudget, eager: int) -> InfeasibleBudget:
    """``refusal`` of a fraction that was of the module's eager step (``eager`` bytes, at
    the refusal's scale), saying so: the compiled program cannot come down to what the
    module holds eagerly, which only a budget in bytes above it, or no remat, runs."""
    r = refusal
    note = (
        f"A fraction is of your module's eager step here ({format_bytes(eager)}, run under "
        "fake tensors before the first step: docs/guide.md, 'What the budget means'), which "
        "holds less than the program dynamo compiled from it can come down to (its code "
        "takes another path when compiled, or its kernels hold less than the traced ops). "
        "Give a budget in bytes at least the minimum above, or run the module without remat."
    )
    return InfeasibleBudget(
        r.limit, r.minimum, r.store_all, r.graph, r.proven, f"{r.note} {note}".strip(),
        lowest_proven=r.lowest_proven, reference=r.reference,
    )  # fmt: skip


def eager_phases(module: nn.Module, args: tuple, kwargs: dict) -> Phases | None:
    """``module(*args, **kwargs)`` and its backward, run eagerly under fake tensors with the
    module's parameters and buffers faked too (``torch.func.functional_call``): real ones,
    their gradients and buffers are untouched, and no random state moves. The backward
    starts from the scalar outputs that need a gradient (a loss), where there are any,
    else from every output that needs one, with tangents of ones; every output is held
    to the end, as remat's simulator holds a graph's. None where it cannot run so (an op
    whose output size depends on data, a collective), logged: nothing is capped then."""
    mode = FakeTensorMode()
    state = {f"module.{k}": mode.from_tensor(v) for k, v in _state(module).items()}
    fake_args, fake_kwargs = tree_map(lambda v: _faked(mode, v), (args, kwargs))
    counter = _Counter()
    try:
        with _attributes_kept(module):
            _run(module, state, fake_args, fake_kwargs, counter, mode)
    except Exception as failure:
        log.info(
            "remat: the module's eager step could not run under fake tensors (%s: %s); "
            "a fraction of the budget is of the compiled programs only",
            type(failure).__name__,
            " ".join(str(failure).split())[:200],
        )
        return None
    return counter.phases()


def _run(module, state, args, kwargs, counter: _Counter, mode: FakeTensorMode) -> None:
    with mode, counter:
        leaves = [v for v in state.values() if v.requires_grad]
        torch.func.functional_call(_Step(module, leaves, counter), state, args, kwargs)


@contextlib.contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[None]:
    """Every submodule's attributes as they were, whatever the run set: a forward that
    caches what it computed (an RNN's ``_flat_weights``, rotary tables) or counts its
    calls would otherwise keep fake tensors or count one call too many. Lists and dicts
    they hold get their items back too, in the same objects."""
    kept = []
    for m in module.modules():
        attributes = dict(m.__dict__)
        items = {k: _items(v) for k, v in attributes.items() if isinstance(v, (list, dict))}
        kept.append((m, attributes, items))
    try:
        yield
    finally:
        for m, attributes, items in kept:
            m.__dict__.clear()
            m.__dict__.update(attributes)
            for k, was in items.items():
                held = attributes[k]
                held.clear()
                held.update(was) if isinstance(held, dict) else held.extend(was)


def _items(container: list | dict) -> list | dict:
    return list(container) if isinstance(container, list) else dict(container)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    return state


def _faked(mode: FakeTensorMode, value: object) -> object:
    return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


class _Step(nn.Module):
    """The module's forward and its backward as one call, so ``functional_call`` keeps
    the fake parameters in place through the backward (a checkpointed region runs its
    forward again there). ``autograd.grad``, not ``backward``: the gradients are taken
    as the engine makes them, as eager's ``.grad`` takes them (no copy)."""

    def __init__(self, module: nn.Module, leaves: list[torch.Tensor], counter: _Counter) -> None:
        super().__init__()
        self.module = module
        self.leaves = leaves  # the fake parameters that need gradients
        self.counter = counter

    def forward(self, *args, **kwargs) -> None:
        out = self.module(*args, **kwargs)
        needing = [t for t in tree_flatten(out)[0] if _differentiable(t)]
        roots = [t for t in needing if t.numel() == 1] or needing  # a loss, where there is one
        self.counter.forward_returned()
        if not roots:
            raise ValueError("no output needs a gradient: not a training step")
        leaves = self.leaves + [
            t for t in tree_flatten((args, kwargs))[0] if _differentiable(t) and t.is_leaf
        ]
        tangents = [torch.ones_like(t) for t in roots]
        self.counter.backward_started()
        torch.autograd.grad(roots, leaves, tangents, allow_unused=True)
        self.counter.backward_returned()


def _differentiable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


class _Counter(StorageCounter):
    """Live bytes of the storages ops make, each counted until it dies
    (``StorageCounter``), with their peak per phase. In the backward, autograd sums two gradients of
    one value in place where it holds the only reference to one of them (its
    ``InputBuffer``): an ``add`` whose operand dies before the next op, of the output's
    size, allocated nothing eagerly. Fake tensors (a tensor subclass) never take that
    path, so it is modelled here."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.in_backward = False
        self.figures: list[int] = []
        # the last op, where it was a backward add: (operands' keys, output bytes, level before)
        self._add: tuple[set[int], int, int] | None = None
        self._freed_since: dict[int, int] = {}  # storages freed since the last op: key -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._settle()
        before = self.level
        out = func(*args, **(kwargs or {}))
        made = sum(self._track(t) for t in fresh(args, kwargs, out, _is_tensor))
        if self.in_backward and func is torch.ops.aten.add.Tensor and made:
            operands = {storage_key(t) for t in args if _is_tensor(t)}
            self._add = (operands, made, before)
        else:
            self.peak = max(self.peak, self.level)
        return out

    def _settle(self) -> None:
        """The peak of the last op, where it was a backward ``add``: at the level before
        it where an operand of its size died right after it (summed in place eagerly)."""
        if self._add is not None:
            read, made, before = self._add
            in_place = any(self._freed_since.get(k) == made for k in read)
            self.peak = max(self.peak, before if in_place else before + made)
            self._add = None
        self._freed_since = {}

    def _released(self, key: int, nbytes: int) -> None:
        self._freed_since[key] = nbytes

    def forward_returned(self) -> None:
        self._settle()
        self.figures += [self.peak, self.level]

    def backward_started(self) -> None:
        self._settle()
        self.peak = self.level
        self.in_backward = True

    def backward_returned(self) -> None:
        self._settle()
        self.figures.append(self.peak)
        self.in_backward = False

    def phases(self) -> Phases:
        return Phases(*self.figures)


def _is_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor)
