"""A Lightning ``Trainer.fit`` that plans remat's checkpointing for a memory budget on its first batch.

Run: python examples/lightning_fit.py   (CPU, a few seconds; needs: pip install 'remat[lightning]')

A small residual MLP is trained for a few steps with mixed precision (bfloat16
autocast) and gradient accumulation, twice from the same seed:

1. with ``remat.integrations.lightning.RematCallback(budget)``: on the first batch it
   profiles the module's repeated blocks by running its ``training_step`` with the
   trainer's optimizer, under the trainer's precision, picks keep / recompute /
   selective per block so the step fits the budget, and applies the plan; every
   batch's peak is then measured and printed beside the prediction and the budget
   (also logged: ``remat/peak_bytes``, ``remat/predicted_bytes``,
   ``remat/budget_bytes``);
2. without remat.

The losses of the two runs are equal bit for bit.
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import torch
from torch import nn

from remat.integrations.lightning import RematCallback

BUDGET = "50%"  # of what the unchecked step allocates above its static bytes; or bytes


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Regressor(L.LightningModule):
    def __init__(self, d: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)])
        self.head = nn.Linear(d, 1)
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.blocks(x)).float(), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: dict, batch: list, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(callbacks: list) -> list[float]:
    """Three optimizer steps of two micro-batches each, in bfloat16 autocast; every batch's loss."""
    torch.manual_seed(0)
    module = Regressor()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(192, 64, generator=g), torch.randn(192, 1, generator=g)
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))
    return module.losses


def main() -> None:
    torch.set_num_threads(1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")  # its tips about workers and loggers
    callback = RematCallback(BUDGET, timer="flops")
    losses = fit([callback])
    print(callback.plan)
    print("per batch: measured peak vs predicted vs budget")
    for check in callback.checks:
        print(f"  {check}")
    plain = fit([])
    print(f"losses with remat:    {losses}")
    print(f"losses without remat: {plain}")
    fits = all(not c.over_budget for c in callback.checks)
    print(f"budget held on every step: {fits}; losses equal without remat: {losses == plain}")


if __name__ == "__main__":
    main()
