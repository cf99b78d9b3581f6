"""Step times of ``benchmarks/varlen.py``'s adaptive plans and longest-batch plan, interleaved.

``varlen.py`` runs its three runs one after the other, so a machine whose load changes
between runs moves their ratio. Here one model runs every batch of the same workload under
both plans, back to back, alternating which goes first, on the same weights (forward and
backward; no optimizer step, so the weights stay those of the start): the ratio of the two
times of one batch is then taken under the same load. The adaptive plans are the decisions
``varlen.py`` recorded per bucket (``--from`` its JSON); the longest batch's plan is made
again here with the same budget in bytes.

Run: python benchmarks/varlen_interleaved.py --from varlen.json [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

import torch

import remat
from remat.bench.models import build
from remat.bench.runner import load_average
from remat.planner.apply import apply_decision

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from varlen import FULL, QUICK, batches  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True, help="varlen.py's JSON")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="the quick workload")
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    first = json.load(open(args.source))
    data = batches(w)
    adaptive = {int(k): v for k, v in first["adaptive"]["plans"].items()}
    knots = sorted(adaptive)
    model = build(w.cfg)
    opt = torch.optim.AdamW(model.parameters())
    longest = max(data, key=lambda b: b.shape[1])
    one = remat.auto_checkpoint(
        model, longest, budget=first["budget_bytes"], optimizer=opt, timer=w.timer, quiet=True
    )
    load_before = load_average()
    rows = []
    for i, batch in enumerate(data):
        size = batch.shape[1]
        bucket = min(w.high + 1, math.ceil(size / w.multiple) * w.multiple)
        bucket = max(bucket, knots[0])
        times: dict[str, float] = {}
        order = ["adaptive", "longest"] if i % 2 == 0 else ["longest", "adaptive"]
        for name in order:
            if name == "adaptive":
                for block, d in adaptive[bucket].items():
                    apply_decision(model.get_submodule(block), d)
            else:
                one.apply(model)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            t = time.perf_counter()
            model(batch).backward()
            times[name] = time.perf_counter() - t
        rows.append({"tokens": size - 1, **times, "ratio": times["adaptive"] / times["longest"]})
        print(f"step {i:2d}: {size - 1:5d} tokens, adaptive {times['adaptive']:.3f} s, "
              f"longest {times['longest']:.3f} s", flush=True)  # fmt: skip
    ratios = [r["ratio"] for r in rows]
    total = {k: sum(r[k] for r in rows) for k in ("adaptive", "longest")}
    result = {
        "longest_plan": {"decisions": dict(one.decisions), "spans": one.spans},
        "steps": rows,
        "total_s": total,
        "total_ratio": total["adaptive"] / total["longest"],
        "per_step_ratio_median": statistics.median(ratios),
        "per_step_ratio_quartiles": statistics.quantiles(ratios, n=4),
        "per_step_ratio_min_max": [min(ratios), max(ratios)],
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
