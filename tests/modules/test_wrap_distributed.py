"""checkpoint_wrapper under DDP (three modes) and FSDP2, 2 processes, gloo on CPU.

One spawn runs every configuration; each rank trains on its half of the batch and
rank 0 compares every gradient with a single-process run on the whole batch.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import remat

pytestmark = pytest.mark.slow

D = 16


class GeluBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(GeluBlock() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)


def reference_grads():
    model = Net()
    x, y = batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        x, y = batch()
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        from torch.nn.parallel import DistributedDataParallel as DDP

        for name, kwargs in (
            ("ddp", {}),
            ("ddp-find-unused", {"find_unused_parameters": True}),
            ("ddp-static-graph", {"static_graph": True}),
        ):
            for reentrant in (False, True):
                model = Net()
                remat.apply_activation_checkpointing(model, use_reentrant=reentrant)
                ddp = DDP(model, **kwargs)
                for _ in range(2 if kwargs.get("static_graph") else 1):  # static graph: 2 steps
                    ddp.zero_grad()
                    torch.nn.functional.mse_loss(ddp(xs), ys).backward()
                results[f"{name}-reentrant={reentrant}"] = {
                    n: p.grad.clone() for n, p in model.named_parameters()
                }
        from torch.distributed.fsdp import fully_shard

        model = Net()
        remat.apply_activation_checkpointing(model)
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        results["fsdp2"] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(results, out)
    except Exception:
        if rank == 0:
            torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        dist.destroy_process_group()


def test_wrapper_under_ddp_and_fsdp2_matches_single_process(tmp_path):
    out = str(tmp_path / "grads.pt")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    results = torch.load(out)
    assert "error" not in results, results.get("error")
    ref = reference_grads()
    assert len(results) == 7
    for config, grads in results.items():
        assert grads.keys() == ref.keys(), config
        for n, g in grads.items():
            assert torch.allclose(g, ref[n], rtol=1e-5, atol=1e-6), (config, n)
