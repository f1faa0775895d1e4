"""The step in progress, as the step runner records it: its runs in order, the order of
their backwards, which gradient of one fed another's backward, and what the code between
remat's programs held (``OutsideMemory``, ``Handed``)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from remat.passes._torch_compat import storage_of
from remat.passes.sizes import Binding
from remat.runtime.handed import Handed
from remat.runtime.outside import OutsideMemory
from remat.runtime.programs import Graph
from remat.solvers.step import Link, Outside


@dataclass
class Run:
    """One run of a graph in the step: the program it took, the sizes it ran at, and
    whether its backward ran (or its autograd graph was freed without one)."""

    graph: Graph
    program: int
    binding: Binding = field(default_factory=dict)  # its sizes, where they are symbolic
    done: bool = False


@dataclass
class Recording:
    """The step in progress. ``outside`` is None for a step that is not recorded (one
    whose shape a joint plan already serves): its runs are only followed."""

    outside: OutsideMemory | None
    runs: list[Run] = field(default_factory=list)
    backward_order: list[int] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    gradients: dict = field(default_factory=dict)  # storage -> (run, node) returned
    links: list[Link] = field(default_factory=list)
    irregular: str = ""  # why the step cannot be planned as one, if it cannot
    handed: Handed | None = None  # the gradients the backwards returned, once returned
    # (run, output node) -> the section before which the caller dropped that output, where
    # it did so before the first backward (``solvers.step.Step.released``)
    released: dict[tuple[int, int], int] = field(default_factory=dict)
    # section -> the most the code outside held before the last output died in the code
    # before that section; ``peaks`` holds the most after it (``solvers.step.Outside``)
    early: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outside is not None:
            self.handed = Handed(self.outside, self.levels)

    @property
    def signature(self) -> tuple[str, ...]:
        return tuple(r.graph.name for r in self.runs)

    @property
    def waiting(self) -> int:
        return sum(not r.done for r in self.runs)

    def section(self, resized: Sequence) -> None:
        """A program starts: the outside level through it and the peak before it, with
        ``resized`` storages brought to their sizes first (``OutsideMemory.watch``)."""
        if self.outside is not None:
            self.outside.watch(resized)
            level, peak = self.outside.section()
            self.levels.append(level)
            self.peaks.append(peak)

    def resume(self) -> None:
        """A program returned: the code after it is counted again."""
        if self.outside is not None:
            self.outside.resume()

    def backward_starts(
        self, position: int, tangents, resized: Sequence, compiled: Callable[[], bool]
    ) -> None:
        """Run ``position``'s backward starts, fed ``tangents`` ((tensor, problem node)
        pairs): its section, and a ``Link`` from the run whose gradient a tangent is. At
        the first backward of a recorded step where ``compiled()`` says dynamo compiled
        since the last collection, garbage is collected first: dynamo's compile of a frame
        holds the objects it traced (a model's output object, its logits) in reference
        cycles, and an output only that garbage holds dies now, before the backwards, as
        it does in later steps."""
        if self.outside is not None:
            self.handed.fed([t for t, _ in tangents])
            self.outside.forget([t for t, _ in tangents])
            if not self.backward_order and compiled():
                gc.collect()
        self.section(resized)
        self.backward_order.append(position)
        for t, node in tangents:
            source = self.gradients.get(storage_of(t))
            if source is not None:
                self.links.append(Link(source[0], source[1], position, node))

    def watch_outputs(self, position: int, graph: Graph, outs: Sequence) -> None:
        """Note where the caller drops run ``position``'s outputs: one dropped before the
        backwards begin (the logits beside a loss) is not held through them."""
        by_storage: dict = {}
        for t, node in zip(outs, graph.output_nodes, strict=False):
            key = storage_of(t)
            if key is not None and node is not None:
                by_storage.setdefault(key, (t, []))[1].append(node)
        for t, nodes in by_storage.values():
            weakref.finalize(t.untyped_storage(), self._dropped_output, position, tuple(nodes))

    def _dropped_output(self, position: int, nodes: tuple[int, ...]) -> None:
        if self.backward_order:
            return  # held into the backwards: as the problem holds it
        section = len(self.levels)  # the section running now
        for node in nodes:
            self.released[position, node] = section
        if self.outside is not None:  # what the code outside held before it died, apart
            self.early[section] = max(self.early.get(section, 0), self.outside.split_peak())

    def outside_memory(
        self, release: bool
    ) -> tuple[Outside, tuple[tuple[int, int, int], ...], dict[int, frozenset[int]]]:
        """The code outside as the step's problem takes it (less the gradients the problems
        hold: ``Handed.planned``), the outputs the caller dropped (``Step.released``;
        without ``release`` none, every output held to the step's end), and per run the
        gradient nodes code outside freed early."""
        levels, peaks, freed = self.handed.planned(self.levels, self.peaks)
        # ``early`` is of the forwards' sections, before any gradient was handed over
        outside = Outside(levels, peaks, self._early())
        if not release:
            return outside, (), freed
        return outside, tuple((r, i, s) for (r, i), s in sorted(self.released.items())), freed

    def _early(self) -> tuple[int, ...]:
        if not self.early:
            return ()
        return tuple(self.early.get(s, 0) for s in range(len(self.peaks)))
