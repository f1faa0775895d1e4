"""Fine-tune a Hugging Face model with ``transformers.Trainer`` under a remat budget.

The one remat line: hand the Trainer a model ``remat.optimize`` returned. Batches are
padded to their longest row, so every step has a sequence length of its own: dynamo traces
the first step's sizes, and the second's once more with the length symbolic; from then on
that graph serves every length, planned again (no trace) only where a longer batch comes
than any before. The budget holds at every length (docs/guide.md, "Sizes that vary").
A tiny random-weight GPT-2 trains on rows of 16 to 128 tokens:
``python examples/hf_trainer.py`` (needs ``pip install -e '.[transformers]'``).
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import remat

VOCAB, SHORTEST, LONGEST = 128, 16, 128


def dataset(rows: int, seed: int = 0) -> list[dict]:
    """Token rows of lengths spread over ``SHORTEST..LONGEST``, as a text corpus gives."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (rows,), generator=gen).tolist()
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]


def collate(rows: list[dict]) -> dict:
    """Pad to the longest row; padding is masked and ignored by the loss (label -100)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def model_and_args(steps: int, output_dir: str) -> tuple[torch.nn.Module, TrainingArguments]:
    """The model (a tiny GPT-2, random weights) and the Trainer's arguments."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=LONGEST, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    training = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4,
        use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no",
        logging_steps=1, dataloader_drop_last=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config), training


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--budget", default="0.6", help="remat budget (fraction or bytes)")
    args = parser.parse_args(argv)

    model, training = model_and_args(args.steps, tempfile.mkdtemp())
    trainer = Trainer(
        model=remat.optimize(model, budget=args.budget),  # remat: the one added line
        args=training,
        train_dataset=dataset(4 * args.steps),
        data_collator=collate,
    )
    trainer.train()

    report = trainer.model.remat.report()
    print(report)
    traces = {g.compile_id for g in report.graphs}
    print(f"{args.steps} steps: {len(traces)} traces, {len(report.graphs)} graph plans")


if __name__ == "__main__":
    main()
