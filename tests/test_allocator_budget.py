"""Budgets hold on the allocator's count, for models unlike the built-in GPT.

An independent meter: ``torch.profiler``'s raw CPU allocator events (``referee``), which
count everything torch allocates, scratch inside operators included. For each model,
``auto_checkpoint`` with AdamW, then the first and a later training step under the meter:
the step's absolute peak (the bytes alive at its start plus the meter's peak) is within
the budget, and the gradients are bitwise those of the unchecked model (dropout on).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from referee import check_auto
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.bn(self.conv1(x))))


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(16) for _ in range(4))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


class Encoder(nn.Module):
    """torch's own transformer layers (self-attention called as attn(x, x, x)), tokens in."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 64)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True) for _ in range(4)
        )
        self.out = nn.Linear(64, 200)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(96)
        self.gate = nn.Linear(96, 256)
        self.up = nn.Linear(96, 256)
        self.down = nn.Linear(256, 96)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


def _targets(n: int) -> torch.Tensor:
    return torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(3))


def _cross_entropy(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), _targets(out.shape[0] * out.shape[1]))


def _resnet():
    return ResNetish(), torch.randn(4, 3, 16, 16), None


def _encoder():
    return (
        Encoder(),
        torch.randint(0, 200, (4, 32), generator=torch.Generator().manual_seed(1)),
        _cross_entropy,
    )


def _mlp():
    return nn.Sequential(*[GatedMLP() for _ in range(5)]), torch.randn(1024, 96), None


@pytest.mark.parametrize("make", [_resnet, _encoder, _mlp], ids=["resnet", "encoder", "gated-mlp"])
def test_budget_holds_for_the_allocators_peak_and_gradients_are_bitwise(make):
    torch.manual_seed(0)
    model, x, loss_fn = make()
    p = check_auto(model, x, **({} if loss_fn is None else {"loss_fn": loss_fn}))
    assert p.spans or set(p.decisions.values()) != {"keep"}
