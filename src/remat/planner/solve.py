"""Exact solvers over the step model (:mod:`remat.planner.model`): MILP, DP, brute force."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .model import BlockCosts, predicted_cost, predicted_peak


def choices(blocks: Sequence[BlockCosts], allowed: Sequence[str]) -> list[list[str]]:
    return [[d for d in allowed if d in b.retained and d in b.cost] for b in blocks]


def solve_dp(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Exact optimum by dynamic programming over the Pareto front of (saved bytes, cost).

    Returns the decisions, or ``None`` when no plan fits ``budget``.
    """
    # state: saved bytes -> (cost, decisions); only non-dominated states are kept
    front: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]
    for b, opts in zip(blocks, choices(blocks, allowed)):
        nxt: dict[int, tuple[float, tuple[str, ...]]] = {}
        for saved, cost, ds in front:
            for d in opts:
                if b.fwd_start - saved + b.fwd_excess[d] > budget:
                    continue
                s2 = saved + b.retained["keep"] - b.retained[d]
                if b.bwd_start - s2 + b.bwd_excess[d] > budget:
                    continue
                c2 = cost + b.cost[d]
                old = nxt.get(s2)
                if old is None or c2 < old[0]:
                    nxt[s2] = (c2, (*ds, d))
        front = []
        best = float("inf")
        for s2 in sorted(nxt, reverse=True):  # more saved first; keep if strictly cheaper
            c2, ds = nxt[s2]
            if c2 < best:
                front.append((s2, c2, ds))
                best = c2
    feasible = [(c, ds) for s, c, ds in front if top - s <= budget]
    if not feasible:
        return None
    return list(min(feasible, key=lambda t: t[0])[1])


def solve_milp(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Exact optimum with HiGHS (``scipy.optimize.milp``); ``None`` when infeasible."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "remat.plan with solver='milp' needs scipy: pip install 'remat[plan]' "
            "(or pass solver='dp')."
        ) from e
    opts = choices(blocks, allowed)
    index = [(i, d) for i, ds in enumerate(opts) for d in ds]
    col = {k: j for j, k in enumerate(index)}
    n = len(index)
    c = np.array([blocks[i].cost[d] for i, d in index], dtype=float)
    rows: list[Any] = []
    lo: list[float] = []
    hi: list[float] = []
    for i, ds in enumerate(opts):  # one decision per block
        r = np.zeros(n)
        for d in ds:
            r[col[(i, d)]] = 1
        rows.append(r)
        lo.append(1)
        hi.append(1)

    def saved_row(upto: int) -> Any:
        r = np.zeros(n)
        for j in range(upto):
            for d in opts[j]:
                r[col[(j, d)]] = blocks[j].retained["keep"] - blocks[j].retained[d]
        return r

    for i, b in enumerate(blocks):
        # fwd_start - saved(i-1) + fwd_excess[d_i] <= budget
        r = -saved_row(i)
        for d in opts[i]:
            r[col[(i, d)]] += b.fwd_excess[d]
        rows.append(r)
        lo.append(-np.inf)
        hi.append(budget - b.fwd_start)
        # bwd_start - saved(i) + bwd_excess[d_i] <= budget
        r = -saved_row(i + 1)
        for d in opts[i]:
            r[col[(i, d)]] += b.bwd_excess[d]
        rows.append(r)
        lo.append(-np.inf)
        hi.append(budget - b.bwd_start)
    rows.append(-saved_row(len(blocks)))
    lo.append(-np.inf)
    hi.append(budget - top)
    res = milp(
        c,
        constraints=LinearConstraint(np.array(rows), np.array(lo), np.array(hi)),
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
    )
    if res.status != 0 or res.x is None:
        return None
    out = ["keep"] * len(blocks)
    for (i, d), v in zip(index, res.x):
        if v > 0.5:
            out[i] = d
    return out


def smallest_peak(blocks: Sequence[BlockCosts], top: int, allowed: Sequence[str]) -> int:
    """The smallest predicted peak any plan reaches (exact, by the same DP with no budget)."""
    front: dict[int, int] = {0: 0}  # saved -> smallest peak so far
    for b, opts in zip(blocks, choices(blocks, allowed)):
        nxt: dict[int, int] = {}
        for saved, peak in front.items():
            for d in opts:
                p = max(peak, b.fwd_start - saved + b.fwd_excess[d])
                s2 = saved + b.retained["keep"] - b.retained[d]
                p = max(p, b.bwd_start - s2 + b.bwd_excess[d])
                if s2 not in nxt or p < nxt[s2]:
                    nxt[s2] = p
        front = nxt
    return min(max(p, top - s) for s, p in front.items())


def brute_force(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Every plan, for tests on small chains."""
    best: tuple[float, list[str]] | None = None
    for ds in itertools.product(*choices(blocks, allowed)):
        if predicted_peak(blocks, top, ds) <= budget:
            c = predicted_cost(blocks, ds)
            if best is None or c < best[0]:
                best = (c, list(ds))
    return None if best is None else best[1]



_SIMPLER = ("keep", "selective", "recompute", "offload")


def prefer_simple(
    blocks: Sequence[BlockCosts], top: int, budget: int, decisions: list[str]
) -> list[str]:
    """Among equal-cost choices keep the simplest (keep, then selective, ...) that still fits."""
    out = list(decisions)
    for i, b in enumerate(blocks):
        for d in _SIMPLER:
            if d == out[i]:
                break
            if d in b.cost and d in b.retained and b.cost[d] <= b.cost[out[i]]:
                trial = [*out[:i], d, *out[i + 1 :]]
                if predicted_peak(blocks, top, trial) <= budget:
                    out = trial
                    break
    return out


