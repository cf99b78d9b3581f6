"""One plan for all ranks: per-rank step peak and step time with and without it, 2 ranks.

Two processes (gloo on CPU) train the built-in GPT under FSDP2 (every block and
the root sharded) and under DDP. For each wrapper: every rank measures its step
peak (``remat.measure_peak``: parameters, gradients, optimizer state and
activations of one rank) and its step time without checkpointing, then calls
``auto_checkpoint(budget=...)`` and measures both again. Step times are the
median over ``--rounds`` steps, wall time and the process's CPU time (steadier
on a shared machine); read their ratios, not their values. Rank 0 prints the
table and writes ``--json``.

Run: python benchmarks/distributed_plan.py [--layers 4 --d 128 --seq 128 --batch 4]
     [--budget 60%] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.bench.models import ModelConfig, build, example_input


def _steps(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, rounds: int):
    wall, cpu = [], []
    for _ in range(rounds + 1):  # the first step warms up
        w, c = time.perf_counter(), time.process_time()
        opt.zero_grad()
        model(x).backward()
        opt.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def _wrap(kind: str, cfg: ModelConfig) -> torch.nn.Module:
    model = build(cfg)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = ModelConfig(
        layers=args.layers, d_model=args.d, seq=args.seq, batch=args.batch, heads=4, vocab=512
    )
    rows = []
    try:
        x = example_input(cfg, seed=1 + rank)
        for kind in ("fsdp2", "ddp"):
            model = _wrap(kind, cfg)
            opt = torch.optim.AdamW(model.parameters())
            peak0 = remat.measure_peak(model, x, optimizer=opt)
            wall0, cpu0 = _steps(model, x, opt, args.rounds)
            plan = remat.auto_checkpoint(model, x, budget=args.budget, optimizer=opt, quiet=True)
            peak1 = remat.measure_peak(model, x, optimizer=opt)
            wall1, cpu1 = _steps(model, x, opt, args.rounds)
            rows.append(
                {
                    "wrapper": kind,
                    "rank": rank,
                    "decisions": plan.decisions,
                    "budget_bytes": plan.budget_bytes,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "peak_none": peak0,
                    "peak_plan": peak1,
                    "wall_none_s": wall0,
                    "wall_plan_s": wall1,
                    "cpu_none_s": cpu0,
                    "cpu_plan_s": cpu1,
                }
            )
        gathered: list[list[dict]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            _report([r for rs in gathered for r in rs], args)
    finally:
        dist.destroy_process_group()


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, 2 ranks (gloo), GPT layers={args.layers} d={args.d} "
        f"seq={args.seq} batch={args.batch} per rank, AdamW, budget {args.budget}"
    )
    print(
        "| wrapper | rank | plan | budget | peak none | peak plan | predicted | plan/none peak "
        "| plan/none wall | plan/none CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["wrapper"], r["rank"])):
        ds = ",".join(d[0] for d in r["decisions"].values())  # k/r/s per block
        mib = 2**20
        print(
            f"| {r['wrapper']} | {r['rank']} | {ds} | {r['budget_bytes'] / mib:.2f} MiB "
            f"| {r['peak_none'] / mib:.2f} MiB | {r['peak_plan'] / mib:.2f} MiB "
            f"| {r['predicted_peak_bytes'] / mib:.2f} MiB "
            f"| {r['peak_plan'] / r['peak_none']:.2f} | {r['wall_plan_s'] / r['wall_none_s']:.2f} "
            f"| {r['cpu_plan_s'] / r['cpu_none_s']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--budget", default="60%")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
