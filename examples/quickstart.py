"""Train a small MLP chain with and without checkpointing; print kept activation bytes and step time.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

import remat


def saved_bytes(step) -> int:
    """Bytes of tensors autograd keeps for backward during ``step`` (outside checkpointed regions)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def main() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(8)
    )
    x = torch.randn(64, 512)

    def step(use_checkpoint: bool) -> torch.Tensor:
        h = x
        for b in blocks:
            h = h + (remat.checkpoint(b, h) if use_checkpoint else b(h))
        return h.square().mean()

    for name, flag in (("no checkpointing", False), ("remat.checkpoint", True)):
        nbytes = saved_bytes(lambda f=flag: step(f))
        t0 = time.perf_counter()
        for _ in range(5):
            step(flag).backward()
        dt = (time.perf_counter() - t0) / 5
        print(f"{name:>18}: activations kept {nbytes / 2**20:7.2f} MiB, step {dt * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
