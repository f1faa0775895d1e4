"""The gradients ``remat.tools.bench`` checks every configuration's first step against.

A partition that recomputes dropout with a fresh mask trains on wrong gradients, so each
configuration's warm-up step runs from ``GRAD_SEED`` and its gradients are compared with
eager's from the same seed. Inductor draws random numbers its own way, so where inductor
runs a random step the compiled rows are compared with plain ``torch.compile``'s instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from remat.passes._torch_compat import compile_caches_off
from remat.tools import examples
from remat.tools.methods import torch_compiled
from remat.tools.rows import GRAD_TOLERANCE

__all__ = ["GRAD_SEED", "grad_error", "gradients", "reference_gradients"]

GRAD_SEED = 1234  # every configuration's first step draws from this seed


def reference_gradients(
    spec, kwargs, compiler: str, methods, say: Callable[[str], None]
) -> dict[str, list[torch.Tensor]]:
    """The gradients rows are compared with: eager's, and for the inductor rows of a random
    step plain ``torch.compile``'s (inductor draws random numbers its own way). Computed
    on as many threads as the rows: a matmul's sums may be ordered by the thread count
    (on one CPU eager's own row was 2e-8 off a 2-thread one)."""
    references = {"eager": _eager_gradients(spec, kwargs)}
    compiled_rows = compiler == "inductor" and {"torch", "remat"} & set(methods)
    if compiled_rows and _is_random(spec, kwargs, references["eager"]):
        say("the step is random: one plain torch.compile step, the inductor rows' reference")
        references["torch.compile"] = _compiled_gradients(spec, kwargs)
    return references


def _eager_gradients(spec, kwargs, seed: int = GRAD_SEED) -> list[torch.Tensor]:
    """Eager's gradients of one step from ``seed``; from ``GRAD_SEED``, what every
    configuration must get."""
    model, inputs = examples.load(spec, **kwargs)
    torch.manual_seed(seed)
    model(*inputs).backward()
    return gradients(model)


def _is_random(spec, kwargs, reference: list[torch.Tensor]) -> bool:
    """Whether the step's gradients depend on the seed (dropout, other random ops)."""
    error = grad_error(_eager_gradients(spec, kwargs, GRAD_SEED + 1), reference)
    return error is not None and error > GRAD_TOLERANCE


def _compiled_gradients(spec, kwargs) -> list[torch.Tensor]:
    """Plain ``torch.compile``'s (inductor) gradients of one step from ``GRAD_SEED``: the
    reference of inductor rows when the step is random. Inductor draws random numbers its
    own way (seeded, so a recompute replays them), so no inductor row can match eager's
    masks; torch's and remat's partitions must match this instead."""
    model, inputs = examples.load(spec, **kwargs)
    compiled = torch_compiled(model, "inductor")
    torch.manual_seed(GRAD_SEED)
    with compile_caches_off():
        compiled(*inputs).backward()
    return gradients(model)


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """Gradients in parameter order (wrapping blocks for checkpointing keeps the order)."""
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def grad_error(grads: list[torch.Tensor], reference: list[torch.Tensor] | None) -> float | None:
    """The largest difference from ``reference``, relative to its largest gradient; ``inf``
    where other parameters got gradients, ``None`` without a reference."""
    if not reference:
        return None
    if len(grads) != len(reference) or any(
        g.shape != r.shape for g, r in zip(grads, reference, strict=True)
    ):
        return math.inf  # other parameters got gradients: as wrong as it gets
    scale = max(float(r.abs().max()) for r in reference) or 1.0
    return max(float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True)) / scale
