"""A reversible transformer beside its ordinary twin: training, and peak memory against depth.

Both models are a token embedding, a body of ``depth`` layers, a LayerNorm and a linear
head under cross-entropy, built from the same seed with the same branches: per layer a
causal self-attention branch and an MLP branch (each pre-norm).

- ordinary: the residual stack x -> x + attention(x) -> x + mlp(x), trained by autograd,
  which stores every layer's activations;
- reversible: ``remat.nn.ReversibleSequential.from_residual`` over the same branches,
  attention as f and MLP as g of one coupling per layer, two streams of the model width;
  its backward rebuilds each layer's input from its output.

For each depth it trains both for ``--steps`` AdamW steps on one batch and reports the
first and last loss, the measured peak of one step (forward and backward, gradients set
to None first; ``remat.memory.peak``) and that peak less the parameters' gradients (which
both hold at the end of the step, linear in depth by construction); then the log-log
slope of each peak against depth (0: flat, 1: linear). ``grads`` checks the reversible
model's gradients against the same couplings run by autograd (relative error).
At ``--optimize`` layers, the reversible model also trains under
``remat.optimize(budget=1.0)``: its predicted and measured peaks are printed.

    python examples/reversible_transformer.py [--depths 2,4,8,16] [--steps 3]
        [--d-model 64] [--heads 4] [--seq 64] [--batch 8] [--vocab 128] [--optimize 4]
        [--out out/reversible_transformer]

Writes ``reversible_transformer.csv`` and ``.json`` under ``--out``. One thread.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
from pathlib import Path

import numpy as np
import torch
from tabulate import tabulate
from torch import nn
from torch.nn import functional as F

import remat
from remat import memory
from remat.nn import ReversibleSequential


class Attention(nn.Module):
    """Pre-norm causal self-attention: the f of a coupling."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, t, d))


def mlp(d: int) -> nn.Module:
    """Pre-norm MLP: the g of a coupling."""
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Residual(nn.Module):
    """The ordinary body: x + branch(x) for each branch in turn."""

    def __init__(self, branches: list[nn.Module]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        for branch in self.branches:
            x = x + branch(x)
        return x


class Transformer(nn.Module):
    def __init__(self, body: nn.Module, d: int, vocab: int) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(vocab, d), body
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens, targets):
        logits = self.head(self.norm(self.body(self.embed(tokens))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def twins(depth: int, d: int, heads: int, vocab: int) -> tuple[Transformer, Transformer]:
    """(reversible, ordinary) from one seed, with equal parameters."""
    torch.manual_seed(0)
    branches = [m for _ in range(depth) for m in (Attention(d, heads), mlp(d))]
    ordinary = Transformer(Residual(branches), d, vocab)
    reversible = copy.deepcopy(ordinary)
    reversible.body = ReversibleSequential.from_residual(list(reversible.body.branches))
    return reversible, ordinary


def step(model: nn.Module, run, tokens, targets) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = run(tokens, targets)
    loss.backward()
    return loss.detach()


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def autograd_error(model: Transformer, tokens, targets) -> float:
    """Relative error of the reversible model's gradients against the same couplings run
    by autograd (two streams of the input, the mean of the outputs)."""
    step(model, model, tokens, targets)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    ordinary = copy.deepcopy(model)
    ordinary.body = _Streams(nn.Sequential(*ordinary.body.blocks), model.body.dim)
    step(ordinary, ordinary, tokens, targets)
    ref = torch.cat([p.grad.flatten() for p in ordinary.parameters()])
    return float((grads - ref).norm() / ref.norm())


class _Streams(nn.Module):
    """What ``from_residual``'s stack computes, by autograd: the input twice, the mean."""

    def __init__(self, couplings: nn.Module, dim: int) -> None:
        super().__init__()
        self.couplings, self.dim = couplings, dim

    def forward(self, x):
        y1, y2 = self.couplings(torch.cat([x, x], self.dim)).chunk(2, self.dim)
        return (y1 + y2) / 2


def train(model: nn.Module, run, tokens, targets, steps: int) -> tuple[list[float], int]:
    """Losses of ``steps`` AdamW steps and the measured peak of one more step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        losses.append(float(step(model, run, tokens, targets)))
        opt.step()
    peak = memory.peak(lambda: step(model, run, tokens, targets)).peak_bytes
    return losses, peak


def slope(depths, values) -> float:
    return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--optimize", type=int, default=4, help="layers; 0 skips")
    parser.add_argument("--out", type=Path, default=Path("out/reversible_transformer"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = torch.randint(
        0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens, targets = data[:, :-1], data[:, 1:]
    depths = [int(d) for d in args.depths.split(",")]
    rows = []
    for depth in depths:
        reversible, ordinary = twins(depth, args.d_model, args.heads, args.vocab)
        error = autograd_error(reversible, tokens, targets)
        rev_losses, rev_peak = train(reversible, reversible, tokens, targets, args.steps)
        ord_losses, ord_peak = train(ordinary, ordinary, tokens, targets, args.steps)
        grads = grad_bytes(reversible)
        rows.append(
            {
                "depth": depth,
                "reversible loss": f"{rev_losses[0]:.3f} -> {rev_losses[-1]:.3f}",
                "ordinary loss": f"{ord_losses[0]:.3f} -> {ord_losses[-1]:.3f}",
                "reversible peak": rev_peak,
                "ordinary peak": ord_peak,
                "reversible less grads": rev_peak - grads,
                "ordinary less grads": ord_peak - grads,
                "grads": f"{error:.1e}",
            }
        )
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if len(depths) > 1:
        for key in (
            "reversible peak",
            "ordinary peak",
            "reversible less grads",
            "ordinary less grads",
        ):
            print(
                f"log-log slope of {key} against depth: {slope(depths, [r[key] for r in rows]):.2f}"
            )
    if args.optimize:
        reversible, _ = twins(args.optimize, args.d_model, args.heads, args.vocab)
        optimized = remat.optimize(reversible, budget=1.0)
        step(reversible, optimized, tokens, targets)  # compiles and plans
        losses, peak = train(reversible, optimized, tokens, targets, args.steps)
        predicted = optimized.remat.report().predicted_peak
        print(
            f"remat.optimize, {args.optimize} layers: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"predicted peak {predicted} B, measured {peak} B"
        )
        rows.append(
            {"depth": args.optimize, "optimize predicted": predicted, "optimize measured": peak}
        )
    _write(rows, args.out)
    return rows


def _write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "reversible_transformer.json").write_text(json.dumps(rows, indent=2))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with (out / "reversible_transformer.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
