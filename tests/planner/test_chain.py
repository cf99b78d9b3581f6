"""The chain dynamic program (remat.planner.chain) (blocks and spans) against brute force and a plain reference DP."""

from __future__ import annotations

import itertools
import random

import pytest

from remat.planner.chain import (
    COMPLEXITY,
    NEVER,
    SPAN_COMPLEXITY,
    cost_to_go,
    segment_table,
    simplest,
    simplicity,
)
from remat.planner.perblock import solve_dp
from remat.planner.solve import smallest_chain, solve, solve_chain
from remat.planner.stepmodel import (
    block_segment,
    predicted_cost,
    predicted_peak,
    span_segment,
)
from remat.planner.types import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
    SPAN_INNER,
    SPLIT,
    BlockCosts,
)
from tests.support.chains import layouts, random_chain

pytestmark = pytest.mark.usefixtures("one_thread")


DECS = (KEEP, RECOMPUTE, SELECTIVE, SPLIT)


def heterogeneous_chain(seed: int, n: int, decs=DECS) -> tuple[list[BlockCosts], int]:
    """Heterogeneous blocks: some cannot split, a selective cache may hold more than keep,
    some blocks have no backward window, costs on a 0.1 grid (so ties happen)."""
    rng = random.Random(seed)
    live = rng.randint(500, 1500)
    blocks = []
    for i in range(n):
        keep = rng.randint(100, 400)
        retained = {
            "keep": keep,
            "selective": rng.randint(40, keep + 30),
            "recompute": rng.randint(5, 40),
            "split": rng.randint(5, 60),
            "offload": rng.randint(5, 40),
        }
        cost = {
            "keep": 0.0,
            "selective": rng.randint(1, 5) / 10,
            "recompute": rng.randint(5, 12) / 10,
            "split": rng.randint(10, 20) / 10,
            "offload": rng.randint(2, 15) / 10,
        }
        no_bwd = rng.random() < 0.1
        b = BlockCosts(
            name=f"blocks.{i}",
            retained={d: retained[d] for d in decs},
            fwd_excess={d: rng.randint(10, 150) for d in decs},
            bwd_excess={d: NEVER if no_bwd else rng.randint(20, 500) for d in decs},
            cost={d: cost[d] for d in decs},
            fwd_start=live,
            bwd_start=0,
        )
        if "split" in decs and rng.random() < 0.25:  # a block that cannot split
            del b.retained["split"], b.cost["split"]
        blocks.append(b)
        live += keep
    top = live + rng.randint(0, 300)
    for i, b in enumerate(blocks):
        b.bwd_start = sum(x.retained["keep"] for x in blocks[: i + 1]) + 800 + 30 * (n - i)
    return blocks, top


def _floor(blocks, top, decs, max_span):
    ds, sp = smallest_chain(blocks, top, decs, max_span)
    return ds, 0, sp


def weight(n, ds, spans, first=0):
    """A plan's simplicity, from its definition (``ds`` the decisions of blocks ``first..``)."""
    w = n * (n + 1) // 2 + 1
    total = sum(
        COMPLEXITY[d] * w + (i + 1 if COMPLEXITY[d] else 0) for i, d in enumerate(ds, first)
    )
    return total + sum(SPAN_COMPLEXITY * w * (z - a + 1) for a, z in spans)


def test_segment_table_equals_the_step_model_segments():
    for seed in range(20):
        blocks, _ = heterogeneous_chain(seed, 12)
        t = segment_table(blocks, DECS, 16)
        for k in range(len(t.first)):
            a, z, d = t.first[k], t.last[k], t.decision[k]
            seg = span_segment(blocks, a, z, d) if t.span[k] else block_segment(blocks, a, d)
            assert (t.peak[k], t.saved[k], t.cost[k]) == (seg.peak, seg.saved, seg.cost)
            assert t.simp[k] == weight(12, [d] * (z - a + 1), [(a, z)] if t.span[k] else [], a)
        # every span of every length that the blocks allow, and nothing else
        spans = {(t.first[k], t.last[k], t.decision[k]) for k in range(len(t.first)) if t.span[k]}
        expected = {
            (a, z, d)
            for d in SPAN_INNER
            for a in range(12)
            for z in range(a + 1, min(12, a + 16))
            if all(d in blocks[j].cost for j in range(a, z + 1))
        }
        assert spans == expected


@pytest.mark.parametrize("seed", range(40))
def test_chain_dp_finds_the_brute_force_optimum_and_the_simplest_plan_within_the_cap(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    decs = DECS if seed % 2 else (KEEP, RECOMPUTE, SELECTIVE, OFFLOAD, SPLIT)
    blocks, top = heterogeneous_chain(seed, n, decs)
    max_span = rng.choice([1, 2, 3, 16])
    plans = list(layouts(blocks, decs, max_span))
    peaks = [predicted_peak(blocks, top, ds, 0, sp) for ds, sp in plans]
    costs = [predicted_cost(blocks, ds, sp) for ds, sp in plans]
    lo, hi = min(peaks), max(peaks)
    assert predicted_peak(blocks, top, *_floor(blocks, top, decs, max_span)) == lo
    for budget in sorted({lo - 1, lo, lo + (hi - lo) // 5, (lo + hi) // 2, hi}):
        fits = [i for i, pk in enumerate(peaks) if pk <= budget]
        found = solve_chain(blocks, top, budget, decs, max_span=max_span)
        if not fits:
            assert found is None
            assert solve(blocks, top, budget, decs, solver="chain", max_span=max_span) is None
            continue
        best = min(costs[i] for i in fits)
        assert found is not None
        assert predicted_peak(blocks, top, found[0], 0, found[1]) <= budget
        assert predicted_cost(blocks, *found) == pytest.approx(best, abs=1e-9)
        for tolerance in (0.0, 0.15, 0.5):
            cap = best + tolerance + 1e-9
            simplest_weight = min(weight(n, *plans[i]) for i in fits if costs[i] <= cap)
            ds, sp = solve(
                blocks, top, budget, decs, tolerance=tolerance, solver="chain", max_span=max_span
            )
            assert predicted_peak(blocks, top, ds, 0, sp) <= budget
            assert predicted_cost(blocks, ds, sp) <= cap
            assert weight(n, ds, sp) == simplest_weight


# ---------------------------------------------------------------- a plain reference DP


def reference_chain(blocks, top, budget, allowed, max_span, cost_cap=None):
    """The chain DP without vectorization, bounds or cross-state pruning: per position a
    dict ``saved -> [(cost, simplicity, plan)]``, each list pruned to its Pareto front."""
    n = len(blocks)
    w = n * (n + 1) // 2 + 1
    segs = [[] for _ in range(n)]
    for a in range(n):
        for d in allowed:
            if d in blocks[a].cost:
                segs[a].append(block_segment(blocks, a, d))
        for d in SPAN_INNER:
            if d not in allowed:
                continue
            for z in range(a + 1, min(n, a + max_span)):
                if any(d not in blocks[j].cost for j in range(a, z + 1)):
                    break
                segs[a].append(span_segment(blocks, a, z, d))
    fronts = [{} for _ in range(n + 1)]
    fronts[0] = {0: [(0.0, 0, ())]}
    for pos in range(n):
        for saved, entries in fronts[pos].items():
            for seg in segs[pos]:
                if seg.peak - saved > budget:
                    continue
                simp = sum(simplicity(n, i, seg.decision) for i in range(seg.first, seg.last + 1))
                if seg.span:
                    simp += SPAN_COMPLEXITY * w * (seg.last - seg.first + 1)
                into = fronts[seg.last + 1].setdefault(saved + seg.saved, [])
                for cost, sp, path in entries:
                    c2 = cost + seg.cost
                    if cost_cap is None or c2 <= cost_cap:
                        into.append((c2, sp + simp, (*path, seg)))
        for e in range(pos + 1, n + 1):
            for s2, entries in fronts[e].items():
                fronts[e][s2] = _front(entries, cost_cap is not None)
    final = [e for s, es in fronts[n].items() if top - s <= budget for e in es]
    if not final:
        return None
    if cost_cap is None:
        return min(final, key=lambda e: (e[0], e[1]))
    return min(final, key=lambda e: (e[1], e[0]))


def _front(entries, by_simplicity):
    if not by_simplicity:
        return [min(entries, key=lambda e: (e[0], e[1]))]
    out, simps = [], []
    for e in sorted(entries, key=lambda e: (e[0], e[1])):
        if not simps or e[1] < simps[-1]:
            out.append(e)
            simps.append(e[1])
    return out


@pytest.mark.parametrize("seed", range(10))
def test_chain_dp_matches_the_plain_reference_dp_on_longer_chains(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(7, 11)
    blocks, top = heterogeneous_chain(100 + seed, n)
    max_span = rng.choice([2, 4, 16])
    t = segment_table(blocks, DECS, max_span)
    ds, sp = smallest_chain(blocks, top, DECS, max_span)
    lo = predicted_peak(blocks, top, ds, 0, sp)
    hi = predicted_peak(blocks, top, ["keep"] * n)
    for budget in (lo + (hi - lo) // 6, (lo + hi) // 2, hi):
        ref = reference_chain(blocks, top, budget, DECS, max_span)
        ctg = cost_to_go(t, n, top, budget)
        if ref is None:
            assert ctg.least() is None
            continue
        assert ctg.least() == pytest.approx(ref[0], abs=1e-9)
        cap = ref[0] + 0.3 + 1e-9  # slack for float sums in another order, as solve() has
        ref2 = reference_chain(blocks, top, budget, DECS, max_span, cost_cap=cap)
        rows = simplest(t, n, budget, ctg, cap)
        assert rows is not None
        assert sum(t.simp[k] for k in rows) == ref2[1]


def test_spans_join_only_chained_blocks():
    blocks, top = heterogeneous_chain(3, 8)  # every block can be recomputed
    chained = [True, True, False, True, True, True, False]
    t = segment_table(blocks, DECS, 16, chained)
    spans = {(t.first[k], t.last[k]) for k in range(len(t.first)) if t.decision[k] == "recompute"}
    expected = {(a, z) for a in range(8) for z in range(a, 8) if all(chained[a:z])}
    assert spans == expected
    ds, sp = smallest_chain(blocks, top, DECS, 16, chained)
    assert sp and all(all(chained[a:z]) for a, z in sp)


def test_spans_never_hold_an_output_the_model_keeps_with_the_two_blocks_after_it():
    # held[i]: the model keeps block i's output past block i + 1 (a U-Net skip): spans may
    # end at i + 1 or start after i, never hold i, i + 1 and i + 2 together
    blocks, top = heterogeneous_chain(5, 6)
    held = [False, True, False, True, False, False]
    t = segment_table(blocks, DECS, 16, None, held)
    for d in (KEEP, RECOMPUTE, SELECTIVE, SPLIT):
        spans = {(t.first[k], t.last[k]) for k in range(len(t.first)) if t.decision[k] == d}
        spans = {(a, z) for a, z in spans if z > a}
        allowed = {
            (a, z)
            for a in range(6)
            for z in range(a + 1, 6)
            if all(blocks[j].cost.get(d) is not None for j in range(a, z + 1))
            and not any(held[j] for j in range(a, z - 1))
        }
        assert spans <= allowed, d
        if d == "recompute":  # every block can be recomputed: exactly the allowed ones
            assert spans == allowed and (1, 2) in spans and (1, 3) not in spans
    for budget_frac in (0.2, 0.6):
        ds, sp = smallest_chain(blocks, top, DECS, 16, None, held)
        assert all(not any(held[j] for j in range(a, z - 1)) for a, z in sp)
        lo = predicted_peak(blocks, top, ds, 0, sp)
        hi = predicted_peak(blocks, top, ["keep"] * 6)
        budget = int(lo + budget_frac * (hi - lo))
        found = solve(blocks, top, budget, DECS, solver="chain", max_span=16, kept_outputs=held)
        assert found is not None
        assert all(not any(held[j] for j in range(a, z - 1)) for a, z in found[1])
        # the least cost among the layouts that respect held: brute force
        plans = [
            (ds2, sp2)
            for ds2, sp2 in layouts(blocks, DECS, 16)
            if all(not any(held[j] for j in range(a, z - 1)) for a, z in sp2)
        ]
        best = min(
            predicted_cost(blocks, ds2, sp2)
            for ds2, sp2 in plans
            if predicted_peak(blocks, top, ds2, 0, sp2) <= budget
        )
        assert predicted_cost(blocks, *found) == pytest.approx(best, abs=1e-9)


@pytest.mark.slow  # 7.5 s for both
@pytest.mark.parametrize("limit", [1, 3])
def test_too_many_states_in_the_second_stage_fall_back_to_a_least_cost_plan(monkeypatch, limit):
    import remat.planner.solve as solve_module

    monkeypatch.setattr(solve_module, "STATE_LIMIT", limit)
    for seed in range(6):
        blocks, top = heterogeneous_chain(seed, 6)
        plans = list(layouts(blocks, DECS, 16))
        peaks = [predicted_peak(blocks, top, ds, 0, sp) for ds, sp in plans]
        costs = [predicted_cost(blocks, ds, sp) for ds, sp in plans]
        budget = (min(peaks) + max(peaks)) // 2
        best = min(c for c, pk in zip(costs, peaks) if pk <= budget)
        ds, sp = solve(blocks, top, budget, DECS, tolerance=0.5, solver="chain", max_span=16)
        assert predicted_peak(blocks, top, ds, 0, sp) <= budget
        # the narrowed cap (least cost) or the first stage's plan: the least cost either way
        assert predicted_cost(blocks, ds, sp) == pytest.approx(best, abs=1e-9)


def test_a_span_of_mixed_decisions_is_refused_with_what_to_do():
    from remat.planner.stepmodel import layout

    blocks, _ = heterogeneous_chain(0, 3)
    with pytest.raises(ValueError, match=r"got \['keep', 'recompute'\] for blocks 0..1; give"):
        layout(blocks, ["keep", "recompute", "keep"], [(0, 1)])


# ------------------------------------------------------ spans whose input is offloaded

OFF_DECS = (KEEP, RECOMPUTE, SELECTIVE, OFFLOAD, SPLIT)


def offload_chain(seed: int, n: int) -> tuple[list[BlockCosts], int]:
    """A random chain where some blocks' inputs can be offloaded by a span starting there."""
    blocks, top = heterogeneous_chain(seed, n, OFF_DECS)
    rng = random.Random(seed + 1000)
    for b in blocks[:-1]:
        if rng.random() < 0.7:
            b.offload_input = rng.randint(20, 300)
    return blocks, top


def test_segment_table_offloaded_spans_equal_the_step_model_segments():
    from remat.planner.types import SpanKind

    OFFLOADED = SpanKind.OFFLOADED

    for seed in range(20):
        blocks, _ = offload_chain(seed, 10)
        t = segment_table(blocks, OFF_DECS, 16)
        rows = [k for k in range(len(t.first)) if t.span[k] == OFFLOADED]
        for k in rows:
            a, z, d = t.first[k], t.last[k], t.decision[k]
            seg = span_segment(blocks, a, z, d, offload=True)
            assert (t.peak[k], t.saved[k], t.cost[k]) == (seg.peak, seg.saved, seg.cost)
            plain = span_segment(blocks, a, z, d)
            assert seg.saved == plain.saved + blocks[a].offload_input
            assert seg.peak <= plain.peak
        # every span from a block whose input can be offloaded, and nothing else
        got = {(t.first[k], t.last[k], t.decision[k]) for k in rows}
        plain_spans = {
            (t.first[k], t.last[k], t.decision[k]) for k in range(len(t.first)) if t.span[k] == 1
        }
        assert got == {s for s in plain_spans if blocks[s[0]].offload_input > 0}
        # no offloaded spans without the offload decision (not measured on a device)
        t2 = segment_table(blocks, DECS, 16)
        assert OFFLOADED not in t2.span


@pytest.mark.parametrize("seed", range(16))
def test_chain_dp_with_offloaded_spans_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    blocks, top = offload_chain(seed, n)
    plans = []
    for ds, sp in layouts(blocks, OFF_DECS, 16):  # each span also with its input offloaded
        options = [[s] + ([(*s, 1)] if blocks[s[0]].offload_input > 0 else []) for s in sp]
        plans += [(ds, list(choice)) for choice in itertools.product(*options)]
    peaks = [predicted_peak(blocks, top, ds, 0, sp) for ds, sp in plans]
    costs = [predicted_cost(blocks, ds, sp) for ds, sp in plans]
    lo, hi = min(peaks), max(peaks)
    assert predicted_peak(blocks, top, *_floor(blocks, top, OFF_DECS, 16)) == lo
    for budget in sorted({lo - 1, lo, lo + (hi - lo) // 5, (lo + hi) // 2, hi}):
        fits = [i for i, pk in enumerate(peaks) if pk <= budget]
        found = solve_chain(blocks, top, budget, OFF_DECS, max_span=16)
        if not fits:
            assert found is None
            continue
        assert found is not None
        assert predicted_peak(blocks, top, found[0], 0, found[1]) <= budget
        assert predicted_cost(blocks, *found) == pytest.approx(min(costs[i] for i in fits))


# ---------------------------------------------------------------- spans against brute force, three decisions


def _layouts(n, decs):
    def rec(i):
        if i == n:
            yield []
            return
        for d in decs:
            for rest in rec(i + 1):
                yield [(i, i, d, False)] + rest
        for z in range(i + 1, n):
            for d in inner:
                for rest in rec(z + 1):
                    yield [(i, z, d, True)] + rest

    # a span of kept or selective blocks is recomputed, so it needs 'recompute' measured
    inner = [d for d in decs if d in SPAN_INNER and ("recompute" in decs or d == "split")]

    for lay in rec(0):
        ds = [d for a, z, d, _ in lay for _ in range(a, z + 1)]
        yield ds, [(a, z) for a, z, _, span in lay if span]


@pytest.mark.parametrize("seed", range(5))
def test_chain_dp_with_spans_finds_the_brute_force_optimum(seed):
    decs = (KEEP, RECOMPUTE, SELECTIVE)
    blocks, top = random_chain(seed, 5)
    plans = list(_layouts(5, decs))
    peaks = [predicted_peak(blocks, top, ds, 0, sp) for ds, sp in plans]
    lo, hi = min(peaks), max(peaks)
    ds, sp = smallest_chain(blocks, top, decs, 16)
    assert predicted_peak(blocks, top, ds, 0, sp) == lo
    for budget in sorted({lo, lo + (hi - lo) // 4, (lo + hi) // 2, hi}):
        best = min(predicted_cost(blocks, *p) for p, pk in zip(plans, peaks) if pk <= budget)
        ds, sp = solve_chain(blocks, top, budget, decs, max_span=16)
        assert predicted_peak(blocks, top, ds, 0, sp) <= budget
        assert predicted_cost(blocks, ds, sp) == pytest.approx(best)
        one = solve_chain(blocks, top, budget, decs, max_span=1)
        per_block = solve_dp(blocks, top, budget, decs)
        assert (one is None) == (per_block is None)
        if one is not None:
            assert not one[1]
            assert predicted_cost(blocks, one[0]) == pytest.approx(
                predicted_cost(blocks, per_block)
            )
