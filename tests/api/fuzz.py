"""Random models for fuzzing remat: a hypothesis strategy that builds ``nn.Module``s as
random DAGs of ops.

``models()`` draws a ``ModelSpec``: the Python source of a module class (``__init__`` and
``forward``), a seed for its weights and inputs, and what it holds. Its ``repr`` is that
source, so a failing example hypothesis shrinks prints as a model one can paste into a
test. Every value is small (a few hundred bytes to a few KiB) so a compile takes about a
second.

The ops: Linear and matmul (with a weight, and activation by activation), Conv1d and
Conv2d, BatchNorm and LayerNorm, pointwise (relu, gelu, tanh, sigmoid, softmax, add,
mul), views (view, transpose, permute + contiguous, flatten), in-place ops on
activations (relu_, add_, mul_), dropout, concat and split, residual and skip
connections (a binary op reads any earlier value of the same shape), integer indexing
(index_select and gather with integer inputs, embedding from integer ids) and a second
output returned beside the loss.

Shapes: dimension 0 is always the batch (``BATCH``); ops act on the others, so batch
norm always has a batch to normalise over.
"""

from __future__ import annotations

import linecache
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

__all__ = ["BATCH", "FAMILIES", "ModelSpec", "models"]

BATCH = 4
VOCAB = 10  # embedding rows; ``ids`` are drawn below it
INDEX_RANGE = 8  # ``idx``/``gidx`` entries are below it, so they index any dim >= 8
INDEX_COUNT = 4  # entries of ``idx`` and columns of ``gidx``
WIDTHS = (4, 8, 16)  # a Linear's or matmul's output features
CHANNELS = (2, 4)  # a convolution's output channels
MAX_ELEMENTS = 1024  # 4 KiB of float32: a larger value is never produced

# Op families (each a generation rule below); a test checks the strategy draws all.
FAMILIES = (
    "linear",
    "matmul",
    "bmm",
    "conv1d",
    "conv2d",
    "batchnorm",
    "layernorm",
    "unary",
    "binary",
    "view",
    "transpose",
    "permute",
    "flatten",
    "inplace",
    "dropout",
    "cat",
    "split",
    "index_select",
    "gather",
    "embedding",
)

# Producers whose backward does not read their own output: an in-place op may overwrite
# such a value (once nothing else has read it) without autograd's version check failing.
# relu, tanh, sigmoid and softmax save their output; views share a base others may save.
_INPLACE_SAFE = {
    "linear",
    "matmul",
    "conv",
    "norm",
    "gelu",
    "add",
    "mul",
    "dropout",
    "cat",
    "index",
    "embedding",
}


@dataclass
class _Value:
    name: str
    shape: tuple[int, ...]
    kind: str  # what produced it (see _INPLACE_SAFE), "input" for the float input
    grad: bool  # requires grad
    contiguous: bool = True
    readers: int = 0
    retired: bool = False  # overwritten in place: read the in-place op's value instead
    dropped: bool = False  # computed from a dropout's output (see _partners)


@dataclass(frozen=True)
class ModelSpec:
    """A random model: the source of class ``FuzzModel`` and the seed of its weights and
    inputs. ``forward(v0, ids, idx, gidx)`` returns the scalar loss, or ``(loss, value)``."""

    source: str
    seed: int
    x_shape: tuple[int, ...]
    x_requires_grad: bool
    families: frozenset[str] = field(default_factory=frozenset)

    @property
    def has_batchnorm(self) -> bool:
        return "batchnorm" in self.families

    def __repr__(self) -> str:
        return (
            f"ModelSpec(seed={self.seed}, x_shape={self.x_shape}, "
            f"x_requires_grad={self.x_requires_grad})\n{self.source}"
        )

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))  # hypothesis prints a failing example through this

    def build(self) -> nn.Module:
        """The model, its weights drawn from ``torch.manual_seed(seed)``."""
        filename = f"<fuzz model {abs(hash(self.source)):x}>"
        # dynamo and tracebacks read the source of the forward through linecache
        linecache.cache[filename] = (
            len(self.source),
            None,
            self.source.splitlines(keepends=True),
            filename,
        )
        namespace = {"torch": torch, "nn": nn, "F": F}
        exec(compile(self.source, filename, "exec"), namespace)
        torch.manual_seed(self.seed)
        return namespace["FuzzModel"]()

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """``(x, ids, idx, gidx)``, drawn from the seed (fresh tensors at every call)."""
        g = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(self.x_shape, generator=g).requires_grad_(self.x_requires_grad)
        ids = torch.randint(0, VOCAB, (BATCH,), generator=g)
        idx = torch.randint(0, INDEX_RANGE, (INDEX_COUNT,), generator=g)
        gidx = torch.randint(0, INDEX_RANGE, (BATCH, INDEX_COUNT), generator=g)
        return x, ids, idx, gidx


class _Builder:
    """The model under construction: its values, module lines and forward lines."""

    def __init__(self, draw) -> None:
        self.draw = draw
        self.values: list[_Value] = []
        self.init: list[str] = []
        self.body: list[str] = []
        self.families: set[str] = set()
        self.count = 0

    def new(self, shape, kind, grad, contiguous=True) -> _Value:
        value = _Value(f"v{len(self.values)}", tuple(shape), kind, grad, contiguous)
        self.values.append(value)
        return value

    def module(self, text: str) -> str:
        self.count += 1
        name = f"m{self.count}"
        self.init.append(f"self.{name} = {text}")
        return f"self.{name}"

    def live(self, accept=lambda v: True) -> list[_Value]:
        """Readable values passing ``accept``, the latest first (so shrinking a pick
        moves it to the latest value: the model becomes a chain)."""
        return [v for v in reversed(self.values) if not v.retired and accept(v)]

    def pick(self, accept=lambda v: True) -> _Value:
        options = self.live(accept)
        return options[self.draw(st.integers(0, len(options) - 1))]

    def emit(self, outs: list[_Value], expr: str, reads: list[_Value]) -> None:
        for v in reads:
            v.readers += 1
        for v in outs:
            v.dropped = v.dropped or any(r.dropped for r in reads)
        self.body.append(f"{', '.join(v.name for v in outs)} = {expr}")


# ----------------------------------------------------------------- generation rules
# Each rule: (applicable to a value?, emit it reading that value). ``value`` is drawn
# among the applicable ones by ``_Builder.pick``.


def _fits(shape) -> bool:
    return math.prod(shape) <= MAX_ELEMENTS


def _widths(a: _Value) -> list[int]:
    return [w for w in WIDTHS if _fits(a.shape[:-1] + (w,))]


def _linear(b: _Builder, a: _Value) -> None:
    out = b.draw(st.sampled_from(_widths(a)))
    m = b.module(f"nn.Linear({a.shape[-1]}, {out})")
    b.emit([b.new(a.shape[:-1] + (out,), "linear", True)], f"{m}({a.name})", [a])


def _matmul(b: _Builder, a: _Value) -> None:
    out = b.draw(st.sampled_from(_widths(a)))
    w = b.module(f"nn.Parameter(torch.randn({a.shape[-1]}, {out}) / {a.shape[-1]})")
    b.emit([b.new(a.shape[:-1] + (out,), "matmul", True)], f"{a.name} @ {w}", [a])


def _bmm(b: _Builder, a: _Value) -> None:
    other = b.pick(lambda v: v.shape == a.shape and not v.dropped)
    shape = a.shape[:2] + (a.shape[1],)
    expr = f"{a.name} @ {other.name}.transpose(1, 2)"
    b.emit([b.new(shape, "matmul", a.grad or other.grad)], expr, [a, other])


def _channels(a: _Value) -> list[int]:
    return [c for c in CHANNELS if _fits((a.shape[0], c) + a.shape[2:])]


def _conv(b: _Builder, a: _Value) -> None:
    out = b.draw(st.sampled_from(_channels(a)))
    dims = len(a.shape) - 2
    m = b.module(f"nn.Conv{dims}d({a.shape[1]}, {out}, 3, padding=1)")
    # contiguous only as far as known: a permuted input may make it channels-last
    value = b.new((a.shape[0], out) + a.shape[2:], "conv", True, a.contiguous)
    b.emit([value], f"{m}({a.name})", [a])


def _batchnorm(b: _Builder, a: _Value) -> None:
    dims = 2 if len(a.shape) == 4 else 1
    m = b.module(f"nn.BatchNorm{dims}d({a.shape[1]})")
    # its output keeps a non-contiguous input's strides
    b.emit([b.new(a.shape, "norm", True, a.contiguous)], f"{m}({a.name})", [a])


def _layernorm(b: _Builder, a: _Value) -> None:
    m = b.module(f"nn.LayerNorm({a.shape[-1]})")
    b.emit([b.new(a.shape, "norm", True)], f"{m}({a.name})", [a])


_UNARY = {
    "relu": ("torch.relu({})", "saves-output"),
    "gelu": ("F.gelu({})", "gelu"),
    "tanh": ("torch.tanh({})", "saves-output"),
    "sigmoid": ("torch.sigmoid({})", "saves-output"),
    "softmax": ("{}.softmax(-1)", "saves-output"),
}


def _unary(b: _Builder, a: _Value) -> None:
    text, kind = _UNARY[b.draw(st.sampled_from(sorted(_UNARY)))]
    b.emit([b.new(a.shape, kind, a.grad, a.contiguous)], text.format(a.name), [a])


def _binary(b: _Builder, a: _Value) -> None:
    # a residual or skip connection when ``other`` is an earlier value
    other = b.pick(lambda v: _partners(a, v))
    op = b.draw(st.sampled_from(["+", "*"]))
    kind = "add" if op == "+" else "mul"
    out = b.new(a.shape, kind, a.grad or other.grad, a.contiguous and other.contiguous)
    b.emit([out], f"{a.name} {op} {other.name}", [a, other])


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


def _view(b: _Builder, a: _Value) -> None:
    # split the last dim in two: (B, F) -> (B, C, L), (B, C, L) -> (B, C, H, W)
    last = a.shape[-1]
    first = b.draw(st.sampled_from(_divisors(last)))
    shape = a.shape[:-1] + (first, last // first)
    b.emit([b.new(shape, "view", a.grad)], f"{a.name}.view{shape}", [a])


def _transpose(b: _Builder, a: _Value) -> None:
    i = b.draw(st.integers(1, len(a.shape) - 2))
    shape = list(a.shape)
    shape[i], shape[i + 1] = shape[i + 1], shape[i]
    expr = f"{a.name}.transpose({i}, {i + 1})"
    b.emit([b.new(shape, "view", a.grad, contiguous=False)], expr, [a])


def _permute(b: _Builder, a: _Value) -> None:
    rest = b.draw(st.permutations(list(range(1, len(a.shape)))))
    order = (0, *rest)
    shape = tuple(a.shape[i] for i in order)
    expr = f"{a.name}.permute{order}.contiguous()"
    # "view": where the permuted value is already contiguous, contiguous() returns it
    b.emit([b.new(shape, "view", a.grad)], expr, [a])


def _flatten(b: _Builder, a: _Value) -> None:
    shape = (a.shape[0], math.prod(a.shape[1:]))
    # "view": a view wherever strides allow, which the contiguous flag underestimates
    b.emit([b.new(shape, "view", a.grad)], f"{a.name}.flatten(1)", [a])


def _inplace(b: _Builder, a: _Value) -> None:
    op = b.draw(st.sampled_from(["relu_", "add_", "mul_"]))
    partners = b.live(lambda v: _partners(a, v) and v is not a)
    if op == "relu_":
        expr, kind, reads = f"{a.name}.relu_()", "saves-output", [a]
    elif not partners or b.draw(st.booleans()):
        scalar = b.draw(st.sampled_from(["0.5", "-1.5"]))
        expr, kind, reads = f"{a.name}.{op}({scalar})", "add", [a]
    else:
        other = b.pick(lambda v: _partners(a, v) and v is not a)
        kind = "add" if op == "add_" else "mul"
        expr, reads = f"{a.name}.{op}({other.name})", [a, other]
        a.grad = a.grad or other.grad
    out = b.new(a.shape, kind, a.grad)
    b.emit([out], expr, reads)
    a.retired = True  # it holds ``out``'s data now: later ops read ``out``


def _dropout(b: _Builder, a: _Value) -> None:
    p = b.draw(st.sampled_from([0.0, 0.25, 0.5]))
    expr = f"F.dropout({a.name}, {p}, self.training)"
    # eager's dropout at p=0 returns its input itself: an alias, like a view
    kind = "view" if p == 0 else "dropout"
    out = b.new(a.shape, kind, a.grad, a.contiguous)
    out.dropped = p > 0  # p=0 compiles to a clone: no dropout backward
    b.emit([out], expr, [a])


def _cat(b: _Builder, a: _Value) -> None:
    other = b.pick(lambda v: v.shape[:-1] == a.shape[:-1] and _fits(_cat_shape(a, v)))
    expr = f"torch.cat([{a.name}, {other.name}], -1)"
    b.emit([b.new(_cat_shape(a, other), "cat", a.grad or other.grad)], expr, [a, other])


def _cat_shape(a: _Value, other: _Value) -> tuple[int, ...]:
    return a.shape[:-1] + (a.shape[-1] + other.shape[-1],)


def _split(b: _Builder, a: _Value) -> None:
    last = a.shape[-1]
    first = b.draw(st.integers(1, last - 1))
    outs = [
        b.new(a.shape[:-1] + (n,), "view", a.grad, contiguous=False) for n in (first, last - first)
    ]
    b.emit(outs, f"{a.name}.split([{first}, {last - first}], -1)", [a])


def _index_select(b: _Builder, a: _Value) -> None:
    shape = a.shape[:-1] + (INDEX_COUNT,)
    b.emit([b.new(shape, "index", a.grad)], f"{a.name}.index_select(-1, idx)", [a])


def _gather(b: _Builder, a: _Value) -> None:
    shape = (BATCH, INDEX_COUNT)
    b.emit([b.new(shape, "index", a.grad)], f"{a.name}.gather(1, gidx)", [a])


def _embedding(b: _Builder, a: _Value) -> None:
    # a source: reads the integer ids, not ``a``
    width = b.draw(st.sampled_from(WIDTHS))
    m = b.module(f"nn.Embedding({VOCAB}, {width})")
    b.emit([b.new((BATCH, width), "embedding", True)], f"{m}(ids)", [])


# torch's fake (meta) native_dropout_backward returns a contiguous gradient where the CPU
# kernel keeps a permuted incoming gradient's layout, so a view in AOTAutograd's backward
# fails at runtime (plain ``torch.compile(backend="aot_eager")`` too: a linear, dropout,
# then ``x @ dropped.transpose(1, 2)``). So dropout reads only contiguous values, and what
# its output flows into never permutes its gradient: no transpose, permute or bmm of it,
# no sum with a permuted value.


def _partners(a: _Value, v: _Value) -> bool:
    """Whether ``v`` may be ``a``'s second operand: same shape, and a dropout's output
    meets only operands of its own (contiguous) layout."""
    if v.shape != a.shape:
        return False
    return v is a or not (a.dropped or v.dropped) or (a.contiguous and v.contiguous)


def _inplace_target(v: _Value) -> bool:
    return v.kind in _INPLACE_SAFE and v.readers == 0 and v.kind != "input"


def _rank(*ranks):
    return lambda v: len(v.shape) in ranks


_RULES = {
    "linear": (_widths, _linear),
    "matmul": (_widths, _matmul),
    "bmm": (
        lambda v: len(v.shape) == 3 and not v.dropped and _fits(v.shape[:2] + (v.shape[1],)),
        _bmm,
    ),
    "conv1d": (lambda v: len(v.shape) == 3 and _channels(v), _conv),
    "conv2d": (lambda v: len(v.shape) == 4 and _channels(v), _conv),
    "batchnorm": (_rank(2, 3, 4), _batchnorm),
    "layernorm": (lambda v: True, _layernorm),
    "unary": (lambda v: True, _unary),
    "binary": (lambda v: True, _binary),
    "view": (lambda v: v.contiguous and len(v.shape) < 4 and _divisors(v.shape[-1]), _view),
    "transpose": (lambda v: len(v.shape) >= 3 and not v.dropped, _transpose),
    "permute": (lambda v: len(v.shape) >= 3 and not v.dropped, _permute),
    "flatten": (lambda v: len(v.shape) >= 3, _flatten),
    "inplace": (_inplace_target, _inplace),
    "dropout": (lambda v: v.contiguous, _dropout),
    "cat": (lambda v: _fits(_cat_shape(v, v)), _cat),
    "split": (lambda v: v.shape[-1] >= 2, _split),
    "index_select": (lambda v: v.shape[-1] >= INDEX_RANGE, _index_select),
    "gather": (lambda v: len(v.shape) == 2 and v.shape[-1] >= INDEX_RANGE, _gather),
    "embedding": (lambda v: True, _embedding),
}
assert set(_RULES) == set(FAMILIES)


@st.composite
def models(draw, max_ops: int = 10) -> ModelSpec:
    """A random ``ModelSpec`` of 1 to ``max_ops`` ops after its float input."""
    b = _Builder(draw)
    seed = draw(st.integers(0, 2**16))
    # inputs of every rank, so convolutions need no views to reach one
    x_shape = draw(st.sampled_from([(BATCH, 8), (BATCH, 16), (BATCH, 2, 8), (BATCH, 2, 4, 4)]))
    x_requires_grad = draw(st.booleans())
    b.new(x_shape, "input", x_requires_grad)
    for _ in range(draw(st.integers(1, max_ops))):
        applicable = [f for f in FAMILIES if b.live(_RULES[f][0])]
        family = draw(st.sampled_from(applicable))
        accept, rule = _RULES[family]
        rule(b, b.pick(accept))
        b.families.add(family)
    # the loss reads every value nothing else read, so no op is dead code (a compiler
    # drops a dead dropout, which eager runs: the RNG states would differ); at least one
    # needs a gradient
    sinks = [v for v in b.live(lambda v: v.readers == 0 and v.kind != "input")]
    if not any(v.grad for v in sinks):
        _linear(b, b.live()[0])
        b.families.add("linear")
        sinks = [v for v in b.live(lambda v: v.readers == 0 and v.kind != "input")]
    returned = None
    if draw(st.booleans()):
        candidates = b.live(lambda v: v.kind != "input")
        returned = candidates[draw(st.integers(0, len(candidates) - 1))]
        # a returned value the loss does not read gets zeros for a tangent
        rest = [v for v in sinks if v is not returned]
        if returned in sinks and any(v.grad for v in rest) and draw(st.booleans()):
            sinks = rest
    b.body.append("loss = " + " + ".join(f"{v.name}.square().mean()" for v in sinks))
    b.body.append("return loss" if returned is None else f"return loss, {returned.name}")
    if returned is not None:
        b.families.add("second output")
    source = "\n".join(
        [
            "class FuzzModel(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            *(f"        {line}" for line in b.init),
            "",
            "    def forward(self, v0, ids, idx, gidx):",
            *(f"        {line}" for line in b.body),
            "",
        ]
    )
    return ModelSpec(source, seed, x_shape, x_requires_grad, frozenset(b.families))
