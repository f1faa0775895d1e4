"""Sizes of a graph traced with symbolic shapes, read as numbers.

A graph traced for input sizes that vary (dynamo's automatic dynamic shapes, or
``mark_dynamic``) carries SymInts in its fake values: ``s0`` for a sequence length, and
expressions of such symbols. Planning needs numbers, so every size is read at a
*binding* of the graph's symbols (``reading_at``); outside one, at its hint (the size
it was traced at). Reading never adds a guard: a comparison of SymInts would specialise
the graph to one size (``no_guards``).

Every size is a product of input sizes and constants, so bytes never shrink as an input
size grows: a plan that fits at a binding fits at every smaller one (``covers``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from ._torch_compat import optimization_hint

Binding = Mapping[sympy.Symbol, int]  # a value for each size symbol of a graph

_binding: contextvars.ContextVar[Binding | None] = contextvars.ContextVar("binding", default=None)

UNBACKED = 8192  # a data-dependent size (nonzero's) is read as torch's partitioner reads it


def hint(x: Any) -> int:
    """``x`` (an int or a SymInt) as a number: at the binding being read, else its hint."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    binding = _binding.get()
    if binding:
        value = x.node.expr.xreplace(binding)
        if value.is_number:
            return int(value)
    return int(optimization_hint(x, fallback=UNBACKED))


@contextlib.contextmanager
def reading_at(binding: Binding | None) -> Iterator[None]:
    """Read every size at ``binding`` (None: at the hints) inside the block."""
    numbers = {s: sympy.Integer(v) for s, v in binding.items()} if binding else None
    token = _binding.set(numbers)
    try:
        yield
    finally:
        _binding.reset(token)


def shape_env_of(gm: fx.GraphModule):
    """The ShapeEnv of ``gm``'s symbolic sizes, or None for a graph of static sizes."""
    for node in gm.graph.find_nodes(op="placeholder"):
        for s in _sizes_of(node.meta.get("val")):
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


@contextlib.contextmanager
def no_guards(gm: fx.GraphModule) -> Iterator[None]:
    """Work on ``gm`` without adding guards to its sizes: a comparison of SymInts inside
    (a layout check, a shape equality) is read at the hints and not recorded."""
    env = shape_env_of(gm)
    with env.suppress_guards() if env is not None else contextlib.nullcontext():
        yield


def _sizes_of(val: Any) -> Sequence:
    if isinstance(val, torch.SymInt):
        return (val,)
    if isinstance(val, torch.Tensor):
        return (*val.shape, *val.stride())
    return ()


@dataclass(frozen=True)
class Sizes:
    """The size symbols of a program's inputs, where to read each off them (a
    ``(position, dimension)``; dimension None: the input is the size itself), the value
    each was traced at, and every input dimension each stands for (``appears``). Empty
    for a graph of static sizes."""

    where: tuple[tuple[sympy.Symbol, int, int | None], ...] = ()
    traced: tuple[int, ...] = ()
    appears: tuple[tuple[sympy.Symbol, int, int | None], ...] = ()

    @classmethod
    def of(cls, program: fx.GraphModule) -> Sizes:
        """The symbols ``program``'s placeholders carry, each read where it first appears."""
        seen: dict[sympy.Symbol, tuple[int, int | None, int]] = {}
        appears = []
        for k, node in enumerate(program.graph.find_nodes(op="placeholder")):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt):
                dims: Sequence = ((None, val),)
            elif isinstance(val, torch.Tensor):
                dims = tuple(enumerate(val.shape))
            else:
                continue
            for d, size in dims:
                expr = size.node.expr if isinstance(size, torch.SymInt) else None
                if isinstance(expr, sympy.Symbol):
                    appears.append((expr, k, d))
                    if expr not in seen:
                        seen[expr] = (k, d, int(optimization_hint(size, fallback=UNBACKED)))
        where = tuple((s, k, d) for s, (k, d, _) in seen.items())
        return cls(where, tuple(v for _, _, v in seen.values()), tuple(appears))

    def __bool__(self) -> bool:
        return bool(self.where)

    def read(self, args: Sequence) -> dict[sympy.Symbol, int]:
        """The binding ``args`` (the program's inputs, in order) give."""
        return {s: int(args[k]) if d is None else int(args[k].shape[d]) for s, k, d in self.where}

    def hints(self, seen: Sequence[tuple | None] = ()) -> dict[sympy.Symbol, int]:
        """The binding the program was traced at, each size raised to the largest an
        earlier trace of the same code saw at an input dimension it stands for (``seen``:
        per input, its largest dimensions, or its value for a size; None where unknown)."""
        out = {s: v for (s, _, _), v in zip(self.where, self.traced, strict=True)}
        for s, k, d in self.appears:
            earlier = seen[k] if k < len(seen) else None
            dim = 0 if d is None else d
            if earlier is not None and dim < len(earlier) and earlier[dim] is not None:
                out[s] = max(out[s], earlier[dim])
        return out

    def bounded(self, declared: Sequence[Mapping[int, int]]) -> bool:
        """Whether every symbol stands for an input dimension with a declared maximum
        (``declared``: per input, dimension -> maximum): sizes then never grow past the
        binding ``hints`` reads at those maxima."""
        return not self.unbounded(declared)

    def unbounded(self, declared: Sequence[Mapping[int, int]]) -> tuple[sympy.Symbol, ...]:
        """The symbols standing for no input dimension with a ``declared`` maximum: sizes
        that may grow past any binding."""
        marked = {
            s
            for s, k, d in self.appears
            if d is not None and k < len(declared) and d in declared[k]
        }
        return tuple(s for s, _, _ in self.where if s not in marked)


def guard_at_most(gm: fx.GraphModule, binding: Binding, symbols: Sequence[sympy.Symbol]) -> None:
    """Guard each of ``symbols`` at most its value in ``binding``, in the ShapeEnv of
    ``gm``'s sizes: dynamo then traces the code again for a call with a larger size, so
    no call runs a plan made for smaller sizes. Outside ``no_guards``, inside the
    compile, before dynamo builds its guards."""
    env = shape_env_of(gm)
    for s in symbols:
        env.evaluate_expr(sympy.Le(s, binding[s]))


def covers(planned: Binding, binding: Binding) -> bool:
    """Whether a plan made at ``planned`` serves ``binding``: no size is larger."""
    return all(binding[s] <= planned.get(s, binding[s]) for s in binding)


def larger(a: Binding, b: Binding) -> dict[sympy.Symbol, int]:
    """Each symbol at the larger of its two values: a binding covering both."""
    return {s: max(a.get(s, 0), b.get(s, 0)) for s in {*a, *b}}


def describe(binding: Binding) -> str:
    """``s0=128, s1=4``: a binding as people read it (symbols in name order)."""
    return ", ".join(f"{s}={v}" for s, v in sorted(binding.items(), key=lambda kv: str(kv[0])))
