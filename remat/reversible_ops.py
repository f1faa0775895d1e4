"""The two custom ops a ``remat.nn.ReversibleSequential`` runs as, and their autograd rule.

``remat::reversible_forward(x, params, stack, random, autocast) -> (y, states)`` runs
the stack without recording anything, under ``autocast``'s dtype ("" for none);
``states`` holds the generator states before f and before g of every block flagged in
``random`` (a CPU byte tensor, one row per state).
``remat::reversible_backward(y, grad, states, params, stack, random, autocast)`` walks
the blocks from the last, under the same autocast: per block it runs g on y1 (under g's
saved state) to get x2 = y2 - g(y1) and g's backward, then f on x2 for x1 = y1 - f(x2)
and f's backward, so f and g run once each and only one block's activations are alive
at a time. It returns the input's gradient, then the parameters'.

Being opaque ops, they are one node each in a traced graph, so dynamo, AOTAutograd and
remat's planner neither inline the rebuild nor hold the stack's internals. The forward
op carries ``nondeterministic_seeded``: rerunning it could draw new masks, so no
planner recomputes it. Ops take no modules: a stack registers under a string key, its
handle in this process and a fingerprint of its modules and their code. The code inside
the ops is invisible in the graph, so the fingerprint is what tells two stacks with
equal shapes apart to whatever keys on the graph (``remat.cache``).
"""

from __future__ import annotations

import hashlib
import itertools
import weakref

import torch
from torch import nn

from remat.costs.measured import VALID_INPUTS
from remat.passes._torch_compat import autograd_in_kernel

__all__ = ["autocast_dtype", "register", "trainable"]

_STACKS: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register(stack: nn.Module) -> str:
    """A new key under which the ops find ``stack`` (held weakly)."""
    key = f"{next(_HANDLES)}:{_fingerprint(stack)}"
    _STACKS[key] = stack
    return key


def _fingerprint(stack: nn.Module) -> str:
    """A hash of the modules (their repr: types, sizes, options) and of the bytecode of
    their classes' ``forward``."""
    classes = sorted({type(m) for m in stack.modules()}, key=lambda c: c.__qualname__)
    parts = [repr(stack)]
    for c in classes:
        code = getattr(c.forward, "__code__", None)
        parts.append(f"{c.__module__}.{c.__qualname__}:{code.co_code.hex() if code else ''}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def trainable(stack: nn.Module) -> list[torch.Tensor]:
    """The parameters the ops take and return gradients for, in the order they use."""
    return [p for p in stack.parameters() if p.requires_grad]


def _stack(key: str) -> nn.Module:
    stack = _STACKS.get(key)
    if stack is None:
        raise RuntimeError(f"no ReversibleSequential with key {key!r} is alive")
    return stack


# --------------------------------------------------------------------------------------
# Generator states: the CPU generator's, then the CUDA device's (as checkpoint saves)
# --------------------------------------------------------------------------------------


def _state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cat([torch.get_rng_state(), torch.cuda.get_rng_state(device)])
    return torch.get_rng_state()


def _restore(state: torch.Tensor, device: torch.device) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[cpu:].clone(), device)


def _state_size(device: torch.device) -> int:
    cuda = torch.cuda.get_rng_state(device).numel() if device.type == "cuda" else 0
    return torch.get_rng_state().numel() + cuda


def autocast_dtype(device: torch.device) -> str:
    """The autocast dtype in force for ``device`` ("" when off): the forward runs its
    blocks under it and the backward rebuilds under the same, as checkpoint does."""
    if not torch.is_autocast_enabled(device.type):
        return ""
    return str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")


def _autocast(device: torch.device, dtype: str):
    if not dtype:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def _forked(device: torch.device, enabled: bool):
    """Puts the generators back after a rebuild replayed the forward's states."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=enabled)


# --------------------------------------------------------------------------------------
# Branches called with the parameters the op was given
# --------------------------------------------------------------------------------------


def _positions(stack: nn.Module) -> dict[int, int]:
    """Each trainable parameter's position in the op's list, by identity (a parameter
    tied across blocks has one position)."""
    return {id(p): k for k, p in enumerate(trainable(stack))}


def _slots(positions: dict[int, int], branch: nn.Module) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Names of ``branch``'s trainable parameters and their positions in the op's list."""
    named = [
        (n, positions[id(p)])
        for n, p in branch.named_parameters(remove_duplicate=False)
        if id(p) in positions
    ]
    return tuple(n for n, _ in named), tuple(k for _, k in named)


def _bound(branch: nn.Module, names: tuple[str, ...]):
    """``branch`` as a function of its input and its parameters (in ``names``' order)."""

    def call(h: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(branch, dict(zip(names, params, strict=True)), (h,))

    return call


def _with_params(positions: dict[int, int], branch: nn.Module, params: list[torch.Tensor]):
    names, slots = _slots(positions, branch)
    call = _bound(branch, names)
    return lambda h: call(h, [params[k] for k in slots])


# --------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------


@torch.library.custom_op(
    "remat::reversible_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def reversible_forward(
    x: torch.Tensor, params: list[torch.Tensor], stack: str, random: list[bool], autocast: str
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _stack(stack)
    positions = _positions(s)
    states: list[torch.Tensor] = []
    x1, x2 = s.blocks[0].halves(x)
    with torch.no_grad(), _autocast(x.device, autocast):
        for i, (block, draws) in enumerate(zip(s.blocks, random, strict=True)):
            f = _with_params(positions, block.f, params)
            g = _with_params(positions, block.g, params)
            before = _state(x.device)
            if draws:
                states.append(before)
                f = _then_save(f, states, x.device)
            x1, x2 = block.couple(x1, x2, f, g)
            if not draws and not torch.equal(before, _state(x.device)):
                raise RuntimeError(
                    f"block {i} of a ReversibleSequential drew random numbers, but its "
                    "generator states are not saved (no dropout module with p > 0 was "
                    "found in it): pass Coupling(..., preserve_rng_state=True)"
                )
        y = torch.cat([x1, x2], s.dim)
    rows = torch.stack(states) if states else torch.empty(0, _state_size(x.device))
    return y, rows.to(torch.uint8)


def _then_save(f, states: list[torch.Tensor], device: torch.device):
    """``f`` that records the generator state after it ran: the state g starts from."""

    def run(h: torch.Tensor) -> torch.Tensor:
        out = f(h)
        states.append(_state(device))
        return out

    return run


@reversible_forward.register_fake
def _(x, params, stack, random, autocast):
    rows = 2 * sum(random)
    return torch.empty_like(x), x.new_empty(
        (rows, _state_size(x.device)), dtype=torch.uint8, device="cpu"
    )


@torch.library.custom_op("remat::reversible_backward", mutates_args=())
def reversible_backward(
    y: torch.Tensor,
    grad: torch.Tensor,
    states: torch.Tensor,
    params: list[torch.Tensor],
    stack: str,
    random: list[bool],
    autocast: str,
) -> list[torch.Tensor]:
    s = _stack(stack)
    positions = _positions(s)
    grads: list[torch.Tensor | None] = [None] * len(params)
    y1, y2 = s.blocks[0].halves(y)
    g1, g2 = s.blocks[0].halves(grad)
    saved = list(states.unbind(0))
    with _forked(y.device, enabled=any(random)), _autocast(y.device, autocast):
        for block, draws in zip(reversed(s.blocks), reversed(random), strict=True):
            state_g, state_f = (saved.pop(), saved.pop()) if draws else (None, None)
            y1, y2, g1, g2 = _unblock(
                positions, block, (y1, y2), (g1, g2), params, grads, (state_f, state_g)
            )
    grad_x = torch.cat([g1, g2], s.dim)
    given = zip(params, grads, strict=True)
    return [grad_x, *(torch.zeros_like(p) if g is None else g for p, g in given)]


def _unblock(positions, block, ys, gs, params, grads, states):
    """One block's backward from its output: its input halves and their gradients."""
    (y1, y2), (g1, g2), (state_f, state_g) = ys, gs, states
    device = y1.device
    if state_g is not None:
        _restore(state_g, device)
    x2, dy1 = _branch_backward(positions, block.g, y1, g2, params, grads, rebuild=y2)
    g1 = g1 + dy1
    if state_f is not None:
        _restore(state_f, device)
    x1, dx2 = _branch_backward(positions, block.f, x2, g1, params, grads, rebuild=y1)
    return x1, x2, g1, g2 + dx2


def _branch_backward(positions, branch, h, grad_out, params, grads, *, rebuild):
    """Runs ``branch`` on ``h`` once: ``rebuild - branch(h)`` (the other half of the
    block's input) and ``h``'s gradient; the parameters' gradients go into ``grads``."""
    names, slots = _slots(positions, branch)
    with autograd_in_kernel():
        h = h.detach().requires_grad_()
        leaves = [params[k].detach().requires_grad_() for k in slots]
        out = _bound(branch, names)(h, leaves)
        rebuilt = rebuild - out.detach()
        dh, *dparams = torch.autograd.grad(out, [h, *leaves], grad_out, allow_unused=True)
    for k, d in zip(slots, dparams, strict=True):
        if d is not None:
            grads[k] = d if grads[k] is None else grads[k] + d
    return rebuilt, (torch.zeros_like(h) if dh is None else dh)


@reversible_backward.register_fake
def _(y, grad, states, params, stack, random, autocast):
    return [torch.empty_like(y), *(torch.empty_like(p) for p in params)]


def _valid_states(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The backward op's synthetic inputs with valid generator states (the current ones)
    in ``states``, so the cost model can run it (``remat.costs.measured.VALID_INPUTS``)."""
    y, grad, states, *rest = args
    valid = _state(y.device).expand(states.shape[0], -1).clone()
    return (y, grad, valid, *rest), kwargs


VALID_INPUTS["remat::reversible_backward"] = _valid_states


def _setup(ctx, inputs, output) -> None:
    _x, params, stack, random, autocast = inputs
    y, states = output
    ctx.stack, ctx.random, ctx.autocast = stack, random, autocast
    ctx.save_for_backward(y, states, *params)


def _backward(ctx, grad_y, _grad_states):
    y, states, *params = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(y)
    grad_x, *grad_params = torch.ops.remat.reversible_backward(
        y, grad_y, states, params, ctx.stack, ctx.random, ctx.autocast
    )
    return grad_x, grad_params, None, None, None


reversible_forward.register_autograd(_backward, setup_context=_setup)
