"""remat against the program as the user gives it, at equal memory: models that checkpoint
every layer by hand, and one whose compiled program is not its eager one, their measured
step against remat's under a budget of exactly that step's measured peak.

    python benchmarks/as_given.py --json out/as_given.json

Each model is built from a small config (random weights, no download, no dropout), the
loss computed inside (``labels=``): ``blocks``, ``gpt2`` and ``llama`` checkpoint every
layer as their users do it (``torch.utils.checkpoint`` per block; transformers'
``gradient_checkpointing_enable``, non-reentrant, the form dynamo traces); ``mamba``
(transformers' reference PyTorch path) does not checkpoint, and runs another scan when
dynamo traces it (a parallel ``associative_scan``) than when it runs eagerly (a loop over
the sequence); ``mamba-loop`` is that model with ``use_associative_scan=False``, whose
traced program is the eager loop. Per model:

1. ``yours``: the program run eagerly, as the user runs it: its measured peak
   (``memory.peak``) and the median time of ``--repeat`` steps.
2. ``remat at yours``: ``remat.optimize`` with the budget in bytes equal to that peak. Its
   largest measured peak over the timed steps against the budget, the median step time
   against yours, the plan remat chose (``your checkpointing`` where it kept the user's
   own), gradients against eager's without checkpointing.
3. ``remat 1.0``: the same at budget 1.0, a fraction of the program as the user wrote it
   where that peaks below storing everything (docs/guide.md, "What the budget means"):
   their checkpointing, or the module's eager step run under fake tensors before the
   first step, whose time alone is ``fake eager step s``. Both remat rows measure their
   first step on its own too.
4. ``torch.compile``: the model under torch's own partition with eager kernels
   (``backend="aot_eager_decomp_partition"``, the partition inductor uses): what
   compiling alone does to the peak.

Steps are timed on ``--threads`` threads (1 by default, as ``remat bench``), each after an
untimed step of the same configuration.
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
from torch.utils.checkpoint import checkpoint

import remat
from remat import memory
from remat.as_given import eager_phases
from remat.tools.grads import grad_error, gradients

BATCH, SEQ, VOCAB = 4, 256, 1024


class Blocks(torch.nn.Module):
    """An MLP-block stack that checkpoints each block with ``torch.utils.checkpoint``."""

    def __init__(self, blocks: int = 8, width: int = 256, classes: int = 64) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(width, classes)
        self.checkpointed = True

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed:
                x = x + checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return F.cross_entropy(self.head(x), labels)


class Loss(torch.nn.Module):
    """A transformers causal LM called with ``labels=``, returning its loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


def _hf(T, config, checkpointed: bool = True, seq: int = SEQ) -> tuple:
    config.use_cache = False  # else transformers warns every call, a graph break per layer
    model = T.AutoModelForCausalLM.from_config(config)
    if checkpointed:
        kwargs = {"use_reentrant": False}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    return Loss(model), (ids, ids)


def _blocks() -> tuple:
    return Blocks(), (torch.randn(2048, 256), torch.randint(0, 64, (2048,)))


def models(T) -> dict:
    """name -> a function building ``(module, inputs)``."""
    layers = dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=128,
                  intermediate_size=512, vocab_size=VOCAB, max_position_embeddings=SEQ)  # fmt: skip
    return {
        "blocks": _blocks,
        "gpt2": lambda: _hf(
            T,
            T.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # fmt: skip
        ),
        "llama": lambda: _hf(T, T.LlamaConfig(**layers, num_key_value_heads=2)),
        "mamba": lambda: _mamba(T, associative_scan=True),
        "mamba-loop": lambda: _mamba(T, associative_scan=False),
    }


def _mamba(T, associative_scan: bool) -> tuple:
    config = T.MambaConfig(vocab_size=VOCAB, hidden_size=128, state_size=16,
                           num_hidden_layers=2, use_associative_scan=associative_scan)  # fmt: skip
    # measuring its eager loop at 256 tokens: over this machine's memory
    return _hf(T, config, checkpointed=False, seq=SEQ // 2)


def step(fn, model: torch.nn.Module, inputs: tuple) -> None:
    model.zero_grad(set_to_none=True)
    fn(*inputs).backward()


def _timed(fn, repeat: int) -> list[float]:
    """Per step, its seconds, each after an untimed step of the same program."""
    times = []
    for _ in range(repeat):
        fn()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _remat(model, inputs, budget, repeat: int, reference: list) -> dict:
    """remat under ``budget``: its first step measured on its own (its plans and kernel
    measurements from a plan cache an identical run filled, as a second process reads
    them: planning inside the profiler would measure no kernel scratch), the later
    steps' peak and time."""
    with tempfile.TemporaryDirectory() as cache:
        torch.compiler.reset()
        try:
            step(remat.optimize(model, budget=budget, cache=cache), model, inputs)
        except remat.InfeasibleBudget as refusal:
            return {"refused": refusal.minimum}
        torch.compiler.reset()
        optimized = remat.optimize(model, budget=budget, cache=cache)
        first = memory.peak(lambda: step(optimized, model, inputs)).peak_bytes
    error = grad_error(gradients(model), reference)
    peak = max(memory.peak(lambda: step(optimized, model, inputs)).peak_bytes for _ in range(2))
    seconds = statistics.median(_timed(lambda: step(optimized, model, inputs), repeat))
    report = optimized.remat.report()
    return {
        "limit": max(s.limit for s in report.steps),
        "first peak": first,
        "peak": peak,
        "predicted": report.predicted_peak,
        "seconds": seconds,
        "estimated": sum(g.step_seconds for g in report.graphs),
        "solver": report.steps[-1].plan.solver,
        "grad error": error,
    }


def row(name: str, build, repeat: int) -> dict:
    torch.manual_seed(0)
    model, inputs = build()
    plain = _plain(copy.deepcopy(model))
    step(model, model, inputs)
    yours = memory.peak(lambda: step(model, model, inputs)).peak_bytes
    yours_s = statistics.median(_timed(lambda: step(model, model, inputs), repeat))
    step(plain, plain, inputs)
    stored = memory.peak(lambda: step(plain, plain, inputs)).peak_bytes
    reference = gradients(plain)
    start = time.perf_counter()
    eager_phases(model, inputs, {})
    fake_s = time.perf_counter() - start
    out = {"model": name, "yours peak": yours, "store-all eager peak": stored,
           "yours s": yours_s, "torch.compile peak": _compiled_peak(model, inputs),
           "fake eager step s": fake_s}  # fmt: skip
    for label, budget in (("at yours", yours), ("1.0", 1.0)):
        got = _remat(model, inputs, budget, repeat, reference)
        out.update({f"remat {label} {k}": v for k, v in got.items()})
    return out


def _compiled_peak(model: torch.nn.Module, inputs: tuple) -> int:
    torch.compiler.reset()
    compiled = torch.compile(model, backend="aot_eager_decomp_partition")
    step(compiled, model, inputs)
    return memory.peak(lambda: step(compiled, model, inputs)).peak_bytes


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with any checkpointing turned off: eager's reference gradients."""
    if isinstance(model, Blocks):
        model.checkpointed = False
    elif model.model.is_gradient_checkpointing:
        model.model.gradient_checkpointing_disable()
    return model


def main(argv=None) -> int:
    built = transformers_models(models)
    if built is None:
        return 2
    parser = model_parser(__doc__, built)
    parser.add_argument("--repeat", type=int, default=7, help="timed steps per program")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    names = chosen(parser, args.models, built)
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    for name in names:
        shown(rows, row(name, built[name], args.repeat))
    finished(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
