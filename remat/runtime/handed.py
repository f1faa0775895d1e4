"""Gradients a recorded step's backwards return, counted once they are handed to the code
outside remat's programs. A graph's problem holds the gradients it returns until the
step's backward ends, as ``.grad`` does; FSDP2 instead reduce-scatters each block's
unsharded gradients right after its backward and frees them. So each returned gradient
is counted with the outside memory from the end of its backward until it dies; at the
step's end, ``Handed.planned`` takes back from the outside sections the ones its problem
holds anyway (alive to the end, or fed to another run's backward as a tangent), and
names the ones freed early: their problems hold them only to the end of their backward
(``keeping``)."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch

from remat.passes._torch_compat import storage_key
from remat.runtime.outside import OutsideMemory
from remat.solvers import Node, Problem


@dataclass
class _Gradient:
    run: int
    nodes: list[int]
    nbytes: int
    start: int  # the first section (and the peak before it) it is counted in
    end: int | None = None  # the section before which it died or was fed to a backward
    fed: bool = False


@dataclass
class Handed:
    """The gradients of one recorded step, by storage. ``sections`` is the step's list of
    section levels (its length is the section running or next)."""

    outside: OutsideMemory
    sections: list
    ended: bool = False
    gradients: list[_Gradient] = field(default_factory=list)
    _alive: dict[int, _Gradient] = field(default_factory=dict)  # by storage, while alive

    def returned(self, run: int, grads) -> None:
        """Run ``run``'s backward returned ``grads``, ``(tensor, problem node)`` pairs."""
        for g, node in grads:
            if not isinstance(g, torch.Tensor) or node is None:
                continue
            key = storage_key(g)
            if key in self._alive:
                self._alive[key].nodes.append(node)
                continue
            nbytes = self.outside.adopt(g)
            if nbytes:
                found = _Gradient(run, [node], nbytes, len(self.sections))
                self.gradients.append(found)
                self._alive[key] = found
                weakref.finalize(g.untyped_storage(), self._died, key)

    def fed(self, tangents) -> None:
        """``tangents`` are fed to a backward starting now: a gradient among them is its
        problem's (``solvers.step.Link``) from here on."""
        for t in tangents:
            found = isinstance(t, torch.Tensor) and self._alive.get(storage_key(t))
            if found and found.end is None:
                found.end, found.fed = len(self.sections), True

    def _died(self, key: int) -> None:
        found = self._alive.pop(key, None)  # its key may name a new storage from now on
        if found is not None and found.end is None and not self.ended:
            found.end = len(self.sections)

    def planned(
        self, levels: list[int], peaks: list[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, frozenset[int]]]:
        """The outside levels and peaks less the gradients the problems hold, and per run
        the gradient nodes code outside freed before the step ended."""
        levels, peaks = list(levels), list(peaks)
        freed: dict[int, set[int]] = {}
        for g in self.gradients:
            if g.end is not None and not g.fed:
                freed.setdefault(g.run, set()).update(g.nodes)
                continue
            stop = len(levels) if g.end is None else g.end
            for k in range(g.start, stop):
                levels[k] -= g.nbytes
            for k in range(g.start, stop + 1):
                peaks[k] -= g.nbytes
        return tuple(levels), tuple(peaks), {r: frozenset(n) for r, n in freed.items()}


def keeping(problem: Problem, freed: frozenset[int]) -> Problem:
    """``problem`` holding the gradients ``freed`` (or tangents the backward holds) only to
    the end of its backward (a last node reads them), not to the end of the step."""
    if not freed:
        return problem
    keeper = Node("handed:gradients", "bwd", inputs=tuple(sorted(freed)), recomputable=False)
    last = len(problem.nodes)
    grads = tuple(i for i in problem.grads if i not in freed) + (last,)
    return dataclasses.replace(problem, nodes=(*problem.nodes, keeper), grads=grads)


def own_order(order: tuple[int, ...], problem: Problem) -> tuple[int, ...]:
    """A backward order of ``keeping(problem, ...)`` as one of ``problem``."""
    return tuple(i for i in order if i < len(problem))
