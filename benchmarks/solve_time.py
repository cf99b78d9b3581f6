"""How long does the planner's solve take? The chain DP on synthetic chains of 100 blocks.

Times what ``remat.plan`` runs after profiling: the smallest reachable peak
(``smallest_chain``) and the two-stage solve (least cost, then the simplest plan
within the timing noise) with spans of up to ``--max-span`` blocks, for chains of
identical blocks and of heterogeneous (random) blocks, at budgets from the floor to
the unchecked peak, with no tolerance (FLOP costs) and with a timing tolerance.
Single-threaded by default (``torch.set_num_threads(1)``).

``--offload``: a device's profile: the ``offload`` decision as well, and every span
may also offload its input (twice the span rows).

Run: python benchmarks/solve_time.py [--blocks 100] [--max-span 16] [--offload] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

import torch

from remat.planner.solve import smallest_chain, solve
from remat.planner.stepmodel import predicted_cost, predicted_peak
from remat.planner.types import BlockCosts

DECS = ("keep", "recompute", "selective", "split")


def chain(
    n: int, seed: int, identical: bool, offload: bool = False
) -> tuple[list[BlockCosts], int]:
    """Blocks with the shape of a transformer's (keep saves most, recompute and split keep
    the input); ``identical``: one block's terms repeated, as equalize_costs leaves them;
    ``offload``: with the ``offload`` decision and span-input offload (a device)."""
    rng = random.Random(seed)
    decs = (*DECS, "offload") if offload else DECS

    def terms() -> dict[str, dict[str, float]]:
        keep = rng.randint(300, 400)
        return {
            "retained": {
                "keep": keep,
                "selective": rng.randint(100, 200),
                "recompute": rng.randint(20, 30),
                "split": rng.randint(40, 60),
                "offload": rng.randint(20, 30),
            },
            "fwd_excess": {d: rng.randint(30, 80) for d in decs},
            "bwd_excess": {
                "keep": rng.randint(40, 60),
                "selective": rng.randint(150, 250),
                "recompute": rng.randint(350, 450),
                "split": rng.randint(150, 250),
                "offload": rng.randint(60, 120),
            },
            "cost": {
                "keep": 0.0,
                "selective": rng.uniform(0.2, 0.4),
                "recompute": rng.uniform(0.9, 1.1),
                "split": rng.uniform(1.1, 1.4),
                "offload": rng.uniform(1.0, 2.0),
            },
        }

    one = terms()
    blocks = []
    live = 2000
    for i in range(n):
        t = one if identical else terms()
        blocks.append(
            BlockCosts(
                name=f"layers.{i}",
                retained={d: int(t["retained"][d]) for d in decs},
                fwd_excess={d: int(t["fwd_excess"][d]) for d in decs},
                bwd_excess={d: int(t["bwd_excess"][d]) for d in decs},
                cost={d: t["cost"][d] for d in decs},
                fwd_start=live,
                bwd_start=0,
                offload_input=int(t["retained"]["recompute"]) if offload else 0,
            )
        )
        live += int(t["retained"]["keep"])
    for i, b in enumerate(blocks):
        b.bwd_start = sum(x.retained["keep"] for x in blocks[: i + 1]) + 2000 + 20 * (n - i)
    return blocks, live + 500


def timed(fn, *args, repeat: int = 1, **kwargs) -> tuple[float, object]:
    """Median wall time of ``fn(*args, **kwargs)`` and its result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--max-span", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--offload", action="store_true", help="a device's profile (see above)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "blocks": args.blocks,
        "max_span": args.max_span,
        "offload": args.offload,
    }
    decs = (*DECS, "offload") if args.offload else DECS
    print("environment:", env)
    rows = []
    n = args.blocks
    for kind in ("identical", "heterogeneous"):
        blocks, top = chain(n, 0, kind == "identical", args.offload)
        floor_s, floor = timed(smallest_chain, blocks, top, decs, args.max_span)
        lo = predicted_peak(blocks, top, floor[0], 0, floor[1])  # type: ignore[index]
        hi = predicted_peak(blocks, top, ["keep"] * n)
        for frac in (0.0, 0.25, 0.5, 0.75):
            budget = int(lo + (hi - lo) * frac)
            for tolerance in (0.0, 0.5):
                s, found = timed(
                    solve,
                    blocks,
                    top,
                    budget,
                    decs,
                    tolerance=tolerance,
                    max_span=args.max_span,
                    repeat=args.repeat,
                )
                ds, spans = found  # type: ignore[misc]
                row = {
                    "chain": kind,
                    "budget": f"floor + {frac:.0%}",
                    "tolerance": tolerance,
                    "floor_s": round(floor_s, 4),
                    "solve_s": round(s, 4),
                    "cost": round(predicted_cost(blocks, ds, spans), 3),
                    "spans": len(spans),
                    "offloaded_spans": sum(sp.offloaded for sp in spans),
                }
                rows.append(row)
                print(
                    f"{kind:13s} {row['budget']:12s} tolerance {tolerance:<4} "
                    f"floor {floor_s * 1e3:6.1f} ms  solve {s * 1e3:7.1f} ms  "
                    f"cost {row['cost']:8.3f}  spans {len(spans)} ({row['offloaded_spans']} offloaded)",
                    flush=True,
                )
    worst = max(r["floor_s"] + r["solve_s"] for r in rows)
    print(f"slowest floor + solve: {worst * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
