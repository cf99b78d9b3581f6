"""Models for the tests of ``remat.explain`` and its diagnostics (and factories for the CLI).

Each factory returns ``(model, example_args)`` like a ``remat explain MODULE:FACTORY``
factory; the ones whose step a test compares with ``remat.memory.track`` say
which loss they use (:data:`LOSSES`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn

import remat
from remat.bench.models import ModelConfig, build, example_input


def gpt() -> tuple[nn.Module, tuple[Any, ...]]:
    """The built-in GPT at a test size (returns its loss), unwrapped."""
    cfg = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)
    return build(cfg), (example_input(cfg),)


def gpt_wrapped() -> tuple[nn.Module, tuple[Any, ...]]:
    """:func:`gpt` with its blocks checkpointed."""
    model, args = gpt()
    remat.apply_activation_checkpointing(model)
    return model, args


def llama() -> tuple[nn.Module, dict[str, Any]]:
    """A tiny Hugging Face Llama in training mode, and its keyword inputs (labels included)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


class ConvBlock(nn.Sequential):
    def __init__(self, c: int) -> None:
        super().__init__(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


def cnn() -> tuple[nn.Module, tuple[Any, ...]]:
    """A small CNN (conv stem, three conv-BN-ReLU blocks, pooled linear head)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.Sequential(*[ConvBlock(8) for _ in range(3)]),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    return model, (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


def cnn_wrapped() -> tuple[nn.Module, tuple[Any, ...]]:
    """:func:`cnn` with its conv blocks checkpointed."""
    model, args = cnn()
    remat.apply_activation_checkpointing(model)
    return model, args


#: The loss each model's step uses (a scalar from its output).
LOSSES = {
    "gpt": lambda out: out,
    "llama": lambda out: out.loss,
    "cnn": lambda out: out.square().mean(),
}


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))  # type: ignore[no-any-return]


class TinyLM(nn.Module):
    """Embedding, residual MLP blocks, a linear head over the vocabulary, cross-entropy."""

    def __init__(self, vocab: int, d: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def tiny_lm(vocab: int, d: int = 16, hidden: int = 64, layers: int = 2) -> tuple[nn.Module, Any]:
    """:class:`TinyLM` with its blocks checkpointed, and a batch of 4 sequences of 33 tokens."""
    torch.manual_seed(0)
    model = TinyLM(vocab, d, hidden, layers)
    remat.apply_activation_checkpointing(model)
    tokens = torch.randint(0, vocab, (4, 33), generator=torch.Generator().manual_seed(1))
    return model, tokens


class BigScratch(nn.Module):
    """Scales its input by a statistic whose computation allocates a ``k`` times larger
    temporary (not saved, not on the gradient path): forward frees it at once, a
    recompute in backward allocates it again, next to every parameter gradient."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (x.detach().unsqueeze(-1).expand(*x.shape, self.k) * 2.0).sum(-1)
        return (x * scale).sin()


def scratch_first(wrap_scratch: bool) -> tuple[nn.Module, Any]:
    """:class:`BigScratch` before four linear layers; checkpointed when ``wrap_scratch``."""
    torch.manual_seed(0)
    model = nn.Sequential(BigScratch(64), *[nn.Linear(64, 64) for _ in range(4)])
    if wrap_scratch:
        remat.checkpoint_wrapper(model[0])
    return model, torch.randn(8, 64, requires_grad=True, generator=torch.Generator().manual_seed(1))


class TorchCheckpointed(nn.Module):
    """A block whose own forward checkpoints its MLP with ``torch.utils.checkpoint``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = MLPBlock(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(self.mlp, x, use_reentrant=False)  # type: ignore[no-any-return]


class ReentrantOuter(nn.Module):
    """A block that runs its (remat-wrapped) MLP under torch's reentrant checkpoint."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = remat.checkpoint_wrapper(MLPBlock(d, 4 * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(self.mlp, x, use_reentrant=True)  # type: ignore[no-any-return]


def llama_ids() -> tuple[nn.Module, tuple[Any, ...]]:
    """:func:`llama` wrapped by remat, for the command line: token ids as the only input (the
    loss is then the sum of the logits)."""
    model, inputs = llama()
    remat.apply_activation_checkpointing(model)
    return model, (inputs["input_ids"],)


class KeywordLM(nn.Module):
    """A tiny language model whose ``forward`` takes keyword inputs only and returns its own
    loss, as a Hugging Face model does (``model(input_ids=ids, labels=ids)``)."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def keyword_lm() -> tuple[nn.Module, remat.Inputs]:
    """:class:`KeywordLM` and its keyword inputs as one :class:`remat.Inputs`."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(1))
    return KeywordLM(), remat.Inputs(input_ids=ids, labels=ids)


def keyword_lm_in_a_tuple() -> tuple[nn.Module, tuple[Any, ...]]:
    """A mistake: the :class:`remat.Inputs` of :func:`keyword_lm` inside a tuple."""
    model, inputs = keyword_lm()
    return model, (inputs,)
