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

from .model import (
    SPAN_INNER,
    BlockCosts,
    Segment,
    block_segment,
    predicted_cost,
    predicted_peak,
    span_segment,
)

#: How complex a decision is (near-ties go to the smaller sum).
COMPLEXITY = {"keep": 0, "selective": 1, "recompute": 2, "offload": 3, "split": 4}


def choices(blocks: Sequence[BlockCosts], allowed: Sequence[str]) -> list[list[str]]:
    return [[d for d in allowed if d in b.retained and d in b.cost] for b in blocks]


def simplicity(n: int, i: int, d: str) -> int:
    """Integer weight of decision ``d`` on block ``i`` of ``n``: complexity first, then position."""
    c = COMPLEXITY.get(d, 4)
    return c * (n * (n + 1) // 2 + 1) + (i + 1 if c else 0)


def plan_simplicity(decisions: Sequence[str]) -> int:
    n = len(decisions)
    return sum(simplicity(n, i, d) for i, d in enumerate(decisions))


#: A block inside a span counts this much more complex than the same decision alone.
SPAN_COMPLEXITY = 5


def segment_simplicity(n: int, seg: Segment) -> int:
    """Integer weight of a segment (see :func:`simplicity`); spans weigh more than blocks."""
    w = sum(simplicity(n, i, seg.decision) for i in range(seg.first, seg.last + 1))
    if seg.span:
        w += SPAN_COMPLEXITY * (n * (n + 1) // 2 + 1) * (seg.last - seg.first + 1)
    return w


def chain_segments(
    blocks: Sequence[BlockCosts], allowed: Sequence[str], max_span: int
) -> list[list[Segment]]:
    """For each block, the segments that start there: the block alone under each allowed
    decision, and spans of 2..``max_span`` blocks under each allowed inner decision."""
    opts = choices(blocks, allowed)
    n = len(blocks)
    out: list[list[Segment]] = []
    for a in range(n):
        segs = [block_segment(blocks, a, d) for d in opts[a]]
        for d in SPAN_INNER:
            if d not in allowed:
                continue
            for z in range(a + 1, min(n, a + max_span)):
                if d not in opts[z] or d not in opts[a]:
                    break
                segs.append(span_segment(blocks, a, z, d))
        out.append(segs)
    return out


Entry = tuple[float, int, Any]  # cost, simplicity, path as (segment, parent path) cells


def solve_chain(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[str],
    *,
    max_span: int = 16,
    cost_cap: float | None = None,
) -> tuple[list[str], list[tuple[int, int]]] | None:
    """Exact optimum over per-block decisions and spans of consecutive blocks.

    A dynamic program over chain positions whose state is the bytes saved so far
    (every activation term of a segment is ``its peak - saved before it``), keeping
    per position and state the Pareto front of (cost, simplicity): the checkpointing
    chain DP of Chen et al. 2016 (arXiv:1604.06174) and Griewank & Walther's Revolve
    (ACM TOMS 2000) for two nesting levels, with heterogeneous per-block costs and
    memory as in Beaumont et al. 2019 (Rotor, arXiv:1911.13214). With ``cost_cap``:
    the simplest plan whose cost is at most ``cost_cap``.

    Returns ``(decisions, spans)`` (spans as ``(first, last)`` indices), or ``None``.
    """
    n = len(blocks)
    segs = chain_segments(blocks, allowed, max(1, max_span))
    second = cost_cap is not None
    fronts: list[dict[int, list[Entry]]] = [{} for _ in range(n + 1)]
    fronts[0] = {0: [(0.0, 0, None)]}
    if not second:  # one entry a state: the cheapest (then simplest)
        best: list[dict[int, Entry]] = [{} for _ in range(n + 1)]
        best[0] = {0: (0.0, 0, None)}
        for pos in range(n):
            states = sorted(_prune_states({k: [e] for k, e in best[pos].items()}, False).items())
            best[pos] = {}
            keys = [k for k, _ in states]
            for seg in segs[pos]:
                simp = segment_simplicity(n, seg)
                into = best[seg.last + 1]
                start = bisect.bisect_left(keys, seg.peak - budget)
                for saved, entries in states[start:]:
                    cost, sp, path = entries[0]
                    s2 = saved + seg.saved
                    c2 = cost + seg.cost
                    old = into.get(s2)
                    if old is None or (c2, sp + simp) < (old[0], old[1]):
                        into[s2] = (c2, sp + simp, (seg, path))
        fronts[n] = {k: [e] for k, e in best[n].items()}
    for pos in range(n if second else 0):
        pruned = _prune_states(fronts[pos], by_simplicity=second)
        fronts[pos] = {}
        for seg in segs[pos]:
            room = budget - seg.peak  # saved before must be >= -room
            simp = segment_simplicity(n, seg)
            target = fronts[seg.last + 1]
            for saved, entries in pruned.items():
                if saved < -room:
                    continue
                s2 = saved + seg.saved
                for cost, sp, path in entries:
                    c2 = cost + seg.cost
                    if c2 > cost_cap:  # type: ignore[operator]
                        continue
                    target.setdefault(s2, []).append((c2, sp + simp, (seg, path)))
    final = [e for s, es in fronts[n].items() if top - s <= budget for e in es]
    if not final:
        return None
    key = (lambda e: (e[1], e[0])) if second else (lambda e: (e[0], e[1]))
    return _unpack(min(final, key=key)[2])


def _unpack(path: Any) -> tuple[list[str], list[tuple[int, int]]]:
    """``(decisions, spans)`` from a path of ``(segment, parent)`` cells."""
    segs: list[Segment] = []
    while path is not None:
        seg, path = path
        segs.append(seg)
    decisions: list[str] = []
    spans: list[tuple[int, int]] = []
    for seg in reversed(segs):
        decisions.extend([seg.decision] * (seg.last - seg.first + 1))
        if seg.span:
            spans.append((seg.first, seg.last))
    return decisions, spans


def solve(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[str],
    *,
    tolerance: float = 0.0,
    solver: str = "milp",
    max_span: int = 1,
) -> tuple[list[str], list[tuple[int, int]]] | None:
    """The simplest plan within ``tolerance`` of the least cost: ``(decisions, spans)``, or
    ``None`` when none fits. ``max_span > 1`` allows spans (solved by :func:`solve_chain`);
    otherwise ``solver`` picks the MILP or the per-block DP."""
    if max_span > 1 or solver == "chain":
        found = solve_chain(blocks, top, budget, allowed, max_span=max_span)
        if found is None:
            return None
        cap = _cap(predicted_cost(blocks, found[0], found[1]), tolerance)
        simple = solve_chain(blocks, top, budget, allowed, max_span=max_span, cost_cap=cap)
        return found if simple is None else simple
    one = solve_milp if solver == "milp" else solve_dp
    best = one(blocks, top, budget, allowed)
    if best is None:
        return None
    simplest = one(
        blocks, top, budget, allowed, cost_cap=_cap(predicted_cost(blocks, best), tolerance)
    )
    return (best if simplest is None else simplest), []


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
    blocks: Sequence[BlockCosts], top: int, allowed: Sequence[str], max_span: int
) -> tuple[list[str], list[tuple[int, int]]]:
    """A plan (with spans up to ``max_span`` blocks) of the smallest predicted activation peak."""
    n = len(blocks)
    segs = chain_segments(blocks, allowed, max(1, max_span))
    fronts: list[dict[int, tuple[int, tuple[Segment, ...]]]] = [{} for _ in range(n + 1)]
    fronts[0] = {0: (-(2**62), ())}
    for pos in range(n):
        best_peak: int | None = None
        for saved in sorted(fronts[pos], reverse=True):  # drop states saving less at no lower peak
            peak, path = fronts[pos][saved]
            if best_peak is not None and peak >= best_peak:
                continue
            best_peak = peak
            for seg in segs[pos]:
                p2 = max(peak, seg.peak - saved)
                s2 = saved + seg.saved
                old = fronts[seg.last + 1].get(s2)
                if old is None or p2 < old[0]:
                    fronts[seg.last + 1][s2] = (p2, (*path, seg))
    _, best = min(fronts[n].items(), key=lambda kv: max(kv[1][0], top - kv[0]))
    decisions: list[str] = []
    spans: list[tuple[int, int]] = []
    for seg in best[1]:
        decisions.extend([seg.decision] * (seg.last - seg.first + 1))
        if seg.span:
            spans.append((seg.first, seg.last))
    return decisions, spans


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
