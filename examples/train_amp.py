"""A plain training loop with mixed precision and gradient accumulation under remat.

Autocast runs the step in a half-precision type (bfloat16 on CPU; float16 with a
GradScaler on CUDA), and each optimizer step sums the gradients of ``--micro`` forward and
backward passes. remat plans the graph autocast produces, so the budget covers the step
as it really runs; every micro-batch is one planned step. ``python examples/train_amp.py``
(a few seconds on two CPU cores; on a GPU machine the same script runs on CUDA).
"""

import argparse

import torch

import remat
from remat.tools.examples import gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--budget", default="0.7", help="remat budget (fraction or bytes)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    half = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model, _ = gpt(layers=2, d_model=64, heads=4, seq=64, batch=4, vocab=256, device=device)

    model = remat.optimize(model, budget=args.budget)  # remat: the one added line

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # float16 needs loss scaling against underflow; bfloat16 has float32's range
    scaler = torch.amp.GradScaler(device, enabled=half is torch.float16)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(args.micro):
            tokens = torch.randint(0, 256, (4, 65), device=device)
            with torch.autocast(device, dtype=half):
                loss = model(tokens[:, :-1], tokens[:, 1:]) / args.micro
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step + 1}: loss {loss.item() * args.micro:.4f}")
    print(model.remat.report())


if __name__ == "__main__":
    main()
