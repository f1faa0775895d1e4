"""Train a small GPT with its activations under a memory budget.

The training loop is a plain PyTorch one; remat is the single marked line. Run it with
``python examples/train_gpt.py`` (under 10 seconds on two idle CPU cores).
"""

import torch

import remat
from remat.tools.examples import gpt

STEPS = 5
BATCH, SEQ, VOCAB = 4, 128, 512


def main() -> None:
    torch.manual_seed(0)
    model, _ = gpt(layers=4, d_model=128, heads=4, seq=SEQ, batch=BATCH, vocab=VOCAB)
    # The forward of the built-in GPT returns its own loss: model(tokens, targets) -> scalar.

    model = remat.optimize(model, budget=0.5)  # remat: peak at most 50% of storing everything

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1)) for _ in range(2)]  # a tiny "dataset"
    for step in range(STEPS):
        tokens = data[step % len(data)]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs, targets)  # the first call traces and plans, like torch.compile
        loss.backward()
        optimizer.step()
        print(f"step {step + 1}: loss {loss.item():.4f}")

    print(model.remat.report())


if __name__ == "__main__":
    main()
