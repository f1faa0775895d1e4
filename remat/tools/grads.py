"""The gradients ``remat.tools.bench`` checks every configuration's first step against.

A partition that recomputes dropout with a fresh mask trains on wrong gradients, so each
configuration's warm-up step runs from ``GRAD_SEED`` and its gradients are compared with
eager's from the same seed. Where a plain compiled step computes other numbers than eager
(inductor draws random numbers its own way; below float32, the compiled graph's
decompositions round otherwise), the compiled rows are compared with a plain
``torch.compile``'s instead (``reference_for``): torch's rows under inductor on a random
step, and every compiled row below float32. remat's rows under inductor keep eager's as
their reference on a random step: remat draws dropout's masks from eager's generator
there too (``passes.rng``).
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

__all__ = ["GRAD_SEED", "grad_error", "gradients", "reference_for", "reference_gradients"]

GRAD_SEED = 1234  # every configuration's first step draws from this seed


def reference_gradients(
    spec, kwargs, compiler: str, methods, say: Callable[[str], None]
) -> dict[str, list[torch.Tensor]]:
    """The gradients rows are compared with: eager's, and for the compiled rows, where a
    plain compiled step computes other numbers, plain ``torch.compile``'s (partitioned by
    torch at its default budget, run by ``compiler``): an inductor step that is random,
    and any step whose gradients are less precise than float32. Computed on as many
    threads as the rows: a matmul's sums may be ordered by the thread count (on one CPU
    eager's own row was 2e-8 off a 2-thread one)."""
    references = {"eager": _eager_gradients(spec, kwargs)}
    if not {"torch", "remat"} & set(methods):
        return references
    eager = references["eager"]
    random_inductor = compiler == "inductor" and _is_random(spec, kwargs, eager)
    if random_inductor or _below_float32(eager):
        say("one plain torch.compile step: the compiled rows' reference")
        references["torch.compile"] = _compiled_gradients(spec, kwargs, compiler)
    return references


def reference_for(method: str, references: dict[str, list[torch.Tensor]]) -> str:
    """The reference a row of ``method`` is compared with, of ``reference_gradients``'."""
    if "torch.compile" not in references or method not in ("torch", "remat"):
        return "eager"
    if method == "remat" and not _below_float32(references["eager"]):
        return "eager"  # a random step under inductor: remat replays eager's masks
    return "torch.compile"


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


def _below_float32(reference: list[torch.Tensor]) -> bool:
    """Whether gradients are kept less precisely than float32 (bfloat16, float16)."""
    float32 = torch.finfo(torch.float32).eps
    return any(g.is_floating_point() and torch.finfo(g.dtype).eps > float32 for g in reference)


def _compiled_gradients(spec, kwargs, compiler: str) -> list[torch.Tensor]:
    """A plain ``torch.compile`` step's gradients from ``GRAD_SEED`` (torch's partition at
    its default budget, run by ``compiler``): what the compiled rows must match where the
    compiled graph computes other numbers than eager, in the kernels inductor fuses and
    the seeds it draws from, or in how a low precision rounds its decomposed ops."""
    model, inputs = examples.load(spec, **kwargs)
    compiled = torch_compiled(model, compiler)
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
