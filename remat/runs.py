"""Watch remat's compiled graphs at run time for what the plans assume: one run of each
graph per step.

A plan covers one forward and one backward of its graph. A graph that runs again while an
earlier run is still waiting for its backward holds both runs' saved values: a graph
break inside a loop reruns one compiled graph per iteration, and a model called twice
before ``backward()`` runs it twice. The step then peaks above the prediction, so the
first time it happens for a graph, remat says so on its logger.

A run ends when its backward has run, or when its autograd graph is freed without one
(the output dropped: a forward whose loss nobody differentiates holds nothing after that).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch

log = logging.getLogger("remat")


class RunTracker:
    """Per graph, the runs whose backward has not run yet."""

    def __init__(self, on_first_backward: Callable[[str], None] | None = None) -> None:
        self.waiting: defaultdict[str, list[object]] = defaultdict(list)
        self.warned: set[str] = set()
        self.on_first_backward = on_first_backward  # called with the graph's name

    def watch(self, compiled: Callable, graph: str) -> Callable:
        """``compiled`` (what the backend returns for ``graph``), counting its runs."""

        @functools.wraps(compiled)
        def run(*args, **kwargs):
            if _fake(args):  # DDP's optimizer runs graphs on fake tensors while compiling
                return compiled(*args, **kwargs)
            waiting = self.waiting[graph]
            if waiting and graph not in self.warned:
                self.warned.add(graph)
                log.warning(
                    "remat %s: ran again while %d earlier run(s) of it wait for their "
                    "backward, holding their saved values: remat plans one run of each "
                    "graph per step, so this step's memory exceeds the prediction. A graph "
                    "break inside a loop does this (each iteration reruns the graph; "
                    "torch._dynamo.explain shows the breaks), as does calling the model "
                    "again before backward().",
                    graph,
                    len(waiting),
                )
            out = compiled(*args, **kwargs)
            node = _backward_node(out)
            if node is not None:
                token = object()
                waiting.append(token)
                weakref.finalize(node, self._drop, graph, token)
            return out

        return run

    def after_backward(self, program: Callable, graph: str) -> Callable:
        """``program`` (``graph``'s boxed backward), ending the latest waiting run of
        ``graph`` each time it returns (backwards run in reverse order)."""

        first = True

        def backward(args: list):
            nonlocal first
            grads = program(args)
            if self.waiting[graph]:
                self.waiting[graph].pop()
            if first and self.on_first_backward is not None:
                first = False
                self.on_first_backward(graph)
            return grads

        backward._boxed_call = True
        return backward

    def _drop(self, graph: str, token: object) -> None:
        waiting = self.waiting[graph]
        if any(t is token for t in waiting):
            waiting[:] = [t for t in waiting if t is not token]


def _fake(args: tuple) -> bool:
    """Whether ``args`` (positional, or one boxed list) hold fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
    return any(isinstance(a, FakeTensor) for a in flat)


def _backward_node(outputs) -> object | None:
    """The autograd node of AOTAutograd's function among ``outputs``' grad_fns (an output
    may be a view of its result: then one node further), or None without one."""
    tensors = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.grad_fn is None:
            continue
        frontier = [t.grad_fn]
        for _ in range(3):
            for node in frontier:
                if "CompiledFunction" in node.name():
                    return node
            frontier = [n for node in frontier for n, _ in node.next_functions if n is not None]
    return None
