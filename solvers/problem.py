"""The planning problem as pure data: a joint forward+backward graph in execution order.

No torch here (a test enforces it): a Problem is built from an fx graph by
``remat.passes.extract`` and from random DAGs by the property tests.

Memory model, shared by ``schedule`` and ``simulate``:

- Each node allocates ``bytes`` when it runs. A view (``alias_of`` set) allocates
  nothing and keeps its base's storage alive while it is alive.
- An output of a multi-output op (``output_of`` set, a ``getitem`` in fx) is
  allocated when that op runs, because that is when the kernel writes it.
- ``workspace`` bytes are scratch a kernel allocates and frees while it runs
  (convolution's im2col buffers): they count at that node's step only.

A plan's cost is the step's extra time: ``cost`` seconds of each value it recomputes
plus ``save_cost`` seconds of each storage it keeps for the backward (``Plan.cost``).
- Parameters and user inputs are resident before the step and are not nodes;
  gradients (``grads``) and the tangents fed to the backward are nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from .graph import reachable

Phase = Literal["fwd", "bwd"]


@dataclass(frozen=True)
class Node:
    """One value of the joint graph.

    ``phase`` is ``"fwd"`` for values that do not depend on a tangent (they can
    be computed in the forward and saved, or computed again in the backward) and
    ``"bwd"`` for values that do (they exist only in the backward).
    """

    name: str
    phase: Phase
    bytes: int = 0
    cost: float = 0.0
    inputs: tuple[int, ...] = ()
    recomputable: bool = True
    alias_of: int | None = None
    output_of: int | None = None
    op: str = ""
    workspace: int = 0
    # seconds the step pays for keeping this storage from the forward into the backward
    # rather than freeing it (traffic a fusing compiler would avoid, colder reads): set on
    # storage owners, charged once per saved storage (``Plan.save_cost``)
    save_cost: float = 0.0


@dataclass(frozen=True)
class Problem:
    """Nodes in execution order plus which of them leave the step.

    ``outputs`` are forward values returned to the caller (held, conservatively,
    until the step ends); ``grads`` are backward values held until the backward ends:
    the gradients it returns (and, from ``passes.extract``, the scalar tangent autograd
    holds while it runs).
    ``resident_bytes`` is what was allocated before the step (reported, never
    part of a peak).
    """

    nodes: tuple[Node, ...]
    outputs: tuple[int, ...] = ()
    grads: tuple[int, ...] = ()
    resident_bytes: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "grads", tuple(self.grads))
        for i, node in enumerate(self.nodes):
            _check_node(self.nodes, i, node)
        for i in self.outputs:
            if not 0 <= i < len(self.nodes) or self.nodes[i].phase != "fwd":
                raise ValueError(f"output {i} is not a forward node")
        for i in self.grads:
            if not 0 <= i < len(self.nodes):
                raise ValueError(f"gradient {i} is not a node")

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the nodes that read it, in execution order."""
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                users[j].append(i)
        return tuple(tuple(u) for u in users)

    @cached_property
    def producers(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the nodes it reads (its ``inputs``): what walks toward the
        values a node is computed from follow (``graph.reachable``)."""
        return tuple(node.inputs for node in self.nodes)

    @cached_property
    def outputs_of(self) -> tuple[tuple[int, ...], ...]:
        """For each multi-output op, its output nodes (empty for other nodes)."""
        parts: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            if node.output_of is not None:
                parts[node.output_of].append(i)
        return tuple(tuple(p) for p in parts)

    @cached_property
    def storage(self) -> tuple[int, ...]:
        """For each node, the node that owns its storage (itself unless it is a view)."""
        root: list[int] = []
        for i, node in enumerate(self.nodes):
            root.append(i if node.alias_of is None else root[node.alias_of])
        return tuple(root)

    @cached_property
    def rank(self) -> tuple[int, ...]:
        """Problem order with every output of a multi-output op moved right after the op:
        the order recomputes run in within one gap of the backward."""
        key = [(i if n.output_of is None else n.output_of, i) for i, n in enumerate(self.nodes)]
        ranks = [0] * len(self.nodes)
        for r, (_, i) in enumerate(sorted(key)):
            ranks[i] = r
        return tuple(ranks)

    @cached_property
    def touches(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the storages running it touches: its inputs', its own and (for
        a multi-output op) its outputs'. Precomputed: the simulator reads it per step."""
        storage, parts = self.storage, self.outputs_of
        return tuple(
            tuple(storage[j] for j in (*n.inputs, i, *parts[i])) for i, n in enumerate(self.nodes)
        )

    @cached_property
    def allocations(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """For each node, the ``(storage, bytes)`` running it allocates: its own and its
        outputs' (a multi-output op writes them), views excepted; nothing for a getitem."""
        nodes, parts = self.nodes, self.outputs_of
        return tuple(
            ()
            if n.output_of is not None
            else tuple((j, nodes[j].bytes) for j in (i, *parts[i]) if nodes[j].alias_of is None)
            for i, n in enumerate(nodes)
        )

    @cached_property
    def packed(self) -> Packed:
        """``touches``, ``allocations``, workspaces and bytes as flat arrays, so the
        simulator gathers a program's with numpy rather than walking it per step."""
        return Packed.of(self)

    @cached_property
    def backward_core(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Backward nodes the gradients need (problem order), and the forward values they
        (or the gradients themselves) read: the same for every plan."""
        nodes, producers = self.nodes, self.producers
        needed = reachable(self.grads, producers, lambda i: nodes[i].phase == "fwd")
        walked = (*self.grads, *(j for i in needed for j in producers[i]))
        reads = {j for j in walked if nodes[j].phase == "fwd"}
        return tuple(sorted(needed)), tuple(sorted(reads))

    @cached_property
    def first_reads(self) -> dict[int, int]:
        """For each forward value the backward core reads, the first core position that
        reads it."""
        nodes, first = self.nodes, {}
        for k, c in enumerate(self.backward_core[0]):
            for j in nodes[c].inputs:
                if nodes[j].phase == "fwd":
                    first.setdefault(j, k)
        return first

    @cached_property
    def forward_base(self) -> frozenset[int]:
        """What the forward runs with nothing saved: the outputs and their inputs."""
        return frozenset(reachable(self.outputs, self.producers))

    @cached_property
    def forward_nodes(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.nodes) if n.phase == "fwd")

    @cached_property
    def forward_closure(self) -> frozenset[int]:
        """What a plain forward pass computes: the nodes the outputs depend on, and
        every output of a multi-output op among them (the kernel writes them all)."""
        seen = self.forward_base
        return seen.union(*(self.outputs_of[i] for i in seen))


@dataclass(frozen=True, eq=False)
class Packed:
    """Per-node lists in CSR form: node i's touched storages are
    ``touch_roots[touch_ptr[i]:touch_ptr[i + 1]]``, its allocations likewise."""

    touch_ptr: np.ndarray
    touch_roots: np.ndarray
    alloc_ptr: np.ndarray
    alloc_roots: np.ndarray
    alloc_bytes: np.ndarray
    workspace: np.ndarray
    bytes: np.ndarray

    @classmethod
    def of(cls, problem: Problem) -> Packed:
        nodes, touches, allocations = problem.nodes, problem.touches, problem.allocations
        allocated = [a for per_node in allocations for a in per_node]
        return cls(
            touch_ptr=_offsets(len(t) for t in touches),
            touch_roots=np.array([r for t in touches for r in t], dtype=np.int64),
            alloc_ptr=_offsets(len(a) for a in allocations),
            alloc_roots=np.array([r for r, _ in allocated], dtype=np.int64),
            alloc_bytes=np.array([b for _, b in allocated], dtype=np.int64),
            workspace=np.array([n.workspace for n in nodes], dtype=np.int64),
            bytes=np.array([n.bytes for n in nodes], dtype=np.int64),
        )


def _offsets(lengths) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.fromiter(lengths, dtype=np.int64)))).astype(np.int64)


def _check_node(nodes: tuple[Node, ...], i: int, node: Node) -> None:
    where = f"node {i} ({node.name!r})"
    if node.phase not in ("fwd", "bwd"):
        raise ValueError(f"{where}: phase must be 'fwd' or 'bwd', got {node.phase!r}")
    if min(node.bytes, node.cost, node.workspace, node.save_cost) < 0:
        raise ValueError(f"{where}: bytes, cost, workspace and save_cost must be non-negative")
    for j in node.inputs:
        if not 0 <= j < i:
            raise ValueError(f"{where}: input {j} does not run before it")
        if node.phase == "fwd" and nodes[j].phase == "bwd":
            raise ValueError(f"{where}: a forward node cannot read backward node {j}")
    for label, j in (("alias_of", node.alias_of), ("output_of", node.output_of)):
        if j is not None and j not in node.inputs:
            raise ValueError(f"{where}: {label}={j} must be one of its inputs")
    if node.alias_of is not None and node.bytes:
        raise ValueError(f"{where}: a view allocates no bytes")


def free_views(problem: Problem) -> frozenset[int]:
    """Views that cost nothing and read only their base, which is their storage root (a
    real value) or itself such a view. Saving one is the same plan as saving that root
    and recomputing the view: the same storage stays live, the views' recomputes
    allocate nothing and cost nothing, and their steps cannot be a peak. The model saves
    roots only (an exact reduction: fewer symmetric choices). A view of a view that
    costs something is not free: recomputing it would run that view again."""
    nodes, storage, parts = problem.nodes, problem.storage, problem.outputs_of
    free: set[int] = set()
    for i, n in enumerate(nodes):  # topological: a base comes before its views
        if (
            n.phase == "fwd"
            and n.alias_of is not None
            and n.cost == 0
            and n.recomputable
            and n.inputs == (n.alias_of,)
            and not parts[storage[i]]
            and (n.alias_of == storage[i] or n.alias_of in free)
        ):
            free.add(i)
    return frozenset(free)


def without_free_views(problem: Problem, saved) -> frozenset[int]:
    """``saved`` with each free view replaced by its storage root."""
    views = free_views(problem)
    return frozenset(problem.storage[i] if i in views else i for i in saved)
