"""Exact per-block solvers: one decision per block, no spans (and brute force, for tests).

Over the step model's rows (:func:`remat.planner.stepmodel.block_segment`: a block's
largest term before what the blocks before it saved, and what it saves), so a plan fits
``budget`` when every chosen row's ``peak - saved(i-1) <= budget`` and ``top - saved(n) <=
budget``. :func:`solve_dp` is an exact dynamic program over blocks whose state is the
bytes saved so far, keeping the Pareto front of (cost, simplicity); :func:`solve_milp`
solves the same constraints with HiGHS (``scipy.optimize.milp``, extra ``remat[plan]``,
relative MIP gap 0). With ``cost_cap`` both return the simplest plan
(:func:`~remat.planner.chain.simplicity`) whose cost is at most the cap.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from .chain import simplicity
from .stepmodel import block_segment, block_terms, options, predicted_cost, predicted_peak
from .types import BlockCosts, Decision

__all__ = ["brute_force", "solve_dp", "solve_milp"]


def solve_dp(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[Decision],
    *,
    cost_cap: float | None = None,
) -> list[Decision] | None:
    """Exact optimum by dynamic programming over the Pareto front of (saved bytes, cost).

    With ``cost_cap``: the simplest plan (:func:`simplicity`) whose cost is at
    most ``cost_cap``. Returns the decisions, or ``None`` when no plan fits.
    """
    n = len(blocks)
    # state: saved bytes -> non-dominated (cost, simplicity, decisions)
    front: dict[int, list[tuple[float, int, tuple[Decision, ...]]]] = {0: [(0.0, 0, ())]}
    for i, opts in enumerate(options(blocks, allowed)):
        rows = [block_segment(blocks, i, d) for d in opts]
        nxt: dict[int, list[tuple[float, int, tuple[Decision, ...]]]] = {}
        for saved, entries in front.items():
            for d, row in zip(opts, rows):
                if row.peak - saved > budget:
                    continue
                s2 = saved + row.saved
                for cost, simp, ds in entries:
                    c2 = cost + row.cost
                    if cost_cap is not None and c2 > cost_cap:
                        continue
                    nxt.setdefault(s2, []).append((c2, simp + simplicity(n, i, d), (*ds, d)))
        front = {}
        for s2, entries in nxt.items():
            front[s2] = _pareto(entries, by_simplicity=cost_cap is not None)
        front = _prune_states(front, by_simplicity=cost_cap is not None)
    feasible = [e for s, es in front.items() if top - s <= budget for e in es]
    if not feasible:
        return None
    if cost_cap is None:
        return list(min(feasible, key=lambda e: (e[0], e[1]))[2])
    return list(min(feasible, key=lambda e: (e[1], e[0]))[2])


def _pareto(
    entries: list[tuple[float, int, Any]], by_simplicity: bool
) -> list[tuple[float, int, Any]]:
    """Entries not dominated in (cost, simplicity) (cost only without the second stage)."""
    if not by_simplicity:
        return [min(entries, key=lambda e: (e[0], e[1]))]
    out: list[tuple[float, int, Any]] = []
    best_simp: int | None = None
    for e in sorted(entries, key=lambda e: (e[0], e[1])):
        if best_simp is None or e[1] < best_simp:
            out.append(e)
            best_simp = e[1]
    return out


def _prune_states(
    front: dict[int, list[tuple[float, int, Any]]], by_simplicity: bool
) -> dict[int, list[tuple[float, int, Any]]]:
    """Drop entries dominated by a state that saved more bytes at no more cost (and simplicity).

    States are visited from the most saved down; the entries kept so far form a
    staircase (cost ascending, simplicity strictly descending), so "is there a kept
    entry with cost <= c and simplicity <= p" is one binary search.
    """
    out: dict[int, list[tuple[float, int, Any]]] = {}
    if not by_simplicity:
        best = float("inf")
        for s2 in sorted(front, reverse=True):
            e = min(front[s2], key=lambda e: (e[0], e[1]))
            if e[0] < best:
                out[s2] = [e]
                best = e[0]
        return out
    costs: list[float] = []  # staircase: cost ascending ...
    simps: list[int] = []  # ... simplicity strictly descending
    for s2 in sorted(front, reverse=True):
        survivors = []
        for e in sorted(front[s2], key=lambda e: (e[0], e[1])):
            k = bisect.bisect_right(costs, e[0]) - 1
            if k >= 0 and simps[k] <= e[1]:
                continue
            survivors.append(e)
        for e in survivors:
            k = bisect.bisect_right(costs, e[0])
            # drop staircase entries this one dominates (cost >= e's, simplicity >= e's)
            m = k
            while m < len(costs) and simps[m] >= e[1]:
                m += 1
            costs[k:m] = [e[0]]
            simps[k:m] = [e[1]]
        if survivors:
            out[s2] = survivors
    return out


def solve_milp(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[Decision],
    *,
    cost_cap: float | None = None,
) -> list[Decision] | None:
    """Exact optimum with HiGHS (``scipy.optimize.milp``); ``None`` when infeasible.

    With ``cost_cap``: the simplest plan (:func:`simplicity`) whose cost is at most ``cost_cap``.
    """
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "remat.plan with solver='milp' needs scipy: pip install 'remat[plan]' "
            "(or pass solver='dp')."
        ) from e
    opts = options(blocks, allowed)
    index = [(i, d) for i, ds in enumerate(opts) for d in ds]
    col = {k: j for j, k in enumerate(index)}
    terms = {(i, d): block_terms(blocks[i], d) for i, d in index}
    n = len(index)
    cost = np.array([terms[k].cost for k in index], dtype=float)
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
                r[col[(j, d)]] = terms[(j, d)].saves
        return r

    for i, ds in enumerate(opts):
        # forward_start - saved(i-1) + forward_excess[d_i] <= budget (the starts are the
        # block's own, the same under every decision)
        start = terms[(i, ds[0])]
        r = -saved_row(i)
        for d in opts[i]:
            r[col[(i, d)]] += terms[(i, d)].forward_excess
        rows.append(r)
        lo.append(-np.inf)
        hi.append(budget - start.forward_start)
        # backward_start - saved(i) + backward_excess[d_i] <= budget
        r = -saved_row(i + 1)
        for d in opts[i]:
            r[col[(i, d)]] += terms[(i, d)].backward_excess
        rows.append(r)
        lo.append(-np.inf)
        hi.append(budget - start.backward_start)
    rows.append(-saved_row(len(blocks)))
    lo.append(-np.inf)
    hi.append(budget - top)
    if cost_cap is None:
        objective = cost
    else:
        rows.append(cost)
        lo.append(-np.inf)
        hi.append(cost_cap)
        objective = np.array([simplicity(len(blocks), i, d) for i, d in index], dtype=float)
    res = milp(
        objective,
        constraints=LinearConstraint(np.array(rows), np.array(lo), np.array(hi)),
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0.0},
    )
    if res.status != 0 or res.x is None:
        return None
    out = [Decision.KEEP] * len(blocks)
    for (i, d), v in zip(index, res.x):
        if v > 0.5:
            out[i] = d
    return out


def brute_force(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[Decision]
) -> list[Decision] | None:
    """Every plan, for tests on small chains: the cheapest that fits."""
    best: tuple[float, list[Decision]] | None = None
    for ds in itertools.product(*options(blocks, allowed)):
        if predicted_peak(blocks, top, ds) <= budget:
            c = predicted_cost(blocks, ds)
            if best is None or c < best[0]:
                best = (c, list(ds))
    return None if best is None else best[1]
