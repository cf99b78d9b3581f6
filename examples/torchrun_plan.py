"""One checkpointing plan for every rank of an FSDP2 job, on CPU with gloo.

    torchrun --nproc-per-node 2 examples/torchrun_plan.py

Run with plain ``python`` it starts the two processes itself. Every rank
shards the model first (``fully_shard``), then calls ``auto_checkpoint``: the
ranks profile in lockstep, agree on one profile (each number the largest over
the ranks), apply the same plan, and check that every rank's step peak is
within the budget (one rank's peak, in bytes).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import remat
from remat.bench.models import ModelConfig, build, example_input

CFG = ModelConfig(layers=4, d_model=64, seq=32, batch=2, heads=2, vocab=128)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        model = build(CFG)  # same weights on every rank
        for block in model.blocks:  # shard first: planning sees each rank's real bytes
            fully_shard(block)
        fully_shard(model)
        x = example_input(CFG, seed=1 + rank)  # each rank its own batch, same shapes
        opt = torch.optim.AdamW(model.parameters())
        plan = remat.auto_checkpoint(model, x, budget="75%", optimizer=opt, quiet=True)
        peak = remat.measure_peak(model, x, optimizer=opt)
        if rank == 0:
            print(plan)
        dist.barrier()
        print(f"rank {rank}: step peak {peak} B, budget {plan.budget_bytes} B", flush=True)
        for _ in range(2):  # the training loop, unchanged
            opt.zero_grad()
            model(x).backward()
            opt.step()
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    main()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        main()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(2, free), nprocs=2, join=True)
