"""Exact solvers over the activation terms of the step model (:mod:`remat.planner.model`).

Planning is two exact solves over the same constraints (every activation term
``<= budget``):

1. the least predicted added cost ``C*``;
2. among plans costing at most ``C* + tolerance`` (the timing noise, 0 for
   FLOPs), the simplest: fewest non-``keep`` blocks, weighted ``keep`` <
   ``selective`` < ``recompute`` < ``offload`` < ``split``, then earlier blocks first.
   The second objective is integral and depends on bytes and structure only,
   so near-ties from timing noise always resolve the same way.

:func:`solve` does both with HiGHS (``scipy.optimize.milp``, extra
``remat[plan]``, relative MIP gap 0) or with an exact dynamic program over
blocks whose state is the bytes saved so far, keeping the Pareto front of
(cost, simplicity); :func:`brute_force` enumerates, for tests.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from .chain import (
    COMPLEXITY,
    SPAN_COMPLEXITY,
    TooManyStates,
    choices,
    cost_to_go,
    segment_table,
    simplest,
    simplicity,
    smallest,
    unpack,
)
from .model import BlockCosts, predicted_cost, predicted_peak

__all__ = [
    "COMPLEXITY",
    "SPAN_COMPLEXITY",
    "brute_force",
    "choices",
    "plan_simplicity",
    "simplicity",
    "smallest_chain",
    "smallest_peak",
    "solve",
    "solve_chain",
    "solve_dp",
    "solve_milp",
]


def plan_simplicity(decisions: Sequence[str]) -> int:
    n = len(decisions)
    return sum(simplicity(n, i, d) for i, d in enumerate(decisions))


def solve_chain(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[str],
    *,
    max_span: int = 16,
    cost_cap: float | None = None,
    chained: Sequence[bool] | None = None,
    held: Sequence[bool] | None = None,
) -> tuple[list[str], list[tuple[int, ...]]] | None:
    """Exact optimum over per-block decisions and spans of consecutive blocks.

    The chain dynamic program of :mod:`remat.planner.chain` (Chen et al. 2016,
    arXiv:1604.06174; Griewank & Walther's Revolve, ACM TOMS 2000, for two nesting
    levels; heterogeneous costs and memory as in Beaumont et al. 2019, Rotor,
    arXiv:1911.13214). Without ``cost_cap``: a plan of the least cost; with it: the
    simplest plan whose cost is at most ``cost_cap``. Spans join block ``i`` to ``i + 1``
    only where ``chained[i]`` (default: everywhere), and never hold blocks ``i..i+2``
    where ``held[i]`` (:func:`~remat.planner.chain.span_end`).

    Returns ``(decisions, spans)`` (spans as ``(first, last)`` indices), or ``None``.
    """
    n = len(blocks)
    t = segment_table(blocks, allowed, max(1, max_span), chained, held)
    ctg = cost_to_go(t, n, top, budget)
    if cost_cap is None:
        return None if ctg.least() is None else unpack(t, ctg.cheapest(t))
    rows = simplest(t, n, budget, ctg, cost_cap)
    return None if rows is None else unpack(t, rows)


def solve(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[str],
    *,
    tolerance: float = 0.0,
    solver: str = "milp",
    max_span: int = 1,
    chained: Sequence[bool] | None = None,
    held: Sequence[bool] | None = None,
) -> tuple[list[str], list[tuple[int, ...]]] | None:
    """The simplest plan within ``tolerance`` of the least cost: ``(decisions, spans)``, or
    ``None`` when none fits. ``max_span > 1`` allows spans (solved by :func:`solve_chain`);
    otherwise ``solver`` picks the MILP or the per-block DP."""
    if max_span > 1 or solver == "chain":
        n = len(blocks)
        t = segment_table(blocks, allowed, max(1, max_span), chained, held)
        ctg = cost_to_go(t, n, top, budget)
        least = ctg.least()
        if least is None:
            return None
        rows = None
        for slack in (tolerance, 0.0):  # too many plans within the noise: least cost only
            try:
                rows = simplest(t, n, budget, ctg, _cap(least, slack), limit=STATE_LIMIT)
                break
            except TooManyStates:
                continue
        return unpack(t, ctg.cheapest(t) if rows is None else rows)
    one = solve_milp if solver == "milp" else solve_dp
    best = one(blocks, top, budget, allowed)
    if best is None:
        return None
    simple = one(
        blocks, top, budget, allowed, cost_cap=_cap(predicted_cost(blocks, best), tolerance)
    )
    return (best if simple is None else simple), []


STATE_LIMIT = 500
"""States per position the second stage (the simplest plan within the timing noise) may keep
before it narrows its cap to the least cost, then gives up on simplicity (the least-cost plan
of the first stage, exact either way): keeps the solve well under a second for 100 blocks."""


def _cap(cost: float, tolerance: float) -> float:
    cap = cost + max(tolerance, 0.0)
    return cap + 1e-9 * max(abs(cap), 1e-30)  # float sums in another order


def solve_dp(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[str],
    *,
    cost_cap: float | None = None,
) -> list[str] | None:
    """Exact optimum by dynamic programming over the Pareto front of (saved bytes, cost).

    With ``cost_cap``: the simplest plan (:func:`simplicity`) whose cost is at
    most ``cost_cap``. Returns the decisions, or ``None`` when no plan fits.
    """
    n = len(blocks)
    # state: saved bytes -> non-dominated (cost, simplicity, decisions)
    front: dict[int, list[tuple[float, int, tuple[str, ...]]]] = {0: [(0.0, 0, ())]}
    for i, (b, opts) in enumerate(zip(blocks, choices(blocks, allowed))):
        nxt: dict[int, list[tuple[float, int, tuple[str, ...]]]] = {}
        for saved, entries in front.items():
            for d in opts:
                if b.fwd_start - saved + b.fwd_excess[d] > budget:
                    continue
                s2 = saved + b.retained["keep"] - b.retained[d]
                if b.bwd_start - s2 + b.bwd_excess[d] > budget:
                    continue
                for cost, simp, ds in entries:
                    c2 = cost + b.cost[d]
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
    allowed: Sequence[str],
    *,
    cost_cap: float | None = None,
) -> list[str] | None:
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
    opts = choices(blocks, allowed)
    index = [(i, d) for i, ds in enumerate(opts) for d in ds]
    col = {k: j for j, k in enumerate(index)}
    n = len(index)
    cost = np.array([blocks[i].cost[d] for i, d in index], dtype=float)
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
    out = ["keep"] * len(blocks)
    for (i, d), v in zip(index, res.x):
        if v > 0.5:
            out[i] = d
    return out


def smallest_chain(
    blocks: Sequence[BlockCosts],
    top: int,
    allowed: Sequence[str],
    max_span: int,
    chained: Sequence[bool] | None = None,
    held: Sequence[bool] | None = None,
) -> tuple[list[str], list[tuple[int, ...]]]:
    """A plan (with spans up to ``max_span`` blocks, joining blocks only where ``chained``
    and ``held`` allow: :func:`~remat.planner.chain.span_end`) of the smallest predicted
    activation peak."""
    t = segment_table(blocks, allowed, max(1, max_span), chained, held)
    return unpack(t, smallest(t, len(blocks), top))


def smallest_peak(blocks: Sequence[BlockCosts], top: int, allowed: Sequence[str]) -> int:
    """The smallest predicted activation peak any plan reaches."""
    return predicted_peak(blocks, top, smallest_chain(blocks, top, allowed, 1)[0])


def brute_force(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Every plan, for tests on small chains: the cheapest that fits."""
    best: tuple[float, list[str]] | None = None
    for ds in itertools.product(*choices(blocks, allowed)):
        if predicted_peak(blocks, top, ds) <= budget:
            c = predicted_cost(blocks, ds)
            if best is None or c < best[0]:
                best = (c, list(ds))
    return None if best is None else best[1]
