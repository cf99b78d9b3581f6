"""Let the planner choose what to checkpoint for a memory budget, then verify the gradients.

Run: python examples/plan_and_verify.py   (CPU, a few seconds)

1. ``remat.auto_checkpoint`` profiles the model, picks keep / recompute / selective per
   block so that the step fits the budget, and applies the plan in place.
2. ``remat.measure_peak`` measures the step peak before and after, in the units of the
   budget and of the plan's prediction (parameters, inputs, gradients and activations).
3. ``remat.verify`` runs one step with the plan and one without, from the same RNG
   state, and reports any gradient, loss or buffer that is not bitwise equal.
"""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.planner.render import fmt_bytes


class Block(nn.Module):
    """Pre-norm residual MLP block with dropout (dropout is replayed exactly in recompute)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(self.norm(x)))


def loss_fn(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(128) for _ in range(6)])  # the blocks: its children
    x = torch.randn(256, 128)
    # the step peak a budget counts: parameters, inputs, gradients and activations together
    before = remat.measure_peak(model, x, loss_fn=loss_fn)
    plan = remat.auto_checkpoint(model, x, budget="70%", loss_fn=loss_fn)
    print(plan)
    after = remat.measure_peak(model, x, loss_fn=loss_fn)
    print(
        f"step peak: {fmt_bytes(before)} before, {fmt_bytes(after)} with the plan "
        f"(predicted {fmt_bytes(plan.predicted_peak_bytes)}, budget {fmt_bytes(plan.budget_bytes)})"
    )
    report = remat.verify(model, x, loss_fn=loss_fn)
    print(report)
    if not report.ok:
        raise SystemExit("gradients differ")


if __name__ == "__main__":
    main()
