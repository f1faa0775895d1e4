"""Hugging Face models built from small configs with random weights (nothing is
downloaded): ``hf-gpt2``, ``hf-gpt2-labels``, ``hf-llama``. They need the
``transformers`` extra."""

from __future__ import annotations

import torch
from torch import nn

from remat.tools.models import build


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "the hf-gpt2 and hf-llama examples need Hugging Face transformers: install the "
            "'transformers' extra (pip install -e '.[transformers]' or pip install transformers)"
        ) from e
    return transformers


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM whose forward returns the loss of ``labels = input_ids``
    (HF shifts the labels by one token inside). ``blocks`` is the model's list of decoder
    layers (a property, so parameters and ``state_dict`` keys appear once)."""

    def __init__(self, lm: nn.Module, blocks_path: str, *, as_shipped: bool = False):
        super().__init__()
        # GPT2LMHeadModel has no loss type of its own: HF warns at the first call, and that
        # warning is a graph break before the loss. ``as_shipped`` keeps it, as a user's
        # model has it: two graphs in the step.
        if not as_shipped:
            lm.loss_type = "ForCausalLM"
        self.lm = lm
        self._blocks_path = blocks_path

    @property
    def blocks(self) -> nn.ModuleList:
        obj = self.lm
        for part in self._blocks_path.split("."):
            obj = getattr(obj, part)
        return obj

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def _hf_config(transformers, name: str, vocab: int, attn: str, **fields):
    config = getattr(transformers, name)(
        vocab_size=vocab, bos_token_id=0, eos_token_id=0, use_cache=False, **fields
    )
    config._attn_implementation = attn  # "sdpa" (HF's default) or "eager" (op by op)
    return config


def hf_gpt2(
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    seq: int = 64,
    batch: int = 2,
    vocab: int = 512,
    dropout: float = 0.1,
    attn: str = "sdpa",
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    graph_break: bool = False,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Hugging Face GPT-2 (``GPT2LMHeadModel``, tied lm_head) from a ``GPT2Config`` with
    random weights; input ``(input_ids[batch, seq] int64,)``. Needs ``transformers``.
    ``graph_break``: called with ``labels=`` as shipped, dynamo breaks the graph before the
    loss (``hf-gpt2-labels``)."""
    transformers = _transformers()

    def make(gen):
        config = _hf_config(
            transformers,
            "GPT2Config",
            vocab,
            attn,
            n_layer=layers,
            n_embd=d_model,
            n_head=heads,
            n_positions=seq,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
        lm = transformers.GPT2LMHeadModel(config)
        model = HFCausalLM(lm, "transformer.h", as_shipped=graph_break)
        return model, (torch.randint(0, vocab, (batch, seq), generator=gen),)

    return build(seed, device, make, dtype)


def hf_gpt2_labels(**sizes) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``hf_gpt2`` (same sizes) with its graph break: ``GPT2LMHeadModel`` called with
    ``labels=`` as shipped, so dynamo splits the step into the model's graph and the
    loss's. Needs ``transformers``."""
    return hf_gpt2(graph_break=True, **sizes)


def hf_llama(
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    ffn: int | None = None,
    seq: int = 64,
    batch: int = 2,
    vocab: int = 512,
    attn: str = "sdpa",
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Hugging Face Llama (``LlamaForCausalLM``: RMSNorm, rotary embeddings, SwiGLU MLP, no
    dropout) from a ``LlamaConfig`` with random weights; ``ffn`` defaults to about
    8/3 * d_model, ``kv_heads`` to ``heads``. Input ``(input_ids[batch, seq] int64,)``.
    Needs ``transformers``."""
    transformers = _transformers()

    def make(gen):
        config = _hf_config(
            transformers,
            "LlamaConfig",
            vocab,
            attn,
            hidden_size=d_model,
            intermediate_size=ffn or 8 * d_model // 3,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or heads,
            max_position_embeddings=seq,
        )
        model = HFCausalLM(transformers.LlamaForCausalLM(config), "model.layers")
        return model, (torch.randint(0, vocab, (batch, seq), generator=gen),)

    return build(seed, device, make, dtype)
