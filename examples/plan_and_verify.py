"""Let the planner choose what to checkpoint for a memory budget, then verify the gradients.

Run: python examples/plan_and_verify.py   (CPU, a few seconds)

1. ``remat.auto_checkpoint`` profiles the model, picks keep / recompute / selective per
   block so that the step fits the budget, and applies the plan in place.
2. ``remat.memory.track`` measures the peak of a step before and after.
3. ``remat.verify`` runs one step with the plan and one without, from the same RNG
   state, and reports any gradient, loss or buffer that is not bitwise equal.
"""

from __future__ import annotations

import torch
from torch import nn

import remat


class Block(nn.Module):
    """Pre-norm residual MLP block with dropout (dropout is replayed exactly in recompute)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(self.norm(x)))


def peak_of_step(model: nn.Module, x: torch.Tensor) -> int:
    with remat.memory.track() as t:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return t.peak_bytes


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(128) for _ in range(6)])  # the blocks: its children
    x = torch.randn(256, 128)
    before = peak_of_step(model, x)
    plan = remat.auto_checkpoint(model, x, budget="70%", loss_fn=lambda y: y.square().mean())
    print(plan)
    after = peak_of_step(model, x)
    print(f"peak of a step: {before / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB with the plan")
    report = remat.verify(model, x, loss_fn=lambda y: y.square().mean())
    print(report)
    if not report.ok:
        raise SystemExit("gradients differ")


if __name__ == "__main__":
    main()
