"""Pipeline stages planned per stage against every layer checkpointed on every stage.

One process per stage (gloo on CPU, one thread each) trains a GPT split into stages under
``ScheduleGPipe`` and ``Schedule1F1B`` (``torch.distributed.pipelining``), three ways:

* ``none``: no checkpointing (listed where it fits the budget on every rank, and always
  measured);
* ``every_layer``: every block of every stage checkpointed (what frameworks do);
* ``remat``: each rank's stage planned by ``remat.plan_pipeline_stage`` for the budget.

The budget is one number of bytes for every rank: the largest over the ranks of the
``every_layer`` peak, plus ``--margin`` of the spread between it and the first stage's
unchecked peak, so that every layer everywhere is needed on the first stage only (it holds
the most microbatches). Each rank measures its peak with ``remat.memory`` over every step
(absolute: parameters, gradients, AdamW state, the schedule's buffers, the batch,
activations). A step's time is the largest over the ranks of each rank's median wall time
of the steps after the first (the spread: the smallest and largest of rank 0's); its CPU time
the sum over the ranks of each one's median process CPU time (the work, steadier on a
shared machine where the ranks share cores). Read ratios, not values.

Run: python benchmarks/pipeline.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.bench.models import ModelConfig
from remat.bench.pipeline import RankResult, run_rank

QUICK = dict(layers=8, d_model=64, seq=32, batch=8, heads=2, vocab=256, microbatches=4, rounds=2)
FULL = dict(layers=8, d_model=128, seq=64, batch=16, heads=4, vocab=256, microbatches=8, rounds=6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world: int, port: int, schedule: str, size: dict, margin: float, out: str
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(**{k: v for k, v in size.items() if k not in ("microbatches", "rounds")})
        common = dict(
            rank=rank,
            stages=world,
            schedule=schedule,
            microbatches=size["microbatches"],
            steps=size["rounds"] + 1,
        )
        results: dict[str, RankResult] = {}
        results["none"] = run_rank(cfg, strategy="none", **common)
        results["every_layer"] = run_rank(cfg, strategy="every_layer", **common)
        # one budget for every rank: the largest every-layer peak, plus a share of the
        # spread up to the first stage's unchecked peak
        peaks = torch.tensor(
            [results["every_layer"].peak_bytes, results["none"].peak_bytes if rank == 0 else 0]
        )
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        floor, top = int(peaks[0]), int(peaks[1])
        budget = floor + int(margin * max(0, top - floor))
        results["remat"] = run_rank(cfg, strategy="remat", budget=budget, **common)
        for r in results.values():
            r.budget_bytes = budget
            r.grads = {}
        torch.save({k: v.__dict__ for k, v in results.items()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(schedule: str, stages: int, size: dict, margin: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(
            _worker,
            args=(stages, _free_port(), schedule, size, margin, out),
            nprocs=stages,
            join=True,
        )
        per_rank = [
            torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(stages)
        ]
    runs = {}
    for strategy in ("none", "every_layer", "remat"):
        ranks = [pr[strategy] for pr in per_rank]
        medians = [statistics.median(r["step_times"]) for r in ranks]
        runs[f"{strategy}-{schedule}-{stages}"] = {
            "schedule": schedule,
            "stages": stages,
            "microbatches": size["microbatches"],
            "step_time_s": max(medians),
            "step_cpu_s": sum(statistics.median(r["step_cpu_times"]) for r in ranks),
            "step_time_spread_s": [min(ranks[0]["step_times"]), max(ranks[0]["step_times"])],
            "fits": all(r["peak_bytes"] <= r["budget_bytes"] for r in ranks),
            "ranks": [
                {
                    "rank": r["rank"],
                    "budget_bytes": r["budget_bytes"],
                    "peak_bytes": r["peak_bytes"],
                    "predicted_bytes": r["predicted_bytes"],
                    "decisions": r["decisions"],
                    "spans": r["spans"],
                }
                for r in ranks
            ],
        }
    return runs


def _table(runs: dict) -> str:
    lines = [
        f"{'run':<22} {'step s':>8} {'vs every':>9} {'CPU s':>7} {'vs every':>9} {'fits':>5}"
        "  peak per rank (MB; predicted)",
    ]
    for name, run in runs.items():
        ref = runs[f"every_layer-{run['schedule']}-{run['stages']}"]
        every, every_cpu = ref["step_time_s"], ref["step_cpu_s"]
        peaks = ", ".join(
            f"{r['peak_bytes'] / 1e6:.3f}"
            + (f" ({r['predicted_bytes'] / 1e6:.3f})" if r["predicted_bytes"] is not None else "")
            for r in run["ranks"]
        )
        lines.append(
            f"{name:<22} {run['step_time_s']:>8.3f} {run['step_time_s'] / every:>9.2f} "
            f"{run['step_cpu_s']:>7.3f} {run['step_cpu_s'] / every_cpu:>9.2f} "
            f"{'yes' if run['fits'] else 'no':>5}  {peaks}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small GPT, 3 rounds: under 2 minutes")
    ap.add_argument("--margin", type=float, default=0.1, help="share of the spread above the floor")
    ap.add_argument("--json", default=None, help="write the runs to this file")
    args = ap.parse_args()
    size = QUICK if args.quick else FULL
    combos = [("1f1b", 2), ("gpipe", 2), ("1f1b", 4)] + ([] if args.quick else [("gpipe", 4)])
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "remat": remat.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "size": size,
        "margin": args.margin,
    }
    print(json.dumps(env))
    start = time.perf_counter()
    runs: dict = {}
    for schedule, stages in combos:
        runs.update(_run(schedule, stages, size, args.margin))
    print(_table(runs))
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "runs": runs}, fh, indent=2)


if __name__ == "__main__":
    main()
