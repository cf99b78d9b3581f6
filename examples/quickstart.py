"""Checkpoint a residual MLP by hand; measure activation memory with remat.memory.track.

Run: python examples/quickstart.py   (CPU, a few seconds)

Checkpointing trades time for memory: the blocks' forward runs again in backward.
How much time, for each strategy, is what ``remat bench`` measures.
"""

from __future__ import annotations

import torch
from torch import nn

import remat


class Block(nn.Module):
    """x + MLP(x): the residual add is inside the block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, d: int = 256, layers: int = 8, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = remat.checkpoint(block, x) if self.use_checkpoint else block(x)
        return x.square().mean()


def main() -> None:
    x = torch.randn(128, 256)
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        model = Net(use_checkpoint=use_checkpoint)
        model(x).backward()  # the first step allocates the gradients
        with remat.memory.track() as t:  # exact tensor bytes allocated inside
            model(x).backward()  # gradients exist: the peak is activations + temporaries
        name = "remat.checkpoint" if use_checkpoint else "no checkpointing"
        print(f"{name:>17}: activation peak of a training step {t.peak_bytes / 2**20:6.2f} MiB")


if __name__ == "__main__":
    main()
