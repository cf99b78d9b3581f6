"""The model families the planner is checked on end to end (``tests/planner/test_*_models.py``).

A GRU language model, a VGG and a U-Net, blocks that return views, a ViT, a rotary LM with a
mask and tables passed as keywords, an LSTM stack, a temporal convolution net, a mixture of
experts, a tied embedding and head, a MobileNet with squeeze-and-excitation, models that pass
or return dicts, tuples and lists, autocast inside forward, two towers, blocks that call
torch's checkpoint themselves, SDPA with dropout; and the inputs and losses they take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn


def tokens(vocab: int = 64, shape: tuple[int, int] = (4, 16)) -> torch.Tensor:
    """Seeded token ids below ``vocab``."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def token_loss(out: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (batch, time, vocab) logits against fixed targets."""
    n = out.shape[0] * out.shape[1]
    return F.cross_entropy(out.flatten(0, 1).float(), torch.arange(n) * 7 % out.shape[-1])


def class_loss(out: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (batch, classes) logits against fixed targets."""
    return F.cross_entropy(out.float(), torch.arange(out.shape[0]) % out.shape[-1])


class RNNBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.norm(x))
        return x + self.drop(y)


class GRUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(RNNBlock() for _ in range(4))
        self.head = nn.Linear(32, 100)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def relu_inplace_mlp() -> nn.Module:
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 64))
            for _ in range(4)
        ]
    )


def vgg() -> nn.Module:
    """torchvision's VGG layout: every layer a block, nn.ReLU(inplace=True) among them."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32),
        nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(inplace=True), nn.Dropout(0.3), nn.Linear(64, 10),
    )  # fmt: skip


class UNet(nn.Module):
    """Skip connections across blocks (not a chain): encoder outputs reused by the decoder."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()

        def conv(i: int, o: int, stride: int = 1) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1), nn.GroupNorm(2, o), nn.SiLU())

        self.blocks = nn.ModuleList(
            [
                conv(3, c),
                conv(c, 2 * c, 2),
                conv(2 * c, 4 * c, 2),
                conv(4 * c, 2 * c),
                conv(4 * c, c),
                nn.Conv2d(2 * c, 3, 3, padding=1),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        e1 = b[0](x)
        e2 = b[1](e1)
        d2 = b[3](F.interpolate(b[2](e2), scale_factor=2))
        d1 = b[4](F.interpolate(torch.cat([d2, e2], 1), scale_factor=2))
        return b[5](torch.cat([d1, e1], 1))


class ViewBlocks(nn.Module):
    """Blocks that return views of what the block before returned (Unflatten, Flatten)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Linear(64, 128), nn.Unflatten(1, (2, 64)), nn.Flatten()]
            + [nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 64)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


# --- a ViT: Conv2d patches, a cls token parameter, position embeddings, encoder layers


class ViT(nn.Module):
    def __init__(self, d: int = 32, depth: int = 4, patch: int = 4, img: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        n = (img // patch) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


# --- blocks taking several tensors: a mask positionally, rotary tables as keywords


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class RotaryBlock(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.h, d // self.h).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.h)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class RotaryLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(RotaryBlock(d, heads) for _ in range(depth))
        self.head = nn.Linear(d, vocab)
        self.hd = d // heads

    def forward(self, idx: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        freq = 1.0 / 10000 ** (torch.arange(0, self.hd // 2) / (self.hd // 2))
        ang = torch.arange(t)[:, None] * freq[None]
        cos, sin = ang.cos(), ang.sin()
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal[None, None] & pad[:, None, None, :]
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, mask, cos=cos, sin=sin)
        return self.head(x)


# --- an LSTM stack and a Conv1d temporal net


class LSTMBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, (_, _) = self.rnn(x)
        return self.norm(x + y)


class LSTMStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(LSTMBlock() for _ in range(4))
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class TemporalBlock(nn.Module):
    """A dilated causal Conv1d residual block (TCN)."""

    def __init__(self, c: int, dilation: int) -> None:
        super().__init__()
        self.pad = 2 * dilation
        self.conv1 = nn.Conv1d(c, c, 3, dilation=dilation)
        self.conv2 = nn.Conv1d(c, c, 3, dilation=dilation)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(F.relu(self.conv1(F.pad(x, (self.pad, 0)))))
        y = self.conv2(F.pad(y, (self.pad, 0)))
        return F.relu(x + y)


def tcn() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(8, 32, 1), *[TemporalBlock(32, 2**i) for i in range(4)], nn.Conv1d(32, 4, 1)
    )


# --- a mixture of experts with top-1 routing (index_select / index_add)


class MoEBlock(nn.Module):
    def __init__(self, d: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = self.norm(x).flatten(0, -2)
        gate = self.router(h).softmax(-1)
        weight, choice = gate.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            y = expert(h.index_select(0, idx)) * weight.index_select(0, idx)[:, None]
            out = out.index_add(0, idx, y.to(out.dtype))  # bfloat16 experts under autocast
        return x + out.view(shape)


class TokenLM(nn.Module):
    """Embedding, four blocks made by ``block``, a head."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# --- weight tying: the output head shares the embedding's weight


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                for _ in range(4)
            ]
        )
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(idx)))


# --- BatchNorm in train mode, channels_last inputs, squeeze-and-excitation, depthwise convs


class SEBlock(nn.Module):
    """An inverted residual (MobileNetV2 / EfficientNet): expand, depthwise, SE gate, project."""

    def __init__(self, c: int = 16, expand: int = 2) -> None:
        super().__init__()
        h = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.SiLU())
        self.dw = nn.Sequential(
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.SiLU()
        )
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(h, h // 4, 1),
            nn.SiLU(),
            nn.Conv2d(h // 4, h, 1),
            nn.Sigmoid(),
        )
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(self.expand(x))
        return x + self.project(y * self.se(y))


class MobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.blocks = nn.ModuleList(SEBlock() for _ in range(6))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


# --- a model returning a dict (and a tuple)


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(4)
        )
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        feats = []
        for b in self.blocks:
            x = x + b(x)
            feats.append(x)
        logits = self.head(x)
        return {"logits": logits, "aux": (x.detach(), logits.argmax(-1)), "n": len(feats)}


def dict_loss(out: dict[str, Any]) -> torch.Tensor:
    """Cross entropy of :class:`DictOut`'s logits against fixed targets."""
    logits = out["logits"].float()
    return F.cross_entropy(logits, torch.arange(logits.shape[0]) % 8)


class TupleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)
        self.gate = nn.Linear(32, 32)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = xs
        h = torch.tanh(self.down(F.gelu(self.up(x))) + h)
        return x + torch.sigmoid(self.gate(h)) * h, h


# --- autocast inside the model's forward


class AutocastMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32)
            )
            for _ in range(6)
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for b in self.blocks:
                x = x + b(x)
            return self.head(x)


# --- blocks in an nn.Sequential inside an nn.ModuleDict; blocks picked with check_fn=


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()

        def mlp() -> nn.Module:
            return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

        self.towers = nn.ModuleDict(
            {
                "text": nn.Sequential(*[mlp() for _ in range(5)]),
                "image": nn.Sequential(*[mlp() for _ in range(3)]),
            }
        )

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (self.towers["text"](a) * self.towers["image"](b)).sum(-1)


# --- a block that checkpoints part of itself; attention with dropout_p > 0


class NestedCkptBlock(nn.Module):
    def __init__(self, d: int = 32, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.norm = nn.LayerNorm(d)
        self.pre = nn.Linear(d, 2 * d)
        self.mlp = nn.Sequential(
            nn.Linear(2 * d, 2 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.pre(self.norm(x)))  # outside the inner checkpoint: saved
        return x + tuc.checkpoint(self.mlp, h, use_reentrant=self.reentrant)


class SDPABlock(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.2 if self.training else 0.0, is_causal=True
        )
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class ListBlock(nn.Module):
    """Passes its state on as a list ``[x, h]`` (a list, unlike the tuple blocks above)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 64)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        x, h = xs
        h2 = self.b(torch.relu(self.a(x))) + h
        return [x + h2, h2]


class ListChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ListBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = [x, torch.zeros_like(x)]
        for layer in self.layers:
            xs = layer(xs)
        return xs[0].sum() + xs[1].sum()


# --- a residual tanh block (the offload plans' chains)


class TanhBlock(torch.nn.Module):
    """Ends with tanh, which saves its output: kept, it holds the next block's input."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


# --- two stacks whose first block makes a bias the others receive and hand on (T5's shape)


class BiasBlock(nn.Module):
    """``h + down(tanh(up(norm(h)) + bias))``, returning ``(h, bias)``: the stack's first
    block makes ``bias`` from a table, the others receive it and return it again. The add
    saves neither operand, so with every block kept the bias dies in forward."""

    def __init__(self, d: int, seq: int, first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.table = nn.Embedding(seq, 4 * d) if first else None

    def forward(
        self, h: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            bias = self.table(torch.arange(h.shape[1], device=h.device)).unsqueeze(0)
        assert bias is not None
        return h + self.down(torch.tanh(self.up(self.norm(h)) + bias)), bias


class BiasStack(nn.Module):
    def __init__(self, depth: int, d: int, seq: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(BiasBlock(d, seq, i == 0) for i in range(depth))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        bias = None
        for b in self.block:
            h, bias = b(h, bias)
        return h  # the bias dies here (the encoder's: before the decoder runs)


class EncoderDecoder(nn.Module):
    """An encoder stack and a decoder stack (``encoder.block.*``, ``decoder.block.*``), each
    with a bias its first block makes: the encoder's dies when the encoder returns, the
    decoder's when the forward returns."""

    def __init__(self, depth: int = 3, d: int = 32, seq: int = 64) -> None:
        super().__init__()
        self.encoder = BiasStack(depth, d, seq)
        self.decoder = BiasStack(depth, d, seq)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.encoder(x))).square().mean()
