"""Reversible coupling layers: a stack that keeps only its output for the backward.

An additive coupling splits its input in two halves and computes y1 = x1 + f(x2),
y2 = x2 + g(y1). It inverts exactly: x2 = y2 - g(y1), x1 = y1 - f(x2). A
``ReversibleSequential`` of couplings therefore stores nothing inside the stack: its
backward starts from the stack's output and, block by block from the last, rebuilds the
block's input and backpropagates through it (RevNet, Gomez et al. 2017; Reformer). Its
activation memory does not grow with depth; the price is one more forward of f and g
per block, and rounding: the rebuilt inputs differ from the true ones by float error
that grows with depth (measured: docs/benchmarks.md, "Reversible layers").

The stack runs as two custom ops, ``remat::reversible_forward`` and
``remat::reversible_backward``, so eagerly, under ``torch.compile`` and in remat's joint
graph the stack is one forward node (holding the output and the generator states) and
one backward node, whose scratch (one block's activations during the rebuild) the cost
model measures like any kernel's. An op cannot take a module, so each stack registers
itself under a key that the ops receive; its trainable parameters are passed as
tensors, so the backward op returns their gradients.

Random ops (dropout) in f or g: the generator states (CPU, and the input's CUDA device)
before f and before g of each block that draws are saved by the forward and restored
while rebuilding, so the backward sees the forward's masks, and the generator is put
back afterwards, as ``torch.utils.checkpoint`` does. A block draws if it holds a dropout
module with p > 0 in training mode, or if ``preserve_rng_state=True``; a block that is
not expected to draw but moves the generator raises instead of training on wrong masks.
The backward also rebuilds under the autocast dtype the forward ran under.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from remat import reversible_ops

__all__ = ["Coupling", "ReversibleSequential"]

_DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


class Coupling(nn.Module):
    """Additive coupling y1 = x1 + f(x2), y2 = x2 + g(y1) over the two halves of the input
    along ``dim``; f and g must keep their input's shape (the coupling adds it back).

    Called alone it is an ordinary module (autograd stores f's and g's activations);
    inside a ``ReversibleSequential`` nothing of it is stored. ``preserve_rng_state``:
    None decides by the dropout modules f and g hold (see the module's docstring).
    """

    def __init__(
        self, f: nn.Module, g: nn.Module, *, dim: int = -1, preserve_rng_state: bool | None = None
    ) -> None:
        super().__init__()
        self.f, self.g, self.dim = f, g, dim
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y1, y2 = self.couple(*self.halves(x), self.f, self.g)
        return torch.cat([y1, y2], self.dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """The input whose output is ``y`` (in eval mode, or with f and g deterministic)."""
        y1, y2 = self.halves(y)
        x2 = y2 - _kept_shape(self.g(y1), y1, "g")
        x1 = y1 - _kept_shape(self.f(x2), x2, "f")
        return torch.cat([x1, x2], self.dim)

    def couple(self, x1, x2, f, g) -> tuple[torch.Tensor, torch.Tensor]:
        """(y1, y2) from the halves, with ``f`` and ``g`` standing for the branches (the
        ops call them with the parameters they were given)."""
        y1 = x1 + _kept_shape(f(x2), x2, "f")
        return y1, x2 + _kept_shape(g(y1), y1, "g")

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x1, x2), views of ``x``; an odd size along ``dim`` is refused."""
        size = x.shape[self.dim]
        if size % 2:
            raise ValueError(
                f"a Coupling splits its input in two halves along dim {self.dim}, whose size "
                f"is {size} (odd) for an input of shape {tuple(x.shape)}"
            )
        x1, x2 = x.chunk(2, self.dim)
        return x1, x2

    def draws_random(self) -> bool:
        """Whether the forward's generator states are saved for this block's rebuild."""
        if self.preserve_rng_state is not None:
            return self.preserve_rng_state
        return any(_draws(m) for m in (*self.f.modules(), *self.g.modules()))


def _draws(m: nn.Module) -> bool:
    if isinstance(m, _DROPOUTS):
        return m.training and m.p > 0
    if isinstance(m, nn.MultiheadAttention):
        return m.training and m.dropout > 0
    return False


def _kept_shape(out: torch.Tensor, inp: torch.Tensor, name: str) -> torch.Tensor:
    if out.shape != inp.shape:
        raise ValueError(
            f"Coupling.{name} must keep its input's shape {tuple(inp.shape)} (the coupling "
            f"adds its output back to a half of the input), got {tuple(out.shape)}"
        )
    return out


class ReversibleSequential(nn.Module):
    """A stack of ``Coupling`` blocks (all splitting along the same dim) whose backward
    rebuilds each block's input from its output instead of storing it.

    ``duplicate=True`` (``from_residual``): the input is concatenated with itself along
    the dim, so each stream has the input's shape, and the output is the mean of the two
    streams.

    Not supported inside f and g: state updates (BatchNorm's running statistics in
    training: the backward runs f and g again) and double backward.
    """

    def __init__(self, *blocks: Coupling, duplicate: bool = False) -> None:
        super().__init__()
        if not blocks or not all(isinstance(b, Coupling) for b in blocks):
            raise TypeError("ReversibleSequential takes one or more Coupling blocks")
        dims = {b.dim for b in blocks}
        if len(dims) > 1:
            raise ValueError(
                f"the blocks of a ReversibleSequential split along one dim, got {dims}"
            )
        self.blocks = nn.ModuleList(blocks)
        self.dim = blocks[0].dim
        self.duplicate = duplicate
        self._register()

    @classmethod
    def from_residual(cls, branches: Sequence[nn.Module], *, dim: int = -1) -> ReversibleSequential:
        """The reversible form of a residual stack x -> x + F_i(x) with branches
        F_1..F_2n (Reformer's): couplings (F_1, F_2), (F_3, F_4), ... over two streams of
        the input's full shape (``duplicate``). Valid where there is an even number of
        branches, each keeping its input's shape. It is a different function from the
        residual stack (there F_3 reads the sum of everything before it, here only the
        second stream), equal only while every branch outputs zero: an architecture to
        train, not a conversion of trained weights."""
        if len(branches) == 0 or len(branches) % 2:
            raise ValueError(
                f"from_residual pairs the branches into couplings (f, g): it needs an even "
                f"number of them, got {len(branches)}"
            )
        pairs = zip(branches[::2], branches[1::2], strict=True)
        return cls(*(Coupling(f, g, dim=dim) for f, g in pairs), duplicate=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.duplicate:
            x = torch.cat([x, x], self.dim)
        self.blocks[0].halves(x)  # the clear error for an odd size, before the op
        random = [b.draws_random() for b in self.blocks]
        autocast = reversible_ops.autocast_dtype(x.device)
        y, _states = torch.ops.remat.reversible_forward(
            x, reversible_ops.trainable(self), self._key, random, autocast
        )
        if self.duplicate:
            y1, y2 = y.chunk(2, self.dim)
            return (y1 + y2) / 2
        return y

    def _register(self) -> None:
        self._key = reversible_ops.register(self)

    def __setstate__(self, state) -> None:
        # A copy (deepcopy, pickle) is a stack of its own: it gets its own key.
        super().__setstate__(state)
        self._register()
