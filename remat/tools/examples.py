"""Built-in example models: small, real architectures for tests, the CLI and benchmarks.

Each factory returns ``(model, example_inputs)``: ``example_inputs`` is a tuple and the
model's forward computes its own loss (like an HF model given labels), so one training step
is always ``loss = model(*example_inputs); loss.backward()``, whatever the architecture.
The loss is a scalar (float32 at the default dtype). Models come back in training mode
(dropout active, BatchNorm updating its running statistics), because that is the step
remat rewrites.

- ``mlp``: a deep chain of Linear + GELU/ReLU with a cross-entropy head. The textbook chain
  (REVOLVE, the sqrt(n) rule), where every activation has the same size.
- ``cnn``: a small ResNet: Conv-BatchNorm-ReLU residual blocks, dropout, classification head.
  Buffer mutation (running stats) and random ops that must never be recomputed.
- ``gpt``: a GPT-style decoder with explicit causal attention (matmul, mask, softmax,
  dropout), pre-LayerNorm, GELU MLP and an lm_head weight-tied to the token embedding.
  Large attention temporaries, views, and a tied weight.
- ``unet``: a small U-Net with long skip connections by concatenation. A DAG, not a chain:
  early activations stay alive until the matching decoder level.
- ``hf-gpt2``, ``hf-llama``: Hugging Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` built
  from small configs with random weights (nothing is downloaded), so benchmarks also run on
  code nobody here wrote. They need the ``transformers`` extra (``pip install -e
  '.[transformers]'``). Their ``blocks`` are the HF decoder layers, which take extra keyword
  arguments (masks, position embeddings) besides the hidden states. ``hf-gpt2-labels`` is
  ``hf-gpt2`` as shipped: dynamo breaks its graph before the loss, so a step runs two graphs.

Every factory takes its sizes as keyword arguments with small defaults (one eager forward and
backward well under a second on two CPU cores), ``seed`` (weights and inputs are a function of
it; the caller's global RNG is left untouched), ``device`` and ``dtype`` (``"bfloat16"``:
floating weights and inputs cast to it; ``--size dtype=bfloat16`` on the command line).
Weights and inputs are built on the CPU and then moved, so a seed gives the same numbers on
every device.

Repeated blocks: each model exposes ``model.blocks`` (an ``nn.ModuleList`` or
``nn.Sequential``). The forward looks each block up in ``model.blocks`` at call time, calls it
once with a single tensor and uses its single tensor result, so a benchmark may replace
``model.blocks[i]`` with a wrapper (e.g. one running ``torch.utils.checkpoint``) and the
model still computes the same loss.

``load(spec)`` accepts a built-in name (see ``EXAMPLES``) or ``package.module:factory``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from remat.tools.hf_models import hf_gpt2, hf_gpt2_labels, hf_llama
from remat.tools.models import cnn, gpt, mlp, unet

__all__ = ["EXAMPLES", "cnn", "gpt", "hf_gpt2", "hf_gpt2_labels", "hf_llama", "load", "mlp", "unet"]

EXAMPLES: dict[str, Callable[..., tuple[nn.Module, tuple]]] = {
    "mlp": mlp,
    "cnn": cnn,
    "gpt": gpt,
    "unet": unet,
    "hf-gpt2": hf_gpt2,
    "hf-gpt2-labels": hf_gpt2_labels,
    "hf-llama": hf_llama,
}


def _spec_help() -> str:
    return (
        f"expected a built-in example ({', '.join(sorted(EXAMPLES))}) "
        "or 'package.module:factory' naming a function that returns (model, example_inputs)"
    )


def load(spec: str, **kwargs) -> tuple[nn.Module, tuple]:
    """Build a model from a built-in name or a ``package.module:factory`` spec.

    ``kwargs`` go to the factory. Raises ``ValueError`` for an unknown name or a spec that does
    not resolve to a callable, ``TypeError`` if the factory does not return
    ``(nn.Module, tuple)``.
    """
    if not isinstance(spec, str):
        raise ValueError(f"model spec must be a string, got {type(spec).__name__}; {_spec_help()}")
    if spec in EXAMPLES:
        factory = EXAMPLES[spec]
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"bad model spec {spec!r}; {_spec_help()}")
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"cannot import module {module_name!r} from spec {spec!r} ({e}); {_spec_help()}"
            ) from e
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(
                    f"module {module_name!r} has no attribute {attr!r} (spec {spec!r}); "
                    f"{_spec_help()}"
                )
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(f"{spec!r} is not callable; {_spec_help()}")
        factory = obj
    else:
        raise ValueError(f"unknown model {spec!r}; {_spec_help()}")

    out = factory(**kwargs)
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], nn.Module)
        and isinstance(out[1], tuple)
    ):
        raise TypeError(
            f"factory {spec!r} must return (nn.Module, tuple_of_inputs), got {_describe(out)}"
        )
    return out


def _describe(out: object) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(type(o).__name__ for o in out) + ")"
    return type(out).__name__
