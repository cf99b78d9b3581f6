"""Small models the tests share.

A GPT of hand-written blocks whose own loop passes a mask keyword, chains of BatchNorm and
MLP blocks (the span and split tests), the step-model tests' residual MLP, and two sizes
of the built-in benchmark GPT (:mod:`remat.bench.models`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench.models import ModelConfig
from remat.modules.spans import apply_span
from tests.support.steps import param_grads

TINY_GPT = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)  # dropout 0.1
"""The built-in GPT at three layers of width 32."""

SMALL_GPT = ModelConfig(layers=4, d_model=64, seq=32, batch=2, heads=2, vocab=128)
"""The built-in GPT at four layers of width 64."""


class Attention(nn.Module):
    """Masked multi-head self-attention written out (its working set is the score matrix)."""

    def __init__(self, d: int, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        if mask is not None:
            a = a.masked_fill(mask, float("-inf"))
        a = self.drop(a.softmax(-1))
        return self.proj((a @ v).transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, p: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Blocks called by the model's own loop, with a mask keyword: ``for l in layers: x = l(x, mask=mask)``."""

    def __init__(self, n: int = 6, d: int = 16, heads: int = 2, p: float = 0.1, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(GPTBlock(d, heads, p) for _ in range(n))
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return self.ln(x).square().mean()


class BNBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.bn = nn.BatchNorm1d(2 * d)
        self.out = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.bn(self.fc(x)))))


class BNChain(nn.Module):
    def __init__(self, n: int = 4, d: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(BNBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: saves x, fc1's output and gelu's output (1 + 4 + 4 units)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLPChain(nn.Module):
    def __init__(self, n: int = 8, d: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(MLPBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def gpt_step(model: nn.Module, seed: int = 0, batch: int = 2, t: int = 8, d: int = 16):
    """One forward and backward from a fixed RNG state: loss, gradients, RNG state after."""
    torch.manual_seed(seed)
    x = torch.randn(batch, t, d, requires_grad=True)
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return [loss.detach(), *param_grads(model, x)], torch.get_rng_state()


class ResMLP(nn.Module):
    """A pre-norm residual MLP block (three children with parameters: it can be split)."""

    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPNet(nn.Module):
    """A stem with BatchNorm (buffers, running statistics), residual blocks, dropout, a head."""

    def __init__(self, blocks: int = 3, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, d), nn.BatchNorm1d(d))
        self.blocks = nn.ModuleList([ResMLP(d, hidden) for _ in range(blocks)])
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.drop(x))


def spanned(model: nn.Module, groups: list[list[int]], inner: str = "recompute", **kw) -> nn.Module:
    policy = remat.policies.save_matmuls() if inner == "selective" else None
    for g in groups:
        apply_span(model, [f"layers.{i}" for i in g], inner=inner, policy=policy, **kw)
    return model
