"""Make dropout recomputable: replay its mask from the RNG state the forward drew it with.

A recomputed ``native_dropout`` would draw a fresh mask, so the backward would
use a different one than the forward (torch's memory-budget partitioner does
exactly that on CPU: pytorch#190758, silently wrong gradients). remat instead
rewrites each dropout of the joint graph into three ops:

- ``remat::rng_state(x)``: the generator state of ``x``'s device just before
  the dropout. It is random (it reads the generator), so it is never recomputed;
  it is tiny (5,056 bytes on CPU, 16 on CUDA), so saving it costs nothing.
- ``remat::dropout_mask(state, x, p, restore)``: the bool mask. In the forward
  (``restore=False``) it is drawn from the global generator, which is at
  ``state`` then, exactly as ``native_dropout`` draws it, so the forward gets
  eager's masks and leaves the generator where eager leaves it. Its recomputed
  copy in the backward gets ``restore=True`` (``restore_in_backward``): it draws
  from ``state`` and puts the generator back, so it reproduces the forward's mask
  bit for bit and leaves the rest of the step's random stream untouched, as
  ``torch.utils.checkpoint`` does.
- ``remat::apply_dropout_mask(x, mask, scale)``: ``x * mask * scale`` in
  ``native_dropout``'s arithmetic (the same bits). No randomness: recomputing the
  dropped tensor from its input and a saved mask (1 byte per element) is a cheap
  pointwise op, while drawing the mask again costs a random number per element.

The solver sees both as ordinary ops and picks per dropout: save the output,
save the mask and re-apply it, or replay the mask from the state. Only
``native_dropout`` with a constant ``0 < p < 1`` in training mode on CPU and CUDA
tensors is rewritten; other random ops (``rand_like``, ``bernoulli``, attention
with dropout) are still saved, never recomputed.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx

aten = torch.ops.aten

REPLAYABLE_DEVICES = ("cpu", "cuda")


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _state_bytes(device: torch.device) -> int:
    return 16 if device.type == "cuda" else torch.get_rng_state().numel()


@torch.library.custom_op(
    "remat::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def rng_state(anchor: torch.Tensor) -> torch.Tensor:
    """The default generator state of ``anchor``'s device (a CPU byte tensor)."""
    return _generator_state(anchor.device)  # a fresh copy of the state


@rng_state.register_fake
def _(anchor: torch.Tensor) -> torch.Tensor:
    return torch.empty(_state_bytes(anchor.device), dtype=torch.uint8, device="cpu")


def _draw_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The mask ``native_dropout(x, p, True)`` draws, consuming the generator alike: on
    CPU a Bernoulli draw straight into a bool tensor like ``x`` (the CPU kernel draws
    the same integers whatever the dtype it writes; checked bitwise against
    ``native_dropout``, and a float draw cast to bool cost a pass more); elsewhere
    (CUDA's fused kernel draws differently) the mask ``native_dropout`` itself returns."""
    if x.device.type == "cpu":
        return torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)
    return aten.native_dropout.default(x, p, True)[1]


@torch.library.custom_op("remat::dropout_mask", mutates_args=())
def dropout_mask(state: torch.Tensor, x: torch.Tensor, p: float, restore: bool) -> torch.Tensor:
    """The mask of ``native_dropout(x, p, True)`` drawn from ``state``; see the module
    docstring."""
    if not restore:
        return _draw_mask(x, p)
    current = _generator_state(x.device)
    _set_generator_state(x.device, state)
    try:
        return _draw_mask(x, p)
    finally:
        _set_generator_state(x.device, current)


DROPOUT_MASK = torch.ops.remat.dropout_mask.default  # the op as it stands in a graph


@dropout_mask.register_fake
def _(state, x, p, restore):
    return torch.empty_like(x, dtype=torch.bool)


@torch.library.custom_op("remat::apply_dropout_mask", mutates_args=())
def apply_dropout_mask(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``native_dropout``'s output from its mask: ``mask * x``, then ``* scale`` (as
    ``dropout_scale`` gives it: the same bits). The mask is cast into the output's
    buffer first: a multiply of mixed dtypes (``x.mul(mask)``) took about three times as
    long on CPU (docs/benchmarks.md, "`gpt`, eager compiler")."""
    return mask.to(x.dtype).mul_(x).mul_(scale)


APPLY_DROPOUT_MASK = torch.ops.remat.apply_dropout_mask.default  # as it stands in a graph


@apply_dropout_mask.register_fake
def _(x, mask, scale):
    return torch.empty_like(x)


def dropout_scale(p: float, x: torch.Tensor) -> float:
    """The factor ``native_dropout`` scales kept values by. On CPU it multiplies by the
    mask scaled in ``x``'s dtype, so the factor is rounded to that dtype (in bfloat16,
    under autocast, 1/0.9 is 1.109375: unrounded, a third of the outputs differed in
    their last bit); CUDA's fused kernel scales in float."""
    scale = 1.0 / (1.0 - p)
    if x.device.type == "cpu":
        return torch.tensor(scale, dtype=x.dtype).item()
    return scale


def replay_dropouts(joint: fx.GraphModule) -> int:
    """Rewrite every replayable ``native_dropout`` of ``joint`` in place; returns how many."""
    graph = joint.graph
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if (
            not isinstance(val, torch.Tensor)
            or val.device.type not in REPLAYABLE_DEVICES
            or not isinstance(p, (int, float))
            or not 0 < p < 1
            or train is False
            or any(u.target is not operator.getitem for u in node.users)
        ):
            continue
        with graph.inserting_before(node):
            state = graph.call_function(torch.ops.remat.rng_state.default, (x,))
            mask = graph.call_function(torch.ops.remat.dropout_mask.default, (state, x, p, False))
            out = graph.call_function(APPLY_DROPOUT_MASK, (x, mask, dropout_scale(p, val)))
        out_val, mask_val = node.meta["val"]
        with getattr(val, "fake_mode", None) or contextlib.nullcontext():
            state.meta["val"] = torch.ops.remat.rng_state.default(val)
        for new, new_val in ((mask, mask_val), (out, out_val)):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta["val"] = new_val
        for user in list(node.users):
            user.replace_all_uses_with(out if user.args[1] == 0 else mask)
            graph.erase_node(user)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        joint.recompile()
    return count


def is_replay_state(node: fx.Node) -> bool:
    """Whether ``node`` captures a generator state for a dropout replay."""
    return node.op == "call_function" and node.target is torch.ops.remat.rng_state.default


def restore_in_backward(backward: fx.GraphModule) -> int:
    """Recomputed dropouts (the backward's copies) replay from their saved state.

    A state is never recomputed (the plan saves it), yet torch's extractor copies
    ``rng_state`` into the backward whenever its anchor is available there, and its
    dead-code pass keeps the copy (a random op counts as impure): those are dropped.
    Seen with inductor lowering random ops to eager's generator (``fallback_random``).
    """
    graph = backward.graph
    stale = [
        n
        for n in graph.find_nodes(op="call_function", target=torch.ops.remat.rng_state.default)
        if not n.users
    ]
    for node in stale:
        graph.erase_node(node)
    target = torch.ops.remat.dropout_mask.default
    nodes = list(graph.find_nodes(op="call_function", target=target))
    for node in nodes:
        node.update_arg(3, True)
    if nodes or stale:
        backward.recompile()
    return len(nodes)
