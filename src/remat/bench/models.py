"""Built-in benchmark models: a GPT-style decoder and an MLP chain.

Both keep their repeated blocks in ``self.blocks`` (an ``nn.ModuleList``) and
call each one through ``self.run_block(i, block, x)``, which strategies replace
to checkpoint some blocks without touching the blocks themselves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BlockRunner = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]


def plain_runner(i: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run a block as is."""
    return block(x)  # type: ignore[no-any-return]


@dataclasses.dataclass
class ModelConfig:
    """Size of a benchmark model (``gpt`` or ``mlp``); the defaults are ``remat bench``'s."""

    model: str = "gpt"
    layers: int = 6
    d_model: int = 256
    seq: int = 128
    batch: int = 4
    heads: int = 4
    vocab: int = 512
    dropout: float = 0.1
    attn_dropout: float | None = None
    """Dropout on the attention weights (gpt); ``None``: ``dropout``. ``0.0`` keeps
    ``scaled_dot_product_attention`` on its fused path (no ``seq x seq`` matrices saved)."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model size with its number of timed rounds, and what it is for."""

    layers: int
    d_model: int
    seq: int
    batch: int
    heads: int
    vocab: int
    rounds: int
    about: str
    attn_dropout: float | None = None

    def config(self, model: str = "gpt") -> ModelConfig:
        """The :class:`ModelConfig` of this size for ``model``."""
        return ModelConfig(
            model=model,
            layers=self.layers,
            d_model=self.d_model,
            seq=self.seq,
            batch=self.batch,
            heads=self.heads,
            vocab=self.vocab,
            attn_dropout=self.attn_dropout,
        )


PRESETS = {
    "quick": Preset(4, 128, 64, 2, 4, 256, 5, "about 15 s"),
    "default": Preset(6, 256, 128, 4, 4, 512, 6, "about a minute"),
    "large": Preset(6, 384, 256, 4, 6, 512, 9, "about 5 minutes"),
    "deep": Preset(16, 128, 1024, 2, 4, 256, 3, "about 3 minutes", 0.0),
}
"""``remat bench``'s sizes (``--quick``, the default, ``--large``). Times are wall time on
the project's 2-core CPU machine when it is quiet (docs/BENCHMARKS.md)."""


class Attention(nn.Module):
    """Causal multi-head self-attention on ``scaled_dot_product_attention``."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(a.transpose(1, 2).reshape(b, s, d))  # type: ignore[no-any-return]


class GPTBlock(nn.Module):
    """Pre-LN transformer block: attention and a 4x GELU MLP, each with dropout."""

    def __init__(self, d: int, heads: int, dropout: float, attn_dropout: float | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout if attn_dropout is None else attn_dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A small GPT-style decoder for benchmarks; ``forward(tokens)`` returns the LM loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(
                f"GPT: d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})."
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(
            GPTBlock(cfg.d_model, cfg.heads, cfg.dropout, cfg.attn_dropout)
            for _ in range(cfg.layers)
        )
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.run_block: BlockRunner = plain_runner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
        for i, block in enumerate(self.blocks):
            x = self.run_block(i, block, x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class GPTStage(nn.Module):
    """One stage of a :class:`GPT` split for pipeline parallelism: the first stage embeds the
    tokens, the last returns the logits (the loss is the schedule's, :func:`lm_loss`); each
    runs its share of the blocks. The modules are the GPT's own (shared, not copied)."""

    def __init__(self, gpt: GPT, stage: int, stages: int) -> None:
        super().__init__()
        n = len(gpt.blocks)
        if not 0 <= stage < stages <= n:
            raise ValueError(
                f"GPTStage: stage {stage} of {stages} for {n} blocks; need 0 <= stage < "
                f"stages <= blocks."
            )
        lo, hi = stage * n // stages, (stage + 1) * n // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed = gpt.embed if self.first else None
        self.pos = gpt.pos if self.first else None
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.ln = gpt.ln if self.last else None
        self.head = gpt.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None and self.pos is not None:
            x = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.ln is not None and self.head is not None:
            x = self.head(self.ln(x))
        return x


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The language-model loss of :class:`GPT` on logits and next tokens (a pipeline
    schedule's ``loss_fn``).

    Example:
        >>> from remat.bench.models import ModelConfig, GPTStage, build, example_input, lm_loss
        >>> cfg = ModelConfig(layers=2, d_model=32, seq=16, batch=2, heads=2, vocab=64, dropout=0.0)
        >>> gpt, tokens = build(cfg), example_input(cfg)
        >>> stages = [GPTStage(gpt, s, 2) for s in range(2)]
        >>> x = tokens[:, :-1]
        >>> for st in stages:
        ...     x = st(x)
        >>> torch.equal(lm_loss(x, tokens[:, 1:]), gpt(tokens))
        True
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class MLPBlock(nn.Module):
    """Residual MLP block: LayerNorm, Linear 4x, GELU, Linear, dropout."""

    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.fc(self.ln(x)))))  # type: ignore[no-any-return]


class MLPChain(nn.Module):
    """A chain of residual MLP blocks; ``forward(x)`` returns a regression loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(MLPBlock(cfg.d_model, cfg.dropout) for _ in range(cfg.layers))
        self.run_block: BlockRunner = plain_runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, block in enumerate(self.blocks):
            h = self.run_block(i, block, h)
        return h.square().mean()


MODELS = ("gpt", "mlp")


def build(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> nn.Module:
    """A benchmark model with weights fixed by ``seed``.

    Example:
        >>> from remat.bench.models import ModelConfig, build, example_input
        >>> cfg = ModelConfig(layers=2, d_model=32, seq=16, batch=2, heads=2, vocab=64)
        >>> model = build(cfg)
        >>> model(example_input(cfg)).shape
        torch.Size([])
    """
    if cfg.model not in MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODELS)}.")
    torch.manual_seed(seed)
    model: nn.Module = GPT(cfg) if cfg.model == "gpt" else MLPChain(cfg)
    return model.to(device)


def example_input(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 1) -> Any:
    """The fixed input batch of a benchmark model."""
    g = torch.Generator().manual_seed(seed)
    if cfg.model == "gpt":
        return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
    return torch.randn(cfg.batch * cfg.seq, cfg.d_model, generator=g).to(device)


def param_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def estimate_step_bytes(cfg: ModelConfig) -> int:
    """A rough upper estimate of one unchecked training step's memory (for a clear error)."""
    d, s, b, L = cfg.d_model, cfg.seq, cfg.batch, cfg.layers
    params = (12 * d * d + 13 * d) * L + 2 * cfg.vocab * d + s * d
    per_layer = b * s * (34 * d + 5 * cfg.heads * s)  # activations of one block, 4-byte floats
    logits = 3 * b * s * cfg.vocab
    return 4 * (3 * params + L * per_layer + logits) + 8 * math.prod((b, s))
