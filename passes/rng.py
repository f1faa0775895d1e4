"""Make dropout recomputable: replay its mask from the RNG state the forward drew it with.

A recomputed ``native_dropout`` would draw a fresh mask, so the backward would
use a different one than the forward (torch's memory-budget partitioner does
exactly that on CPU: pytorch#190758, silently wrong gradients). remat instead
rewrites each dropout of the joint graph into two ops:

- ``remat::rng_state(x)``: the generator state of ``x``'s device just before
  the dropout. It is random (it reads the generator), so it is never recomputed;
  it is tiny (5,056 bytes on CPU, 16 on CUDA), so saving it costs nothing.
- ``remat::replay_dropout(state, x, p, train, restore)``: in the forward
  (``restore=False``) plain ``native_dropout`` on the global generator, which is
  at ``state`` then, so the forward draws exactly eager's masks and advances the
  generator as eager does. Its recomputed copy in the backward gets
  ``restore=True`` (``restore_in_backward``): it runs from ``state`` and puts the
  generator back, so it reproduces the forward's mask bit for bit and leaves the
  rest of the step's random stream untouched, as ``torch.utils.checkpoint`` does.

The solver then sees a dropout like any pointwise op: recomputable from its
input and the saved state. Only ``native_dropout`` on CPU and CUDA tensors is
rewritten; other random ops (``rand_like``, ``bernoulli``, attention with
dropout) are still saved, never recomputed.
"""

from __future__ import annotations

import contextlib

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
    return _generator_state(anchor.device).clone()


@rng_state.register_fake
def _(anchor: torch.Tensor) -> torch.Tensor:
    return torch.empty(_state_bytes(anchor.device), dtype=torch.uint8, device="cpu")


@torch.library.custom_op("remat::replay_dropout", mutates_args=())
def replay_dropout(
    state: torch.Tensor, x: torch.Tensor, p: float, train: bool | None, restore: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout(x, p, train)`` drawn from ``state``; see the module docstring."""
    if not restore:
        return aten.native_dropout.default(x, p, train)
    current = _generator_state(x.device)
    _set_generator_state(x.device, state)
    try:
        return aten.native_dropout.default(x, p, train)
    finally:
        _set_generator_state(x.device, current)


@replay_dropout.register_fake
def _(state, x, p, train, restore):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def replay_dropouts(joint: fx.GraphModule) -> int:
    """Rewrite every replayable ``native_dropout`` of ``joint`` in place; returns how many."""
    graph = joint.graph
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        x, p, train = node.args[0], node.args[1], node.kwargs.get("train", None)
        if len(node.args) > 2:
            train = node.args[2]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.device.type not in REPLAYABLE_DEVICES:
            continue
        with graph.inserting_before(node):
            state = graph.call_function(torch.ops.remat.rng_state.default, (x,))
            replay = graph.call_function(
                torch.ops.remat.replay_dropout.default, (state, x, p, train, False)
            )
        with getattr(val, "fake_mode", None) or contextlib.nullcontext():
            state.meta["val"] = torch.ops.remat.rng_state.default(val)
        replay.meta.update(node.meta)
        node.replace_all_uses_with(replay)
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
    """Recomputed dropouts (the backward's copies) replay from their saved state."""
    target = torch.ops.remat.replay_dropout.default
    nodes = list(backward.graph.find_nodes(op="call_function", target=target))
    for node in nodes:
        node.update_arg(4, True)
    if nodes:
        backward.recompile()
    return len(nodes)
