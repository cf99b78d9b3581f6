"""How good are the planner's plans? Brute force every per-block plan of a small GPT.

For each budget (a percentage, as remat.plan reads it: static bytes plus that share of
what the unchecked step allocates above them), every plan of keep / recompute /
selective per block is measured (the absolute step peak of the default loop with
AdamW, first and later step, by remat.measure_peak; step time as the median of
interleaved steps: zero_grad, forward, backward, optimizer.step); the planner's plan
is compared with the fastest plan that fits. Also reports profile + solve time.

Run: python benchmarks/planner_quality.py [--layers 4] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time

import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.apply import apply_decision

DECS = ("keep", "recompute", "selective")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budgets", default="30,50,70", help="percentages")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile-threads", default="1", help="threads for profiling: a number, or 'current'"
    )
    args = ap.parse_args(argv)
    cfg = ModelConfig(layers=args.layers, d_model=args.d_model, seq=args.seq, batch=4, heads=4)
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "model": vars(cfg),
    }
    print("environment:", env)
    model = build(cfg)
    x = example_input(cfg)
    opt: torch.optim.Optimizer | None = None
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    t0 = time.perf_counter()
    threads = None if args.profile_threads == "current" else int(args.profile_threads)
    prof = remat.profile(model, x, optimizer=opt, threads=threads)
    t_profile = time.perf_counter() - t0
    plans = list(itertools.product(DECS, repeat=cfg.layers))
    peaks, times = {}, {ds: [] for ds in plans}
    for ds in plans:
        for b, d in zip(model.blocks, ds):
            apply_decision(b, d)
        peaks[ds] = remat.measure_peak(model, x, optimizer=opt)
    for _ in range(args.steps + 1):  # interleaved; the first round is warm-up
        for ds in plans:
            for b, d in zip(model.blocks, ds):
                apply_decision(b, d)
            state = [p.detach().clone() for p in model.parameters()]
            t = time.perf_counter()
            model.zero_grad()
            model(x).backward()
            if opt is not None:
                opt.step()
            times[ds].append(time.perf_counter() - t)
            with torch.no_grad():  # every plan is timed on the same weights
                for p, v in zip(model.parameters(), state):
                    p.copy_(v)
    med = {ds: statistics.median(v[1:]) for ds, v in times.items()}
    keep = med[("keep",) * cfg.layers]
    spread = {ds: statistics.pstdev(v[1:]) for ds, v in times.items()}
    results = []
    print(
        f"profile time {t_profile:.2f} s; unchecked step peak "
        f"{prof.unchecked_peak_bytes / 2**20:.1f} MiB, static {prof.static_step_bytes / 2**20:.1f} MiB"
    )
    for pct in args.budgets.split(","):
        frac = float(pct) / 100
        t0 = time.perf_counter()
        try:
            p = remat.plan(prof, f"{pct}%")
        except remat.PlanError as e:
            print(f"budget {pct}%: {e}")
            continue
        budget = p.budget_bytes
        t_solve = time.perf_counter() - t0
        ours = tuple(p.decisions[f"blocks.{i}"] for i in range(cfg.layers))
        fits = [ds for ds in plans if peaks[ds] <= budget]
        best = min(fits, key=lambda ds: med[ds])
        row = {
            "budget": frac,
            "plan": ours,
            "plan_peak_ratio": peaks[ours] / prof.unchecked_peak_bytes,
            "plan_peak_bytes": peaks[ours],
            "budget_bytes": budget,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "plan_time_ratio": med[ours] / keep,
            "best": best,
            "best_time_ratio": med[best] / keep,
            "noise_ratio": spread[best] / keep,
            "solve_s": t_solve,
        }
        results.append(row)
        print(
            f"budget {pct}% ({budget} B): plan {ours} measured {peaks[ours]} B "
            f"({'met' if peaks[ours] <= budget else 'MISSED'}; predicted {p.predicted_peak_bytes} B) "
            f"peak x{row['plan_peak_ratio']:.2f} time "
            f"x{row['plan_time_ratio']:.3f} | best of {len(fits)} fitting plans {best} time "
            f"x{row['best_time_ratio']:.3f} (+-{row['noise_ratio']:.3f}) | solve {t_solve * 1e3:.0f} ms"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "profile_s": t_profile, "rows": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
