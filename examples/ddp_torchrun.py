"""Data-parallel training under a remat budget, launched by torchrun.

``torchrun --standalone --nproc_per_node=2 examples/ddp_torchrun.py`` (gloo on CPU, NCCL
on GPUs). Each rank plans its step (dynamo's DDP optimizer compiles one graph per gradient
bucket, planned together as one step); ranks compare their plans and take rank 0's where
they differ, so every rank runs the same programs. Rank 0 prints the plan.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import remat
from remat.tools.examples import gpt

STEPS, BATCH, SEQ, VOCAB = 3, 4, 128, 512


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    model, _ = gpt(layers=2, d_model=128, heads=2, seq=SEQ, batch=BATCH, vocab=VOCAB,
                   dropout=0.0, device=device)  # fmt: skip
    model = DistributedDataParallel(model, bucket_cap_mb=1)
    model = remat.optimize(model, budget=0.75)  # remat: the one added line

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)  # each rank its own data
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()  # DDP averages the gradients across ranks
        optimizer.step()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    if rank == 0:
        print(model.remat.report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
