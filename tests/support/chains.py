"""Synthetic chains of blocks (:class:`remat.planner.model.BlockCosts`) for the solvers,
and every plan of a chain.
"""

from __future__ import annotations

import random

from remat.planner.types import KEEP, RECOMPUTE, SELECTIVE, SPAN_INNER, BlockCosts

DECS = (KEEP, RECOMPUTE, SELECTIVE)


def random_chain(seed: int, n: int) -> tuple[list[BlockCosts], int]:
    """``n`` blocks with seeded random bytes and costs under keep, selective and recompute,
    and the peak after the last block."""
    rng = random.Random(seed)
    blocks = []
    live = 1000
    for i in range(n):
        keep = rng.randint(200, 400)
        sel = rng.randint(60, keep - 50)
        rec = rng.randint(10, 40)
        retained = {"keep": keep, "selective": sel, "recompute": rec}
        blocks.append(
            BlockCosts(
                name=f"blocks.{i}",
                retained=retained,
                fwd_excess={d: rng.randint(20, 80) for d in DECS},
                bwd_excess={
                    "keep": rng.randint(20, 60),
                    "selective": rng.randint(100, 250),
                    "recompute": rng.randint(200, 450),
                },
                cost={
                    "keep": 0.0,
                    "selective": rng.randint(1, 5) / 10,
                    "recompute": rng.randint(6, 12) / 10,
                },
                fwd_start=live,
                bwd_start=0,
            )
        )
        live += keep
    top = live + 150
    # backward of block i starts with everything up to i alive (all-keep), plus some grads
    for i, b in enumerate(blocks):
        b.bwd_start = sum(x.retained["keep"] for x in blocks[: i + 1]) + 1000 + 30 * (n - i)
    return blocks, top


def layouts(blocks, decs, max_span):
    """Every plan: a block alone under a decision it has, or a span under one inner decision."""
    n = len(blocks)

    def rec(i):
        if i == n:
            yield []
            return
        for d in decs:
            if d in blocks[i].cost:
                for rest in rec(i + 1):
                    yield [(i, i, d, False)] + rest
        for d in SPAN_INNER:
            if d not in decs:
                continue
            for z in range(i + 1, min(n, i + max_span)):
                if any(d not in blocks[j].cost for j in range(i, z + 1)):
                    break
                for rest in rec(z + 1):
                    yield [(i, z, d, True)] + rest

    for lay in rec(0):
        ds = [d for a, z, d, _ in lay for _ in range(a, z + 1)]
        yield ds, [(a, z) for a, z, _, span in lay if span]
