"""Declared maximum input sizes: ``optimize(model, budget, max_sizes=...)``.

A user who knows the largest sizes their batches take (a maximum sequence length, a batch
size) declares them per argument of the forward, by name, so positional and keyword inputs
read alike. Each training call marks those dimensions symbolic up to their maximum before
dynamo sees the call (``mark_dynamic_up_to``): the first call is traced once for every size
up to the maxima, and the backend plans that trace at the maxima (``RematBackend`` reads
the marks off its example inputs), so no step up to them plans again. A call above a
maximum is refused before anything runs (``SizeAboveMaximum``): the plan and a fraction of
the budget were made for the maxima, and dynamo's guards would trace such a call again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from remat.errors import InvalidOption, SizeAboveMaximum
from remat.passes._torch_compat import mark_dynamic_up_to

MaxSizesLike = Mapping[str, Sequence[int | None] | Mapping[int, int]]

_EXAMPLE = 'max_sizes={"input_ids": (8, 512)} or {"input_ids": {1: 512}}'


@dataclass(frozen=True)
class MaxSizes:
    """The checked declaration: per argument name, the largest size of each dimension
    that varies, either as a shape (``(8, 512)``; ``None`` for a dimension that does not
    vary) or as dimension -> maximum (``{1: 512}``; a negative dimension counts from the
    end)."""

    signature: inspect.Signature
    declared: Mapping[str, tuple[int | None, ...] | Mapping[int, int]]
    owner: str  # what takes the arguments, for errors: ``GPT.forward``

    @classmethod
    def parse(cls, max_sizes: MaxSizesLike | None, fn: Callable, owner: str) -> MaxSizes | None:
        """``max_sizes`` checked against ``fn``'s signature (a module's bound ``forward``),
        None where nothing is declared. ``InvalidOption`` names what is wrong and what to
        write instead."""
        if not max_sizes:
            return None
        if not isinstance(max_sizes, Mapping):
            raise InvalidOption(
                f"max_sizes maps argument names to maximum sizes ({_EXAMPLE}), got "
                f"{type(max_sizes).__name__}"
            )
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise InvalidOption(
                f"max_sizes names {owner}'s arguments, but its signature cannot be read ({e})"
            ) from None
        declared = {}
        for name, sizes in max_sizes.items():
            _check_name(name, signature, owner)
            declared[name] = _checked_sizes(name, sizes)
        return cls(signature, declared, owner)

    def apply(self, args: Sequence, kwargs: Mapping) -> None:
        """Check one training call against the declaration and mark its declared dimensions
        symbolic up to their maxima. Dimensions of size 0 or 1 are left static (dynamo
        specialises them: such a call is traced apart); an argument not passed, or None,
        has nothing to mark."""
        bound = self.signature.bind(*args, **kwargs)  # a TypeError as the call would raise
        extra = next(
            (bound.arguments.get(p.name, {}) for p in self.signature.parameters.values()
             if p.kind is p.VAR_KEYWORD),
            {},
        )  # fmt: skip
        marks = []
        for name, sizes in self.declared.items():
            value = bound.arguments[name] if name in bound.arguments else extra.get(name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidOption(
                    f"max_sizes declares sizes for {name!r}, but {self.owner} got a "
                    f"{type(value).__name__} there, not a tensor: declare only tensor arguments"
                )
            for dim, maximum in self._dims(name, sizes, value.dim()):
                if value.shape[dim] > maximum:
                    raise SizeAboveMaximum(name, dim, value.shape[dim], maximum)
                if value.shape[dim] >= 2:
                    marks.append((value, dim, maximum))
        for value, dim, maximum in marks:
            mark_dynamic_up_to(value, dim, maximum)

    def _dims(self, name: str, sizes, ndim: int) -> list[tuple[int, int]]:
        """(dimension, maximum) pairs of ``name``'s declaration on a tensor of ``ndim``
        dimensions; ``InvalidOption`` where the declaration does not fit it."""
        if isinstance(sizes, tuple):
            if len(sizes) != ndim:
                raise InvalidOption(
                    f"max_sizes[{name!r}] is a shape of {len(sizes)} dimensions, but "
                    f"{self.owner} got a {ndim}-dimensional {name}: give one entry per "
                    "dimension (None where it does not vary), or {dim: maximum}"
                )
            return [(d, m) for d, m in enumerate(sizes) if m is not None]
        for dim in sizes:
            if not -ndim <= dim < ndim:
                raise InvalidOption(
                    f"max_sizes[{name!r}] declares dimension {dim}, but {self.owner} got a "
                    f"{ndim}-dimensional {name} (dimensions {-ndim} to {ndim - 1})"
                )
        return [(d % ndim, m) for d, m in sizes.items()]


def _check_name(name, signature: inspect.Signature, owner: str) -> None:
    """``name`` is an argument ``signature`` takes by name, or any name where it takes
    ``**kwargs`` (then checked when passed)."""
    params = signature.parameters
    named = [p.name for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not isinstance(name, str):
        raise InvalidOption(
            f"max_sizes is keyed by argument name, got {name!r}: name one of {owner}'s "
            f"arguments ({', '.join(named)})"
        )
    if name in named:
        return
    if name in params:  # the *args or **kwargs parameter itself
        raise InvalidOption(
            f"max_sizes names {name!r}, {owner}'s variable arguments: name the tensor "
            "argument itself (a keyword passed through **kwargs is named as passed)"
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise InvalidOption(
            f"max_sizes names {name!r}, which {owner}{signature} does not take: name one "
            f"of its arguments ({', '.join(named)})"
        )


def _checked_sizes(name: str, sizes) -> tuple[int | None, ...] | dict[int, int]:
    """One argument's declaration as a shape tuple or a {dimension: maximum} dict, each
    maximum an int of at least 2 (sizes 0 and 1 never vary in dynamo: a maximum of 1 has
    nothing to declare)."""
    if isinstance(sizes, Mapping):
        pairs, form = list(sizes.items()), "{dim: maximum}"
    elif isinstance(sizes, Sequence) and not isinstance(sizes, str):
        pairs, form = list(enumerate(sizes)), "shape"
    else:
        raise InvalidOption(
            f"max_sizes[{name!r}] must be a maximum shape or {{dim: maximum}} "
            f"({_EXAMPLE}), got {sizes!r}"
        )
    for dim, maximum in pairs:
        if not _is_int(dim):
            raise InvalidOption(f"max_sizes[{name!r}] has dimension {dim!r}: dimensions are ints")
        if maximum is None and form == "shape":
            continue
        if not _is_int(maximum) or maximum < 2:
            raise InvalidOption(
                f"max_sizes[{name!r}] gives {maximum!r} for dimension {dim}: a maximum is an "
                "int of at least 2 (dynamo keeps sizes 0 and 1 static); write None in a "
                "shape for a dimension that does not vary"
            )
    if not any(m is not None for _, m in pairs):
        raise InvalidOption(
            f"max_sizes[{name!r}] declares no maximum ({sizes!r}): give at least one, or "
            "leave the argument out"
        )
    return dict(pairs) if form != "shape" else tuple(sizes)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
