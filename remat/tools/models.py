"""The built-in models written here: ``mlp``, ``cnn``, ``gpt``, ``unet`` (what each
exercises: ``remat.tools.examples``), and ``build``, which makes every factory's weights
and inputs a function of its seed alone."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FLOATING_DTYPES", "build", "cnn", "floating_dtype", "gpt", "mlp", "unet"]


def build(
    seed: int,
    device: str | torch.device,
    make: Callable[[torch.Generator], tuple],
    dtype: str | torch.dtype = torch.float32,
):
    """Run ``make`` under a private RNG so weights and inputs depend only on ``seed``, then
    move them to ``device`` and cast the floating ones to ``dtype`` (a ``torch.dtype`` or
    its name, ``"bfloat16"``).

    Module initialisers draw from the global RNG, so it is forked (CPU only; CUDA state is
    not touched) and restored afterwards: building an example never perturbs the caller.
    """
    dtype = floating_dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        model, inputs = make(gen)
    model = model.to(device=device, dtype=dtype).train()  # floating tensors only
    inputs = tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in inputs)
    return model, inputs


FLOATING_DTYPES = ("float32", "bfloat16", "float16", "float64")


def floating_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as a ``torch.dtype``: one already, or a floating one's name (``"bfloat16"``,
    ``"torch.bfloat16"``). ``ValueError`` naming the accepted names for anything else."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        dtype = getattr(torch, name, None) if name in FLOATING_DTYPES else name
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        names = ", ".join(FLOATING_DTYPES)
        raise ValueError(f"dtype must be one of {names}; got {dtype!r}")
    return dtype


# ----------------------------------------------------------------------------- mlp


class MLP(nn.Module):
    """Linear + activation blocks of one width, then a linear classifier."""

    def __init__(self, layers: int, width: int, classes: int, activation: str):
        super().__init__()
        acts = {"gelu": nn.GELU, "relu": nn.ReLU}
        if activation not in acts:
            raise ValueError(f"activation must be one of {sorted(acts)}, got {activation!r}")
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), acts[activation]()) for _ in range(layers))
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), y)


def mlp(
    layers: int = 16,
    width: int = 256,
    batch: int = 1024,
    classes: int = 10,
    activation: str = "gelu",
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Deep MLP classifier; inputs ``(x[batch, width] float32, y[batch] int64)``."""

    def make(gen):
        model = MLP(layers, width, classes, activation)
        x = torch.randn(batch, width, generator=gen)
        y = torch.randint(0, classes, (batch,), generator=gen)
        return model, (x, y)

    return build(seed, device, make, dtype)


# ----------------------------------------------------------------------------- cnn


class ResBlock(nn.Module):
    """ResNet basic block: two Conv-BN(-ReLU), identity or 1x1-conv projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, stages of residual blocks (stride 2 between stages), pool, dropout, linear."""

    def __init__(
        self, channels: int, width: int, stages: int, blocks_per_stage: int, classes: int, dropout
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks, cin = [], width
        for s in range(stages):
            cout = width * 2**s
            for b in range(blocks_per_stage):
                blocks.append(ResBlock(cin, cout, 2 if (s > 0 and b == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = self.dropout(x.mean(dim=(2, 3)))
        return F.cross_entropy(self.head(x), y)


def cnn(
    batch: int = 16,
    image: int = 32,
    channels: int = 3,
    width: int = 16,
    stages: int = 3,
    blocks_per_stage: int = 2,
    classes: int = 10,
    dropout: float = 0.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Small ResNet classifier; inputs ``(x[batch, channels, image, image], y[batch] int64)``."""

    def make(gen):
        model = ResNet(channels, width, stages, blocks_per_stage, classes, dropout)
        x = torch.randn(batch, channels, image, image, generator=gen)
        y = torch.randint(0, classes, (batch,), generator=gen)
        return model, (x, y)

    return build(seed, device, make, dtype)


# ----------------------------------------------------------------------------- gpt


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out op by op (no fused SDPA kernel), so the
    score matrix, mask, softmax and attention dropout are separate nodes the solver sees."""

    def __init__(self, d_model: int, heads: int, seq: int, dropout: float):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned positional embedding, decoder blocks, final LayerNorm, tied lm_head."""

    def __init__(self, layers: int, d_model: int, heads: int, seq: int, vocab: int, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, heads, seq, dropout) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init)
        # Tie after init: one Parameter, two uses (the case that breaks aot_module).
        self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init(m: nn.Module) -> None:
        # GPT-2 initialisation, so the loss starts near log(vocab).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def gpt(
    layers: int = 4,
    d_model: int = 128,
    heads: int = 4,
    seq: int = 128,
    batch: int = 4,
    vocab: int = 512,
    dropout: float = 0.1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """GPT-style language model; inputs ``(idx[batch, seq], targets[batch, seq])`` int64,
    where ``targets`` is ``idx`` shifted by one token (next-token prediction)."""

    def make(gen):
        model = GPT(layers, d_model, heads, seq, vocab, dropout)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    return build(seed, device, make, dtype)


# ----------------------------------------------------------------------------- unet


class ConvBlock(nn.Module):
    """Two Conv-GroupNorm-SiLU layers at one resolution."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        groups = math.gcd(8, cout)
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.GroupNorm(groups, cout),
            nn.SiLU(),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.GroupNorm(groups, cout),
            nn.SiLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """Encoder (ConvBlock, max-pool) x levels, bottleneck, decoder (transposed-conv upsample,
    concatenate the encoder output of the same resolution, ConvBlock) x levels, 1x1 conv.

    ``blocks`` holds the ConvBlocks in execution order: ``levels`` encoder blocks, the
    bottleneck, then ``levels`` decoder blocks (whose input is the concatenation).
    """

    def __init__(self, channels: int, base: int, levels: int):
        super().__init__()
        if levels < 1:
            raise ValueError(f"levels must be >= 1, got {levels}")
        self.levels = levels
        widths = [base * 2**i for i in range(levels + 1)]
        enc = [ConvBlock(channels if i == 0 else widths[i - 1], widths[i]) for i in range(levels)]
        mid = [ConvBlock(widths[levels - 1], widths[levels])]
        dec = [ConvBlock(2 * widths[i], widths[i]) for i in reversed(range(levels))]
        self.blocks = nn.ModuleList(enc + mid + dec)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
            for i in reversed(range(levels))
        )
        self.out = nn.Conv2d(widths[0], channels, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n = self.levels
        skips = []
        for i in range(n):
            x = self.blocks[i](x)
            skips.append(x)
            x = self.pool(x)
        x = self.blocks[n](x)
        for j in range(n):
            x = self.up[j](x)
            x = self.blocks[n + 1 + j](torch.cat([x, skips.pop()], dim=1))
        return F.mse_loss(self.out(x), target)


def unet(
    batch: int = 4,
    image: int = 32,
    channels: int = 3,
    base: int = 16,
    levels: int = 3,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Small U-Net regressing an image; inputs ``(x, target)``, both
    ``[batch, channels, image, image]`` float32. ``image`` must be divisible by 2**levels."""
    if image % 2**levels:
        raise ValueError(f"image={image} must be divisible by 2**levels={2**levels}")

    def make(gen):
        model = UNet(channels, base, levels)
        x = torch.randn(batch, channels, image, image, generator=gen)
        target = torch.randn(batch, channels, image, image, generator=gen)
        return model, (x, target)

    return build(seed, device, make, dtype)
