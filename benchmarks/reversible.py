"""Numerics of remat.nn's reversible stacks against depth and dtype: how far the rebuilt
inputs and the gradients drift from the ordinary network's.

    python benchmarks/reversible.py [--depths 4,16,64,256] [--dtypes float32,bfloat16]
        [--inits scaled,default] [--width 64] [--batch 64]
        [--json out/reversible.json] [--csv out/reversible.csv]

Each depth builds one stack of pre-norm MLP couplings (f and g: LayerNorm, Linear, GELU,
Linear, 4x wide) in float64 from one seed, and casts copies to each dtype. ``init``:
``scaled`` divides the last Linear's weights by sqrt(2 * depth) as GPT-2 does, so the
stack's output stays near its input's norm; ``default`` keeps torch's initialisation,
so every block adds about as much as its input and the output grows with depth (the
``growth`` column: output norm over input norm), as in a network trained away from its
initialisation. Columns of errors are relative (norm of the difference over the norm of
the reference):

- ``inverse``: the input rebuilt from the output by inverting the blocks from the last
  (what the backward does), against the input, in the dtype;
- ``grad vs ordinary``: the reversible stack's gradients (the input's and all the
  parameters', concatenated) against the ordinary network's (the same couplings run by
  autograd, storing activations), both in the dtype: the error reversibility adds;
- ``ordinary vs float64``: the ordinary network's gradients in the dtype against float64:
  the error the dtype itself makes, the yardstick for the column before.

The loss is the mean square of the output. One thread.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from _output import write_rows
from tabulate import tabulate
from torch import nn

from remat.nn import Coupling, ReversibleSequential

INITS = ("scaled", "default")


def branch(width: int, depth: int, init: str) -> nn.Module:
    mlp = nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
    )
    if init == "scaled":
        with torch.no_grad():
            mlp[-1].weight.mul_(1 / math.sqrt(2 * depth))
    return mlp


def build(depth: int, width: int, init: str, seed: int = 0) -> ReversibleSequential:
    torch.manual_seed(seed)
    half = width // 2
    blocks = (Coupling(branch(half, depth, init), branch(half, depth, init)) for _ in range(depth))
    return ReversibleSequential(*blocks).double()


def gradients(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input's and the parameters' gradients of the mean-square loss, flattened."""
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()
    return torch.cat(
        [x.grad.double().flatten(), *(p.grad.double().flatten() for p in model.parameters())]
    )


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def measure(depth: int, dtype: torch.dtype, init: str, width: int, batch: int) -> dict:
    reference = build(depth, width, init)
    rev = copy.deepcopy(reference).to(dtype)
    x64 = torch.randn(batch, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x64.to(dtype)
    with torch.no_grad():
        y = rev(x)
        rebuilt = y
        for block in reversed(rev.blocks):
            rebuilt = block.inverse(rebuilt)
    twin = nn.Sequential(*rev.blocks)
    grads = gradients(rev, x)
    ordinary = gradients(twin, x)
    exact = gradients(nn.Sequential(*reference.blocks), x64)
    return {
        "init": init,
        "depth": depth,
        "dtype": str(dtype).removeprefix("torch."),
        "inverse": relative(rebuilt, x),
        "grad vs ordinary": relative(grads, ordinary),
        "ordinary vs float64": relative(ordinary, exact),
        "growth": float(y.double().norm() / x64.norm()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4,16,64,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--inits", default=",".join(INITS))
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        measure(depth, getattr(torch, name), init, args.width, args.batch)
        for init in args.inits.split(",")
        for name in args.dtypes.split(",")
        for depth in (int(d) for d in args.depths.split(","))
    ]
    shown = [{k: f"{v:.2g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    print(tabulate(shown, headers="keys", tablefmt="github"))
    write_rows(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
