"""Fine-tune a Hugging Face model with ``transformers.Trainer`` under a remat budget.

The one remat line: hand the Trainer a model ``remat.optimize`` returned. Batches padded
to their longest row come in several shapes; each new shape is traced and planned once
(a plan per shape, kept by dynamo, at most ``torch._dynamo.config.recompile_limit`` of
them: pad to a multiple, as here, to keep their number small). The budget holds for each.
A tiny random-weight GPT-2 trains a few steps: ``python examples/hf_trainer.py`` (needs
``pip install -e '.[transformers]'``; under a minute on two CPU cores).
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import remat

VOCAB, PAD_TO = 128, 8


def dataset(rows: int, seed: int = 0) -> list[dict]:
    """Token rows of two lengths, so batches come in two shapes."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [20 if i % 4 == 0 else 12 for i in range(rows)]
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]


def collate(rows: list[dict]) -> dict:
    """Pad to the longest row, rounded up to a multiple of ``PAD_TO``; padding is masked
    and ignored by the loss (label -100)."""
    longest = max(len(r["input_ids"]) for r in rows)
    width = -(-longest // PAD_TO) * PAD_TO
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget", default="0.8", help="remat budget (fraction or bytes)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=2,
        use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no",
        logging_steps=1, dataloader_drop_last=True,
    )  # fmt: skip

    trainer = Trainer(
        model=remat.optimize(model, budget=args.budget),  # remat: the one added line
        args=training,
        train_dataset=dataset(4 * args.steps),
        data_collator=collate,
    )
    trainer.train()

    report = trainer.model.remat.report()
    print(report)
    for step in report.steps:  # one step plan per batch shape
        graphs = [g for g in report.graphs if g.name in step.graphs]
        seconds = sum(g.plan_seconds for g in graphs)
        print(f"shape planned in {seconds:.2f}s ({', '.join(step.graphs)})")


if __name__ == "__main__":
    main()
