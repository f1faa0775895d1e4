"""Hugging Face architectures remat has no example of: gradients and peaks under a budget.

    python benchmarks/hf_zoo.py --budgets 0.8,0.5 --json out/hf_zoo.json

Each model is built from a small config (random weights, no download) and called as its
users call it, with ``labels=`` (the loss inside, the logits returned beside it). Per
budget (a fraction of remat's store-all peak): a first step under ``remat.optimize``
(it plans), whose gradients are compared with an eager copy's from the same weights;
then three steps, whose measured peaks are compared with the report's prediction. A
budget below what the model can reach is a row naming the minimum.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from _output import chosen, finished, model_parser, shown, transformers_models

import remat
from remat import memory

TEXT = dict(vocab_size=512, max_position_embeddings=128)
LAYERS = dict(num_hidden_layers=3, num_attention_heads=4, intermediate_size=128)


def _causal(config, cls):
    ids = torch.randint(0, 512, (2, 64))
    return cls(config), dict(input_ids=ids, labels=ids)


def _models(T) -> dict:
    """name -> a function building ``(model, batch)``."""
    decoder = dict(**TEXT, hidden_size=64, num_key_value_heads=2, **LAYERS)
    return {
        "bert": lambda: _causal(
            T.BertConfig(**TEXT, hidden_size=64, **LAYERS, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0),  # fmt: skip
            T.BertForMaskedLM,
        ),
        "distilbert": lambda: (
            T.DistilBertForSequenceClassification(
                T.DistilBertConfig(**TEXT, dim=64, n_layers=3, n_heads=4, hidden_dim=128,
                                   dropout=0.0, attention_dropout=0.0)  # fmt: skip
            ),
            dict(input_ids=torch.randint(0, 512, (2, 64)), labels=torch.tensor([0, 1])),
        ),
        "t5": lambda: _causal(
            T.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                       num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),  # fmt: skip
            T.T5ForConditionalGeneration,
        ),
        "mistral": lambda: _causal(T.MistralConfig(**decoder), T.MistralForCausalLM),
        "qwen2": lambda: _causal(T.Qwen2Config(**decoder), T.Qwen2ForCausalLM),
        "gpt-neox": lambda: _causal(
            T.GPTNeoXConfig(**TEXT, hidden_size=64, **LAYERS), T.GPTNeoXForCausalLM
        ),
        "vit": lambda: (
            T.ViTForImageClassification(
                T.ViTConfig(image_size=32, patch_size=8, hidden_size=64, **LAYERS, num_labels=10,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
            ),
            dict(pixel_values=torch.randn(4, 3, 32, 32), labels=torch.randint(0, 10, (4,))),
        ),
    }


def _loss(model, batch):
    return model(**batch).loss  # the output object (and its logits) dropped here


def row(name: str, build, budget: float) -> dict:
    torch.manual_seed(0)
    model, batch = build()
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    _loss(reference, batch).backward()
    torch.compiler.reset()
    optimized = remat.optimize(model, budget=budget, cache=False)
    start = time.perf_counter()
    torch.manual_seed(1)
    try:
        _loss(optimized, batch).backward()
    except remat.InfeasibleBudget as refusal:
        return {"model": name, "budget": budget,
                "refused": f"minimum {refusal.minimum / refusal.store_all:.3f}"}  # fmt: skip
    first = time.perf_counter() - start
    params = zip(model.parameters(), reference.parameters(), strict=True)
    pairs = [(p.grad, q.grad) for p, q in params]
    error = max(
        (float((g - r).abs().max() / (r.abs().max() + 1e-30)) for g, r in pairs
         if r is not None and g is not None),
        default=0.0,
    )  # fmt: skip
    missing = sum((g is None) != (r is None) for g, r in pairs)
    peaks = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        peaks.append(memory.peak(lambda: _loss(optimized, batch).backward()).peak_bytes)
    report = optimized.remat.report()
    return {
        "model": name,
        "budget": budget,
        "graphs": len(report.graphs),
        "grad error": error,
        "grads missing": missing,
        "measured peak": max(peaks),
        "predicted peak": report.predicted_peak,
        "measured - predicted": max(peaks) - report.predicted_peak,
        "store-all peak": report.store_all_peak,
        "solver": ", ".join(sorted({g.plan.solver for g in report.graphs})),
        "first step s": first,
    }


def main(argv=None) -> int:
    models = transformers_models(_models)
    if models is None:
        return 2
    parser = model_parser(__doc__, models)
    parser.add_argument("--budgets", default="0.8,0.5")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for name in chosen(parser, args.models, models):
        for budget in (float(x) for x in args.budgets.split(",")):
            shown(rows, row(name, models[name], budget))
    finished(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
