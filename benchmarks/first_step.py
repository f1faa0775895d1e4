"""The first step and every later one against the budget, on six transformers with the
loss outside the optimized module (the training loop computes it on the returned logits).

    python benchmarks/first_step.py --budgets 0.7,0.5 --compilers eager,inductor \\
        --json out/first_step.json

Each model is built from a small config (random weights, no download, no dropout) and
returns logits; the loop computes cross-entropy on them and calls ``backward``. Budgets are
fractions of the *eager step's measured peak* turned into bytes, so a row reads as a user
who knows their step's memory would read it. Per model, budget and compiler:

1. ``first step s``: the first step of a fresh ``remat.optimize`` (tracing, measuring each
   kernel, solving), timed; it fills a plan cache in a temporary folder.
2. ``first / budget``: the first step once more, from a reset dynamo and that cache, so it
   runs exactly the plans a first step runs while the profiler measures its peak (planning
   inside the profiler would measure no kernel scratch: ``remat.memory``). Its gradients
   are compared with eager's (``grad error``: the largest difference over eager's largest
   gradient).
3. ``later / budget``: the largest measured peak of steps 2 to 4.
4. ``later step / eager``: the median time of three later steps over eager's.

A budget below what remat can reach is a row naming the minimum it would need.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from _output import chosen, finished, model_parser, shown, transformers_models

import remat
from remat import memory
from remat.tools.grads import grad_error, gradients

TEXT = dict(vocab_size=512, max_position_embeddings=128)
LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
BATCH, SEQ, CLASSES = 4, 128, 10


class Logits(torch.nn.Module):
    """A transformers model called with its inputs, returning only its logits."""

    def __init__(self, model: torch.nn.Module, **fixed) -> None:
        super().__init__()
        self.model, self.fixed = model, fixed

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        key = "pixel_values" if inputs.is_floating_point() else "input_ids"
        return self.model(**{key: inputs}, **self.fixed).logits


def _text(T, config, cls) -> tuple:
    ids = torch.randint(0, 512, (BATCH, SEQ))
    return Logits(cls(config)), ids, ids


def models(T) -> dict:
    """name -> a function building ``(module, inputs, targets)``."""
    decoder = dict(**TEXT, hidden_size=64, num_key_value_heads=2, **LAYERS)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return {
        "gpt2": lambda: _text(
            T,
            T.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=512,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # fmt: skip
            T.GPT2LMHeadModel,
        ),
        "llama": lambda: _text(T, T.LlamaConfig(**decoder), T.LlamaForCausalLM),
        "bert": lambda: _text(
            T, T.BertConfig(**TEXT, hidden_size=64, **LAYERS, **no_dropout), T.BertForMaskedLM
        ),
        "t5": lambda: _t5(T),
        "vit": lambda: _vit(T, no_dropout),
        "mixtral": lambda: _text(
            T,
            T.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2),
            T.MixtralForCausalLM,
        ),
    }


def _t5(T) -> tuple:
    config = T.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=256, num_layers=2,
                        num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    ids = torch.randint(0, 512, (BATCH, SEQ))
    decoder_ids = torch.randint(0, 512, (BATCH, SEQ // 2))
    model = Logits(T.T5ForConditionalGeneration(config), decoder_input_ids=decoder_ids)
    return model, ids, decoder_ids


def _vit(T, no_dropout: dict) -> tuple:
    config = T.ViTConfig(image_size=64, patch_size=8, hidden_size=64, **LAYERS,
                         num_labels=CLASSES, **no_dropout)  # fmt: skip
    pixels = torch.randn(16, 3, 64, 64)
    return Logits(T.ViTForImageClassification(config)), pixels, torch.randint(0, CLASSES, (16,))


def step(fn, model: torch.nn.Module, inputs, targets) -> None:
    """One training step with the loss outside ``fn``: cross-entropy on its logits."""
    model.zero_grad(set_to_none=True)
    logits = fn(inputs)
    F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()


def _seconds(fn, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(name: str, build, fraction: float, compiler: str) -> dict:
    torch.manual_seed(0)
    model, inputs, targets = build()
    reference = copy.deepcopy(model)
    eager = memory.peak(lambda: step(reference, reference, inputs, targets)).peak_bytes
    eager_s = _seconds(lambda: step(reference, reference, inputs, targets))
    step(reference, reference, inputs, targets)  # the gradients to compare with
    budget = int(fraction * eager)
    out = {"model": name, "compiler": compiler, "budget": fraction, "eager peak": eager}
    with tempfile.TemporaryDirectory() as cache:
        torch.compiler.reset()
        planned = copy.deepcopy(model)
        optimized = remat.optimize(planned, budget=budget, cache=cache, compiler=compiler)
        start = time.perf_counter()
        try:
            step(optimized, planned, inputs, targets)
        except remat.InfeasibleBudget as refusal:
            return {**out, "refused": f"needs {refusal.minimum / eager:.3f} of eager's peak"}
        out["first step s"] = time.perf_counter() - start
        torch.compiler.reset()
        optimized = remat.optimize(model, budget=budget, cache=cache, compiler=compiler)
        first = memory.peak(lambda: step(optimized, model, inputs, targets)).peak_bytes
        error = grad_error(gradients(model), gradients(reference))
        later = max(
            memory.peak(lambda: step(optimized, model, inputs, targets)).peak_bytes
            for _ in range(3)
        )
        later_s = _seconds(lambda: step(optimized, model, inputs, targets))
    report = optimized.remat.report()
    return {
        **out,
        "graphs": len(report.graphs),
        "first / budget": first / budget,
        "later / budget": later / budget,
        "grad error": error,
        "later step / eager": later_s / eager_s,
        "first step / later": out["first step s"] / later_s,
    }


def main(argv=None) -> int:
    built = transformers_models(models)
    if built is None:
        return 2
    parser = model_parser(__doc__, built)
    parser.add_argument("--budgets", default="0.7,0.5", help="fractions of eager's peak")
    parser.add_argument("--compilers", default="eager,inductor")
    args = parser.parse_args(argv)
    names = chosen(parser, args.models, built)
    rows: list[dict] = []
    for compiler in args.compilers.split(","):
        for name in names:
            for fraction in (float(x) for x in args.budgets.split(",")):
                shown(rows, row(name, built[name], fraction, compiler))
    finished(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
