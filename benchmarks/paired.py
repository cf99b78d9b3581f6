"""A profile from pair steps beside one of uniform steps: wall time, the most bytes any
profiling step held, and the plans they give (#31 item 1).

For a model shapes alone cannot profile (here forced: ``timer="measured"`` is one such case,
but its timing noise would hide the comparison, so the profiles count FLOPs and pair steps
are asked for directly) at a batch too small to fit from smaller batches, ``auto_checkpoint``
profiles the whole batch in single or pair steps (:mod:`remat.planner.grouped`; the
profile's ``steps`` says which) instead of the uniform steps, whose ``keep`` step is the
unchecked one. This script profiles the bench GPT both ways
in one process, in alternating order, and prints per run the wall time, the peak bytes the
profile's steps held (``remat.memory.track`` around it, plus the parameters and inputs alive
before it) against the unchecked step, and whether the two profiles and their plans at 70, 50
and 30 % are the same.

Run: python benchmarks/paired.py [--layers 8] [--seq 1024] [--batch 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the test suite's helpers (tests/support)

import remat  # noqa: E402
from remat.bench.models import ModelConfig, build, example_input  # noqa: E402
from remat.planner import measure  # noqa: E402
from remat.planner.inputs import Inputs  # noqa: E402
from remat.planner.loop import Loop  # noqa: E402
from tests.support.plans import measured_differences  # noqa: E402


def _run(cfg: ModelConfig, paired: bool) -> tuple[float, int, remat.Profile]:
    model, x = build(cfg), example_input(cfg)
    static = sum(p.nbytes for p in model.parameters()) + x.nbytes
    start = time.perf_counter()
    with remat.memory.track() as t:
        prof = measure.profile_loop(model, Inputs(x), Loop(timer="flops"), paired=paired)
    return time.perf_counter() - start, static + t.peak_bytes_by_device["cpu"], prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(layers=args.layers, d_model=256, seq=args.seq, batch=args.batch, heads=4,
                      vocab=512)  # fmt: skip
    print({"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "config": vars(args)}, flush=True)  # fmt: skip
    profiles: dict[bool, remat.Profile] = {}
    for r in range(args.rounds):
        for paired in (r % 2 == 1, r % 2 == 0):
            seconds, held, prof = _run(cfg, paired)
            profiles[paired] = prof
            print(
                f"{prof.steps + ' steps':>14}: {seconds:6.1f} s, held "
                f"{held / 2**20:8.1f} MiB (unchecked step {prof.unchecked_peak_bytes / 2**20:.1f} "
                f"MiB, floor {prof.floor_bytes / 2**20:.1f} MiB)",
                flush=True,
            )
    a, b = (json.loads(profiles[k].to_json()) for k in (False, True))
    diff = measured_differences(a, b)
    print(f"profiles equal (scratch aside): {not diff}", diff[:5], flush=True)
    for share in ("70%", "50%", "30%"):
        plans = []
        for k in (False, True):
            try:
                p = remat.plan(profiles[k], share)
                plans.append((dict(p.decisions), p.predicted_peak_bytes))
            except remat.PlanError:
                plans.append(None)
        print(f"plan at {share}: equal {plans[0] == plans[1]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
