"""The chain dynamic program: exact plans over single blocks and spans of consecutive blocks.

A plan cuts the chain of blocks into *segments*: a block alone under a decision
(``keep``, ``recompute``, ``selective``, ``offload``, ``split``) or a span of
2..``max_span`` consecutive blocks checkpointed as one region, the blocks inside it
plain (``keep``), checkpointed (``recompute``, ``split``: two nesting levels) or
selective (``selective``: the policy's saved outputs handed to the span), and on a
device, where the profile found a block's input free to move
(``BlockCosts.offload_input``), each span from it also with that input in host memory
until its own backward (``SpanKind.OFFLOADED`` rows). Every
activation term of a segment is ``term - s``, ``s`` the bytes the segments before
it saved (:class:`~remat.planner.types.Segment`, from :mod:`remat.planner.stepmodel`; this
module has no formula of its own), so a segment is summed up by
its ``peak``, ``saved`` and ``cost``, and a plan fits ``budget`` when every
segment's ``peak - s <= budget`` and ``top - s_n <= budget`` at the end.

This is the checkpointing chain dynamic program of Chen et al. 2016 ("Training
Deep Nets with Sublinear Memory Cost", arXiv:1604.06174) and of Griewank &
Walther's Revolve (ACM TOMS 26(1), 2000) restricted to two nesting levels, with
heterogeneous per-block costs and memory as in Beaumont et al. 2019 ("Optimal
checkpointing for heterogeneous chains", Rotor, arXiv:1911.13214), in the step
model's units. It is exact: nothing is rounded, states are pruned only by
dominance or by bounds that no optimal plan crosses.

Solving is two passes over the segment table:

1. **Backward** (:func:`cost_to_go`): for each position ``p`` the Pareto front of
   the suffix plans from ``p`` in (``need``: the bytes the prefix must have saved
   for the suffix to fit, ``cost``). A suffix needing less at no more cost
   dominates. ``need`` is clamped to the range of bytes a prefix can save at all
   (below the least it is always met; above the most it never is), which keeps
   the fronts small. Front 0 gives the least cost ``C*``, and every front gives
   the exact least cost to complete a prefix that saved ``s``: ``h(p, s)``.
2. **Forward** (:func:`simplest`): the simplest plan of cost at most a cap (``C*``
   plus the timing noise): states ``(saved, cost, simplicity)``, a state kept
   only when ``cost + h(p, saved) <= cap`` (it can still finish within the cap)
   and no other state saved at least as much at no more cost and simplicity.

Both passes are vectorized over the states with ``torch`` tensors on the CPU
(int64 bytes, float64 costs), so the Python work is per segment, not per state:
at most about 0.6 s for 100 blocks with spans of up to 16 on a 2-core machine (the
slowest case of ``benchmarks/solve_time.py``, 2026-11-23, with selective spans).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence

import torch

from .stepmodel import block_segment, options, span_segments
from .types import NEVER, SPAN_INNER, BlockCosts, Decision, Segment, Span, SpanKind

#: How complex a decision is (near-ties in cost go to the plan of the smaller sum).
COMPLEXITY = {
    Decision.KEEP: 0,
    Decision.SELECTIVE: 1,
    Decision.RECOMPUTE: 2,
    Decision.OFFLOAD: 3,
    Decision.SPLIT: 4,
}

#: A block inside a span counts this much more complex than the same decision alone.
SPAN_COMPLEXITY = 5

_INF = float("inf")


def simplicity(n: int, i: int, d: Decision) -> int:
    """Integer weight of decision ``d`` on block ``i`` of ``n``: complexity first, then position."""
    c = COMPLEXITY[d]
    return c * (n * (n + 1) // 2 + 1) + (i + 1 if c else 0)


@dataclasses.dataclass
class Segments:
    """Every segment of a chain: parallel lists (row ``k`` is one segment), tensors of the
    numbers, and the rows that start at / end before each position."""

    first: list[int]
    last: list[int]
    decision: list[Decision]
    span: list[SpanKind]
    peak: list[int]
    saved: list[int]
    cost: list[float]
    simp: list[int]
    starting: list[list[int]]  # rows whose first block is p
    ending: list[list[int]]  # rows whose last block is p - 1 (p = 1..n)
    columns: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def column(self, name: str) -> torch.Tensor:
        """``peak``, ``saved``, ``cost`` or ``simp`` as a tensor (made once)."""
        if name not in self.columns:
            dtype = torch.float64 if name == "cost" else torch.int64
            self.columns[name] = torch.tensor(getattr(self, name), dtype=dtype)
        return self.columns[name]

    def add(self, seg: Segment, simp: int) -> None:
        """Append the row of ``seg`` (of simplicity ``simp``)."""
        k = len(self.first)
        self.first.append(seg.first)
        self.last.append(seg.last)
        self.decision.append(seg.decision)
        self.span.append(seg.kind)
        self.peak.append(seg.peak)
        self.saved.append(seg.saved)
        self.cost.append(seg.cost)
        self.simp.append(simp)
        self.starting[seg.first].append(k)
        self.ending[seg.last + 1].append(k)


def span_end(
    chained: Sequence[bool] | None,
    kept_outputs: Sequence[bool] | None,
    a: int,
    n: int,
    max_span: int,
) -> int:
    """One past the last block a span from block ``a`` may take in.

    It stops before block ``i`` when block ``i`` does not receive block ``i - 1``'s output
    (``chained``), or when the model keeps block ``i - 2``'s output past block ``i - 1``
    (``kept_outputs``: a skip connection, a list of hidden states) and ``i - 2`` is in the
    span: the span frees what it passes from one block to the next, and refuses a model
    that keeps it.
    """
    for i in range(a + 1, min(n, a + max_span)):
        if chained is not None and not chained[i - 1]:
            return i
        if kept_outputs is not None and i - 2 >= a and kept_outputs[i - 2]:
            return i
    return min(n, a + max_span)


def segment_table(
    blocks: Sequence[BlockCosts],
    allowed: Sequence[Decision],
    max_span: int,
    chained: Sequence[bool] | None = None,
    kept_outputs: Sequence[bool] | None = None,
) -> Segments:
    """Every block alone under each allowed decision and every span of 2..``max_span``
    blocks under each allowed inner decision (and, where ``offload`` is allowed and the
    block's input can move, its offloaded variant), as the step model's segments
    (:func:`~remat.planner.stepmodel.block_segment`,
    :func:`~remat.planner.stepmodel.span_segments`: O(1) a span). A span joins block ``i``
    to block ``i + 1`` only where ``chained[i]`` (default: everywhere), and holds blocks
    ``i``, ``i + 1`` and ``i + 2`` together only where not ``kept_outputs[i]``
    (:func:`span_end`)."""
    n = len(blocks)
    w = n * (n + 1) // 2 + 1
    opts = options(blocks, allowed)
    t = Segments(
        [], [], [], [], [], [], [], [], [[] for _ in range(n + 1)], [[] for _ in range(n + 1)]
    )
    for a in range(n):
        for d in opts[a]:
            t.add(block_segment(blocks, a, d), simplicity(n, a, d))
        end = span_end(chained, kept_outputs, a, n, max_span)
        moves = Decision.OFFLOAD in allowed and blocks[a].offload_input > 0
        for d in SPAN_INNER:
            if d not in allowed or d not in opts[a]:
                continue
            simp = simplicity(n, a, d)
            plain = span_segments(blocks, a, end, d)
            moved = span_segments(blocks, a, end, d, offload=True) if moves else None
            for seg in plain:
                simp += simplicity(n, seg.last, d)
                weight = simp + SPAN_COMPLEXITY * w * (seg.last - a + 1)
                t.add(seg, weight)
                if moved is not None:
                    t.add(next(moved), weight + w)
    return t


def saved_range(t: Segments, n: int, budget: int) -> tuple[list[int], list[int]]:
    """The least bytes any prefix of ``p`` blocks saves (fitting or not), and the most a
    prefix that fits ``budget`` saves (``NEVER`` when none fits). The latter is exact by one
    number a position: saving more never makes a segment's terms larger, so the prefix
    saving the most continues wherever any prefix does."""
    lo: list[int | None] = [None] * (n + 1)
    hi = [NEVER] * (n + 1)
    lo[0] = hi[0] = 0
    for p in range(n):
        lp, hp = lo[p], hi[p]
        if lp is None:
            continue
        for k in t.starting[p]:
            e = t.last[k] + 1
            lo_e = lp + t.saved[k]
            lo[e] = lo_e if lo[e] is None else min(lo[e], lo_e)  # type: ignore[type-var]
            if hp != NEVER and hp >= t.peak[k] - budget:
                hi[e] = max(hi[e], hp + t.saved[k])
    return [0 if x is None else x for x in lo], hi


def _pareto(first: torch.Tensor, second: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Indices of the entries no other entry beats in both (smaller is better), by ``first``
    ascending and ``second`` strictly descending; of equal entries the first.

    One stable sort by ``first``: an entry is kept when its ``second`` is below every one
    before it, then of the kept ones with the same ``first`` only the last (the least)."""
    if width is not None and 0 <= width < 2**31 and first.numel():
        # all keys within ``width`` of the least: sorted as int32, twice as fast, same order
        f, order = torch.sort((first - first.min()).to(torch.int32), stable=True)
    else:
        f, order = torch.sort(first, stable=True)
    s = second[order]
    if s.numel() > 1:
        keep = torch.empty_like(s, dtype=torch.bool)
        keep[0] = True
        torch.lt(s[1:], torch.cummin(s, 0).values[:-1], out=keep[1:])
        kept = torch.nonzero(keep).flatten()
        order, f = order[kept], f[kept]
    last = torch.ones_like(f, dtype=torch.bool)
    last[:-1] = f[1:] != f[:-1]
    return order[last]


def _pairs(
    rows: list[int], source: list[int], size: list[int]
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every pair of a segment row and an entry of the front at the row's ``source``
    position: the distinct sources (in order of first use), and per pair the row, the
    entry's index in its front and its index in the sources' fronts concatenated."""
    sources: list[int] = []
    offset: dict[int, int] = {}
    total = 0
    for r in rows:
        a = source[r]
        if a not in offset:
            offset[a] = total
            sources.append(a)
            total += size[a]
    counts = [size[source[r]] for r in rows]
    starts, pair_total = [], 0
    for c in counts:
        starts.append(pair_total)
        pair_total += c
    i64 = torch.int64
    counts_t = torch.tensor(counts, dtype=i64)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=i64), counts_t, output_size=pair_total)
    at = torch.arange(pair_total, dtype=i64)
    local = at - torch.repeat_interleave(
        torch.tensor(starts, dtype=i64), counts_t, output_size=pair_total
    )
    base = torch.tensor([offset[source[r]] for r in rows], dtype=i64)
    flat = local + torch.repeat_interleave(base, counts_t, output_size=pair_total)
    return sources, row, local, flat


@dataclasses.dataclass
class CostToGo:
    """The backward fronts: per position ``need`` ascending and ``cost`` strictly descending,
    with each entry's first segment and its entry in the next front."""

    need: list[torch.Tensor]
    cost: list[torch.Tensor]
    seg: list[torch.Tensor]
    nxt: list[torch.Tensor]

    def least(self) -> float | None:
        """The least cost of a plan that fits (``None``: none does)."""
        need, cost = self.need[0], self.cost[0]
        k = int(torch.searchsorted(need, torch.tensor([0]), right=True)[0])
        return None if k == 0 else float(cost[k - 1])

    def h(self, p: int, saved: torch.Tensor) -> torch.Tensor:
        """The least cost to finish from position ``p`` after saving ``saved`` (inf: cannot)."""
        need, cost = self.need[p], self.cost[p]
        k = torch.searchsorted(need, saved, right=True)
        padded = torch.cat([torch.tensor([_INF], dtype=torch.float64), cost])
        return padded[k]

    def cheapest(self, t: Segments) -> list[int]:
        """The rows of a least-cost plan."""
        rows: list[int] = []
        need = self.need[0]
        j = int(torch.searchsorted(need, torch.tensor([0]), right=True)[0]) - 1
        p = 0
        n = len(self.need) - 1
        while p < n:
            k = int(self.seg[p][j])
            rows.append(k)
            j = int(self.nxt[p][j])
            p = t.last[k] + 1
        return rows


def _undominated_rows(t: Segments) -> list[list[int]]:
    """``t.starting`` less the rows the backward pass can skip: another row of the same
    blocks saves at least as much with no larger peak and either costs less or costs no
    more and comes first (so it would win every tie of the skipped row's pairs)."""
    out = []
    saved, peak, cost = t.saved, t.peak, t.cost
    for rows in t.starting:
        same: dict[int, list[int]] = {}
        for k in rows:
            same.setdefault(t.last[k], []).append(k)
        skip = set()
        for group in same.values():
            for k in group:
                for j in group:
                    if (
                        j != k
                        and saved[j] >= saved[k]
                        and peak[j] <= peak[k]
                        and (cost[j] < cost[k] or (cost[j] == cost[k] and j < k))
                    ):
                        skip.add(k)
                        break
        out.append([k for k in rows if k not in skip])
    return out


#: The backward pass slices each row's run of the next front when the runs average at least
#: this many entries (fewer: one gather for all, cheaper than a slice a row).
RUN_SLICES = 200


def cost_to_go(t: Segments, n: int, top: int, budget: int) -> CostToGo:
    """The backward pass (see the module docstring).

    Each row pairs with a contiguous run of the next front: entries whose ``need - saved``
    falls at or below the row's floor (its ``peak - budget``, or the least any prefix saves)
    all clamp to the floor, so of them only the last (the cheapest) can be on the front, and
    entries needing more than a prefix can save are cut. A run is sliced, shifted and
    clamped as a whole; only the entries kept on the front are traced back to their rows."""
    lo, hi = saved_range(t, n, budget)
    i64, f64 = torch.int64, torch.float64
    empty_i, empty_f = torch.empty(0, dtype=i64), torch.empty(0, dtype=f64)
    need = [empty_i] * (n + 1)
    cost = [empty_f] * (n + 1)
    seg = [empty_i] * (n + 1)
    nxt = [empty_i] * (n + 1)
    last = top - budget  # the end needs saved >= top - budget
    if last <= hi[n]:
        need[n] = torch.tensor([max(last, lo[n])], dtype=i64)
        cost[n] = torch.zeros(1, dtype=f64)
        seg[n] = torch.full((1,), -1, dtype=i64)
        nxt[n] = torch.full((1,), -1, dtype=i64)
    after = [t.last[k] + 1 for k in range(len(t.last))]
    useful = _undominated_rows(t)
    size = [0] * (n + 1)
    size[n] = need[n].numel()
    need_lo = [0] * (n + 1)  # each front's least and most need
    need_hi = [0] * (n + 1)
    if size[n]:
        need_lo[n] = need_hi[n] = int(need[n][0])
    for p in range(n - 1, -1, -1):
        if hi[p] == NEVER:
            continue
        rows = [k for k in useful[p] if size[after[k]] and t.peak[k] - budget <= hi[p]]
        if not rows:
            continue
        floor = [max(t.peak[k] - budget, lo[p]) for k in rows]
        begin = [0] * len(rows)
        end = [0] * len(rows)
        # one search for all rows: the sources' fronts concatenated, each shifted above the
        # one before (keys: need + at[q]), each query clamped into its source's block
        sources = list(dict.fromkeys(after[k] for k in rows))
        at, base = {}, {}
        key, entries = 0, 0
        for q in sources:
            at[q], base[q] = key - need_lo[q], entries
            key += need_hi[q] - need_lo[q] + 2
            entries += size[q]
        keys = torch.cat([need[q] for q in sources])
        if len(sources) > 1:
            keys += torch.repeat_interleave(
                torch.tensor([at[q] for q in sources]),
                torch.tensor([size[q] for q in sources]),
                output_size=entries,
            )
        else:
            keys += at[sources[0]]
        queries = []
        for i, k in enumerate(rows):
            q = after[k]
            a, least, most = at[q], at[q] + need_lo[q] - 1, at[q] + need_hi[q] + 1
            # the last entry at or below the floor (all those clamp to it), else the first;
            # the last entry a prefix can meet
            queries.append(min(max(floor[i] + t.saved[k] + a, least), most))
            queries.append(min(max(hi[p] + t.saved[k] + a, least), most))
        found = torch.searchsorted(keys, torch.tensor(queries), right=True).tolist()
        for i, k in enumerate(rows):
            b_q = base[after[k]]
            begin[i] = max(found[2 * i] - 1, b_q) - b_q
            end[i] = found[2 * i + 1] - b_q
        kept = [i for i in range(len(rows)) if end[i] > begin[i]]
        counts = [end[i] - begin[i] for i in kept]
        first = list(itertools.accumulate(counts, initial=0))
        total = first.pop()
        if not total:
            continue
        # pair index + shift = the entry's index in its front
        shift = [begin[i] - f for i, f in zip(kept, first)]
        if total >= RUN_SLICES * len(kept):  # long runs: slice each, shift all at once
            counts_t = torch.tensor(counts)
            nd = torch.cat([need[after[rows[i]]][begin[i] : end[i]] for i in kept])
            nd -= torch.repeat_interleave(
                torch.tensor([t.saved[rows[i]] for i in kept]), counts_t, output_size=total
            )
            # only a run's first entry can fall below its floor
            heads = torch.tensor(first)
            nd[heads] = torch.maximum(nd[heads], torch.tensor([floor[i] for i in kept]))
            c = torch.cat([cost[after[rows[i]]][begin[i] : end[i]] for i in kept])
            c += torch.repeat_interleave(
                torch.tensor([t.cost[rows[i]] for i in kept], dtype=f64),
                counts_t,
                output_size=total,
            )
        else:  # short runs: gather all at once
            sources = list(dict.fromkeys(after[rows[i]] for i in kept))
            base, off = {}, 0
            for q in sources:
                base[q] = off
                off += need[q].numel()
            which = torch.repeat_interleave(
                torch.arange(len(kept)), torch.tensor(counts), output_size=total
            )
            flat = (
                torch.arange(total)
                + torch.tensor([s + base[after[rows[i]]] for i, s in zip(kept, shift)])[which]
            )
            nd = (
                torch.cat([need[q] for q in sources])[flat]
                - torch.tensor([t.saved[rows[i]] for i in kept])[which]
            )
            nd = torch.maximum(nd, torch.tensor([floor[i] for i in kept])[which])
            c = (
                torch.cat([cost[q] for q in sources])[flat]
                + torch.tensor([t.cost[rows[i]] for i in kept], dtype=f64)[which]
            )
        kept = [rows[i] for i in kept]
        order = _pareto(nd, c, hi[p] - lo[p])
        need[p], cost[p] = nd[order], c[order]
        run = torch.searchsorted(torch.tensor(first, dtype=i64), order, right=True).sub_(1)
        seg[p] = torch.tensor(kept, dtype=i64)[run]
        nxt[p] = order + torch.tensor(shift, dtype=i64)[run]
        size[p] = need[p].numel()
        need_lo[p], need_hi[p] = int(need[p][0]), int(need[p][-1])
    return CostToGo(need, cost, seg, nxt)


#: Up to this many states, dominance is checked all pairs at once (k * k booleans).
PAIRWISE = 512


def _undominated(saved: torch.Tensor, cost: torch.Tensor, simp: torch.Tensor) -> torch.Tensor:
    """Indices (ascending) of the states no other state beats: saved more or equal, cost and
    simplicity less or equal; of equal states the first."""
    k = saved.numel()
    if k <= PAIRWISE:
        s, c, p = saved[None, :], cost[None, :], simp[None, :]  # j: columns, i: rows
        ge = (s >= saved[:, None]) & (c <= cost[:, None]) & (p <= simp[:, None])
        better = (s > saved[:, None]) | (c < cost[:, None]) | (p < simp[:, None])
        earlier = torch.ones(k, k, dtype=torch.bool).tril_(-1)  # j < i
        return torch.nonzero(~(ge & (better | earlier)).any(1)).flatten()
    return _staircase(saved, cost, simp)


def _staircase(saved: torch.Tensor, cost: torch.Tensor, simp: torch.Tensor) -> torch.Tensor:
    """:func:`_undominated` for many states: visited by saved descending (then cost, then
    simplicity ascending, then first; three stable sorts), the kept ones form a staircase
    (cost ascending, simplicity strictly descending), so each check is one binary search."""
    order = torch.sort(simp, stable=True).indices
    order = order[torch.sort(cost[order], stable=True).indices]
    order = order[torch.sort(saved[order], stable=True, descending=True).indices]
    costs: list[float] = []
    simps: list[int] = []
    out: list[int] = []
    for i, c, s in zip(order.tolist(), cost[order].tolist(), simp[order].tolist()):
        k = bisect.bisect_right(costs, c) - 1
        if k >= 0 and simps[k] <= s:
            continue
        out.append(i)
        k += 1
        m = k
        while m < len(costs) and simps[m] >= s:
            m += 1
        costs[k:m] = [c]
        simps[k:m] = [s]
    return torch.sort(torch.tensor(out, dtype=torch.int64)).values


class TooManyStates(Exception):
    """The forward pass kept more than its ``limit`` of states at one position."""


def simplest(
    t: Segments, n: int, budget: int, ctg: CostToGo, cap: float, limit: int | None = None
) -> list[int] | None:
    """The forward pass: the rows of the simplest plan of cost <= ``cap`` (then the cheapest,
    then the one that saves the most bytes by the end).

    Raises :class:`TooManyStates` when more than ``limit`` undominated states survive at
    one position (a wide cap over many near-equal plans); the caller then narrows the cap.
    """
    i64, f64 = torch.int64, torch.float64
    saved: list[torch.Tensor] = [torch.empty(0, dtype=i64)] * (n + 1)
    cost: list[torch.Tensor] = [torch.empty(0, dtype=f64)] * (n + 1)
    simp: list[torch.Tensor] = [torch.empty(0, dtype=i64)] * (n + 1)
    parent: list[torch.Tensor] = [torch.empty(0, dtype=i64)] * (n + 1)
    seg: list[torch.Tensor] = [torch.empty(0, dtype=i64)] * (n + 1)
    start = torch.zeros(1, dtype=i64)
    if not float(ctg.h(0, start)[0]) <= cap:
        return None
    saved[0], cost[0], simp[0] = start, torch.zeros(1, dtype=f64), torch.zeros(1, dtype=i64)
    parent[0] = seg[0] = torch.full((1,), -1, dtype=i64)
    peak, seg_saved, seg_cost, seg_simp = (t.column(c) for c in ("peak", "saved", "cost", "simp"))
    size = [0] * (n + 1)
    size[0] = 1
    for p in range(1, n + 1):
        rows = [k for k in t.ending[p] if size[t.first[k]]]
        if not rows:
            continue
        sources, row, local, flat = _pairs(rows, t.first, size)
        s0 = torch.cat([saved[a] for a in sources])[flat]
        ok = torch.nonzero(s0 >= peak[row] - budget).flatten()  # the segment fits
        row, local, flat = row[ok], local[ok], flat[ok]
        s = s0[ok] + seg_saved[row]
        c = torch.cat([cost[a] for a in sources])[flat] + seg_cost[row]
        ok = torch.nonzero(c + ctg.h(p, s) <= cap).flatten()  # the rest can fit within the cap
        if ok.numel() == 0:
            continue
        row, local, flat, s, c = row[ok], local[ok], flat[ok], s[ok], c[ok]
        sp = torch.cat([simp[a] for a in sources])[flat] + seg_simp[row]
        keep = _undominated(s, c, sp)
        saved[p], cost[p], simp[p] = s[keep], c[keep], sp[keep]
        parent[p], seg[p] = local[keep], row[keep]
        size[p] = keep.numel()
        if limit is not None and size[p] > limit:
            raise TooManyStates(f"{size[p]} states at block {p}")
    if simp[n].numel() == 0:
        return None
    # the simplest, then the cheapest, then the one saving the most (the lowest last term)
    ends = zip(simp[n].tolist(), cost[n].tolist(), (-saved[n]).tolist(), range(size[n]))
    return _walk(t, seg, parent, min(ends)[3])


def _walk(t: Segments, seg: list[torch.Tensor], parent: list[torch.Tensor], j: int) -> list[int]:
    """The rows of the plan ending in entry ``j`` of the last forward front, in chain order."""
    out: list[int] = []
    p = len(seg) - 1
    while p > 0:
        k = int(seg[p][j])
        out.append(k)
        j = int(parent[p][j])
        p = t.first[k]
    return out[::-1]


def unpack(t: Segments, rows: Sequence[int]) -> tuple[list[Decision], list[Span]]:
    """``(decisions, spans)`` of a plan given as segment rows in chain order."""
    decisions: list[Decision] = []
    spans: list[Span] = []
    for k in rows:
        decisions.extend([t.decision[k]] * (t.last[k] - t.first[k] + 1))
        if t.span[k] is not SpanKind.BLOCK:
            spans.append(Span(t.first[k], t.last[k], t.span[k] is SpanKind.OFFLOADED))
    return decisions, spans


def smallest(t: Segments, n: int, top: int) -> list[int]:
    """The rows of a plan of the smallest activation peak: a forward pass whose states are
    ``(saved, the largest term so far)``, a state kept when no other saved at least as much
    with no larger peak."""
    i64 = torch.int64
    saved: list[torch.Tensor] = [torch.zeros(1, dtype=i64)] + [torch.empty(0, dtype=i64)] * n
    worst: list[torch.Tensor] = [torch.full((1,), NEVER, dtype=i64)] + [saved[1]] * n
    parent: list[torch.Tensor] = [torch.full((1,), -1, dtype=i64)] + [saved[1]] * n
    seg: list[torch.Tensor] = [parent[0]] + [saved[1]] * n
    peak, seg_saved = t.column("peak"), t.column("saved")
    size = [1] + [0] * n
    for p in range(1, n + 1):
        rows = [k for k in t.ending[p] if size[t.first[k]]]
        if not rows:
            continue
        sources, row, local, flat = _pairs(rows, t.first, size)
        s0 = torch.cat([saved[a] for a in sources])[flat]
        w = torch.maximum(torch.cat([worst[a] for a in sources])[flat], peak[row] - s0)
        s = s0 + seg_saved[row]
        keep = _pareto(-s, w)
        saved[p], worst[p], parent[p], seg[p] = s[keep], w[keep], local[keep], row[keep]
        size[p] = keep.numel()
    final = torch.maximum(worst[n], top - saved[n])
    return _walk(t, seg, parent, int(torch.argmin(final)))  # the first of the least
