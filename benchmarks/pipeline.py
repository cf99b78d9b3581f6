"""Pipeline stages planned per stage against every layer checkpointed on every stage.

One process per stage (gloo on CPU, one thread each) trains a GPT split into stages under
``ScheduleGPipe`` and ``Schedule1F1B`` (``torch.distributed.pipelining``), three ways:

* ``none``: no checkpointing (listed where it fits the budget on every rank, and always
  measured);
* ``every_layer``: every block of every stage checkpointed (what frameworks do);
* ``remat``: each rank's stage planned by ``remat.plan_pipeline_stage`` for the budget.

The budget is one number of bytes for every rank (``_budget``): where it exists, the
largest at which the first stage's plan is every layer while every other stage's plan
recomputes less (``first-only``: each stage's plans bisected on its profile,
``remat.bench.pipeline.needs_every_layer_below``), the budget the issue's speed criterion
names; else (GPipe, where every stage holds every microbatch) the largest ``every_layer``
peak over the ranks plus ``--margin`` of the spread up to the first stage's unchecked peak
(``margin``). Each rank measures its peak with ``remat.memory`` over every step (absolute:
parameters, gradients, AdamW state, the schedule's buffers, the batch, activations).
``every_layer`` and ``remat`` then run interleaved, round by round (``rounds`` rounds of
``steps`` timed steps, remat's plan made once); each round's ratio is remat's step time
over every_layer's (each the slowest rank's median of the round): the table gives their
median and range. A step's time is the largest over the ranks of each rank's median wall
time of the steps after the first of each run; its CPU time the sum over the ranks of each
one's median process CPU time (the work, steadier on a shared machine where the ranks share
cores). Read ratios, not values.

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
from remat.bench.pipeline import RankResult, needs_every_layer_below, run_rank
from remat.planner.pipeline.solve import StagePlan

QUICK = dict(
    layers=8, d_model=64, seq=32, batch=8, heads=2, vocab=256, microbatches=4, steps=2, rounds=2
)
FULL = dict(
    layers=8, d_model=128, seq=64, batch=16, heads=4, vocab=256, microbatches=8, steps=3, rounds=9
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _budget(
    cfg: ModelConfig, rank: int, world: int, schedule: str, size: dict, none_peak: int,
    every_peak: int, margin: float,
) -> tuple[int, str]:
    """One budget for every rank, and the rule that gave it.

    ``first-only``: the largest budget at which the first stage's plan costs what every
    layer recomputed costs, by its own prices (one byte below the smallest at which it costs
    less; the plan may be another of that cost: a split block and a kept one), where every
    other stage's plan costs less (the issue's "a budget where every layer everywhere is
    needed only on the first stage"). Else ``margin``: the largest every-layer peak over the
    ranks plus ``margin`` of the spread up to the first stage's unchecked peak."""
    found = [torch.zeros(2, dtype=torch.long) for _ in range(world)]
    mine = needs_every_layer_below(
        cfg, rank=rank, stages=world, schedule=schedule, microbatches=size["microbatches"]
    )
    dist.all_gather(found, torch.tensor(mine))
    below = int(found[0][1]) - 1
    if world > 1 and all(int(f[1]) <= below for f in found[1:]):
        return below, "first-only"
    peaks = torch.tensor([every_peak, none_peak if rank == 0 else 0])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    floor, top = int(peaks[0]), int(peaks[1])
    return floor + int(margin * max(0, top - floor)), "margin"


def _worker(
    rank: int, world: int, port: int, schedule: str, size: dict, margin: float, out: str
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        skip = ("microbatches", "steps", "rounds")
        cfg = ModelConfig(**{k: v for k, v in size.items() if k not in skip})
        common = dict(
            rank=rank, stages=world, schedule=schedule, microbatches=size["microbatches"]
        )
        steps = size["steps"] + 1  # the first of each run is not timed
        results: dict[str, RankResult] = {}
        results["none"] = run_rank(cfg, strategy="none", steps=steps, **common)
        results["every_layer"] = run_rank(cfg, strategy="every_layer", steps=steps, **common)
        budget, rule = _budget(
            cfg, rank, world, schedule, size, results["none"].peak_bytes,
            results["every_layer"].peak_bytes, margin,
        )
        results["remat"] = run_rank(cfg, strategy="remat", budget=budget, steps=steps, **common)
        plan = StagePlan.from_json(results["remat"].plan)
        # the two compared ways interleaved, round by round (each round's ratio its own)
        rounds: list[tuple[float, float]] = []
        for _ in range(size["rounds"]):
            got = {}
            for name in ("every_layer", "remat"):
                r = run_rank(cfg, strategy=name, steps=steps, plan=plan, budget=budget, **common)
                res = results[name]
                res.peak_bytes = max(res.peak_bytes, r.peak_bytes)
                res.step_times += r.step_times
                res.step_cpu_times += r.step_cpu_times
                got[name] = statistics.median(r.step_times)
            rounds.append((got["every_layer"], got["remat"]))
        for r in results.values():
            r.budget_bytes = budget
            r.grads = {}
        saved = {k: v.__dict__ for k, v in results.items()}
        saved["rule"], saved["rounds"] = rule, rounds
        torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
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
    # per interleaved round, remat's step time over every_layer's (each the slowest rank's)
    ratios = [
        max(pr["rounds"][k][1] for pr in per_rank) / max(pr["rounds"][k][0] for pr in per_rank)
        for k in range(len(per_rank[0]["rounds"]))
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
            "budget_rule": per_rank[0]["rule"],
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
    runs[f"remat-{schedule}-{stages}"]["round_ratios_vs_every_layer"] = ratios
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
        ratios = run.get("round_ratios_vs_every_layer")
        if ratios:
            lines.append(
                f"{'':<22} budget by {run['budget_rule']!r}; per interleaved round, step time "
                f"vs every_layer: median {statistics.median(ratios):.2f} "
                f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} rounds"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small GPT, 2 rounds: under 2 minutes")
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
