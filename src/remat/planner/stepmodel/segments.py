"""The segments a plan cuts the chain into: a block alone, or a span of blocks (one
running-sum accumulator per kind of span, read by the reference evaluation and by the chain
dynamic program alike); see :mod:`remat.planner.stepmodel`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from ..types import (
    KEEP,
    NEVER,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
    SPAN_INNER,
    BlockCosts,
    Decision,
    Phase,
    Segment,
    Span,
    SpanKind,
    SpanLike,
    Where,
)


def options(blocks: Sequence[BlockCosts], allowed: Sequence[Decision]) -> list[list[Decision]]:
    """For each block, the allowed decisions it was measured under (and may take)."""
    return [[d for d in allowed if d in b.retained and d in b.cost] for b in blocks]


def input_offload_cost(blocks: Sequence[BlockCosts], a: int) -> float:
    """What offloading block ``a``'s input costs: its bytes at the per-byte cost of the
    ``offload`` decision (the median over blocks of ``cost[offload]`` per byte it moves to
    host memory, ``retained[keep] - retained[offload]``); 0 without that decision (FLOPs:
    copies do no arithmetic)."""
    rates = sorted(
        b.cost[OFFLOAD] / (b.retained[KEEP] - b.retained[OFFLOAD])
        for b in blocks
        if OFFLOAD in b.cost and b.retained.get(KEEP, 0) > b.retained.get(OFFLOAD, 0)
    )
    if not rates:
        return 0.0
    return float(blocks[a].offload_input * rates[len(rates) // 2])


def left_in_span(blocks: Sequence[BlockCosts], j: int, d: Decision) -> int:
    """What block ``j`` (not the chain's last) under ``d`` leaves alive inside a span besides
    the output it hands on (the next block's input): what its checkpoint holds apart from
    inputs and outputs (the copies of its buffers, BatchNorm's statistics), which the span
    holds to its backward's end; 0 for blocks without buffers."""
    return max(0, blocks[j].retained[d] - blocks[j + 1].input_bytes)


@dataclasses.dataclass(frozen=True)
class BlockTerms:
    """A block alone under one decision, as linear terms: its forward term is ``forward_start
    + forward_excess - saved(i-1)``, its backward term ``backward_start + backward_excess -
    saved(i)``, where ``saved(i)`` is what blocks ``0..i`` saved (this block: ``saves``)."""

    forward_start: int
    forward_excess: int
    backward_start: int
    backward_excess: int
    saves: int
    cost: float


def block_terms(b: BlockCosts, d: Decision) -> BlockTerms:
    """Block ``b`` alone under ``d`` (see the module docstring for its two terms)."""
    saves = b.retained[KEEP] - b.retained[d]
    return BlockTerms(
        b.fwd_start, b.fwd_excess[d], b.bwd_start, b.bwd_excess[d], saves, float(b.cost[d])
    )


def block_segment(blocks: Sequence[BlockCosts], i: int, d: Decision) -> Segment:
    """Block ``i`` alone under ``d``: the larger of its two terms (:func:`block_terms`)."""
    b = blocks[i]
    t = block_terms(b, d)
    fwd = t.forward_start + t.forward_excess
    bwd = t.backward_start - t.saves + t.backward_excess
    where = Where(Phase.FORWARD, b.name) if fwd >= bwd else Where(Phase.BACKWARD, b.name)
    return Segment(i, i, d, SpanKind.BLOCK, max(fwd, bwd), where, t.saves, t.cost)


class _Max:
    """The first largest of a sequence of terms, and where it is (a ``(phase, index)``)."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value = NEVER
        self.at: tuple[Phase, int] = (Phase.FORWARD, -1)

    def see(self, v: int, phase: Phase, i: int) -> None:
        if v > self.value:
            self.value, self.at = v, (phase, i)

    def copy(self) -> _Max:
        c = _Max()
        c.value, c.at = self.value, self.at
        return c


def _first_max(blocks: Sequence[BlockCosts], *groups: _Max) -> tuple[int, Where]:
    """The first largest of terms seen in ``groups`` order (ties go to the earlier)."""
    best = groups[0]
    for g in groups[1:]:
        if g.value > best.value:
            best = g
    phase, i = best.at
    return best.value, Where(phase, blocks[i].name)


def span_segments(
    blocks: Sequence[BlockCosts], a: int, end: int, d: Decision, offload: bool = False
) -> Iterator[Segment]:
    """The spans ``a..z`` for ``z = a+1 .. end-1`` with inner decision ``d``, in order, each
    in O(1) from running sums (stops early at a block not measured under what ``d`` needs).

    With ``offload``, each span's variant whose input is kept in host memory until its own
    backward asks for it (``apply_span(offload_inputs=True, prefetch=False)``), which frees
    ``F = offload_input[a]`` on the device once block ``a`` returns (the profile offers
    ``F > 0`` only where nothing else holds it then): the forward terms of blocks
    ``a+1..z`` are lower by ``F``, the span saves ``F`` more for every segment after it
    (their forward and backward come before the span's backward, which brings the input
    back, so its own backward terms are unchanged), and it costs the two copies
    (:func:`input_offload_cost`). Spans are exact for the blocks' terms; see
    :func:`span_segment` for each kind's terms.
    """
    freed = _freed(blocks, a, offload)
    if d is KEEP:
        runs = _keep_spans(blocks, a, end, freed)
    elif d is SELECTIVE:
        runs = _selective_spans(blocks, a, end, freed)
    else:
        runs = _nested_spans(blocks, a, end, d, freed)
    if not offload:
        yield from runs
        return
    moved = input_offload_cost(blocks, a)
    for seg in runs:
        yield dataclasses.replace(seg, cost=seg.cost + moved)


def span_segment(
    blocks: Sequence[BlockCosts], a: int, z: int, d: Decision, offload: bool = False
) -> Segment:
    """Blocks ``a..z`` as one checkpointed region, each block inside it as ``d``.

    ``recompute`` / ``split`` (nested: each block checkpointed inside the span as well).
    In forward only the span's input is kept: block ``i``'s output lives only while block
    ``i+1`` runs. Backward of block ``z`` first recomputes blocks ``a..z-1`` (early stop
    before ``z``), which brings back the inputs of blocks ``a+1..z`` as the inner regions'
    inputs; from there each block's backward is that of a block checkpointed as ``d``.
    With ``R_j`` = ``retained[j][d]`` and ``s`` the bytes saved before the span:

    * forward of block ``i``: ``fwd_start[i] - s - sum_{j<i}(retained[j][keep] - R_j)
      - sum_{j<i-1} R_j + fwd_excess[i][d]`` (sums from ``a``);
    * recompute of block ``i < z`` (at block ``z``'s backward):
      ``bwd_start[z] - s_z - sum_{i<=j<z} R_j + fwd_excess[i][d]``, with ``s_z`` what
      blocks ``a..z`` under ``d`` alone would have saved;
    * backward of block ``i``: as block ``i`` alone under ``d``;
    * it saves ``sum_{a<=j<=z}(retained[j][keep] - R_j) + sum_{a<=j<z} R_j``;
    * it costs ``sum cost[j][d]`` plus blocks ``a..z-1`` once more (``cost[j][recompute]``).

    ``keep`` (the blocks plain inside). Forward is that of a span with ``recompute`` inside
    (``R_j = retained[j][recompute]``, a block's input). Backward of block ``z`` recomputes
    blocks ``a..z`` at once with everything they save (early stop after the last tensor
    block ``z`` saves), so from there the blocks stand as in the ``keep`` line, block ``z``
    as a block recomputed alone:

    * recompute of block ``i < z``: ``bwd_start[z] - saved + sum_{a<=j<i} retained[j][keep]
      + fwd_excess[i][keep]``;
    * backward of block ``z``: ``bwd_start[z] - (retained[z][keep] - R_z) +
      bwd_excess[z][recompute]``; of block ``i < z``: ``bwd_start[i] + bwd_excess[i][keep]``,
      each also holding the span's input where the model keeps it to forward's end
      (``held_to_end[a]``, which the ``keep`` line frees there);
    * it saves ``sum_{a<=j<=z} retained[j][keep] - R_z`` and costs
      ``sum cost[j][recompute]`` (each block recomputed once).

    ``selective`` (each block a selective region inside the span, its saved outputs handed
    to the span). With ``K_j``, ``S_j``, ``R_j`` = ``retained[j]`` under ``keep``,
    ``selective`` and ``recompute``: in forward a block holds its saved outputs until it
    returns and then leaves only its output (``R_j``); backward of block ``z`` first reruns
    blocks ``a..z`` under the policy (each brings back its input and its saved outputs:
    ``S_j``), and from there the blocks are selective blocks:

    * forward of block ``i``: ``fwd_start[i] - s - sum_{a<=j<i} K_j + R_{i-1} +
      fwd_excess[i][selective]`` (no ``R`` term for ``i = a``);
    * recompute of block ``j``: ``bwd_start[z] - s - saved + sum_{a<=k<j} S_k +
      fwd_excess[j][selective]``, ``j = a..z``;
    * backward of block ``i``: as block ``i`` alone under ``selective``;
    * it saves ``sum_{a<=j<=z} K_j - R_z`` and costs ``sum cost[j][selective]`` plus
      blocks ``a..z`` once more (``cost[j][recompute]``).

    What a block's checkpoint holds besides its input and output (the copies of its buffers
    that put BatchNorm's statistics back for the recompute: ``L_j``, :func:`left_in_span`,
    under ``recompute`` for ``keep`` and ``selective`` spans) the span holds for each of its
    blocks to its backward's end: a block ``j < z`` leaves ``L_j`` in forward, not nothing,
    so the span saves ``sum_{a<=j<z} L_j`` less, and in a ``keep`` span the backward terms
    hold them too (those of blocks ``i < z`` also ``L_z``; none for the chain's last block).

    ``offload``: see :func:`span_segments`.
    """
    if z <= a:
        raise ValueError(f"a span needs two or more blocks, got blocks {a}..{z}.")
    for seg in span_segments(blocks, a, z + 1, d, offload):
        if seg.last == z:
            return seg
    raise ValueError(
        f"blocks {a}..{z} cannot form a span with inner decision {d!r}: a block "
        "was not measured under it."
    )


def _freed(blocks: Sequence[BlockCosts], a: int, offload: bool) -> int:
    if not offload:
        return 0
    if blocks[a].offload_input <= 0:
        raise ValueError(
            f"a span from {blocks[a].name!r} cannot offload its input: the profile found it "
            "held by something else once the block returns (or it was measured on CPU, or "
            "without 'offload' among the decisions); drop the span's offload."
        )
    return blocks[a].offload_input


def _nested_spans(
    blocks: Sequence[BlockCosts], a: int, end: int, d: Decision, freed: int
) -> Iterator[Segment]:
    """Spans with each block checkpointed inside as ``d`` (``recompute``, ``split``)."""
    kind = SpanKind.OFFLOADED if freed else SpanKind.SPAN
    terms = _Max()  # forward and backward terms of blocks a..z, in order
    inner = 0  # sum_{a<=j<i} (retained[j][keep] - R_j): saved by the blocks alone
    kept = 0  # P_i = sum_{a<=j<i} R_j
    kept_prev = 0  # P_{i-1}
    rec = _Max()  # max_{a<=j<i} P_j + fwd_excess[j][d]
    cost_d = 0.0  # sum_{a<=j<=i} cost[j][d]
    cost_r = 0.0  # sum_{a<=j<i} cost[j][recompute]
    for i in range(a, end):
        bi = blocks[i]
        if d not in bi.cost or d not in bi.retained:
            return
        r = bi.retained[d]
        fwd = bi.fwd_start - inner - kept_prev + bi.fwd_excess[d] - (freed if i > a else 0)
        terms.see(fwd, Phase.FORWARD, i)
        inner += bi.retained[KEEP] - r
        terms.see(bi.bwd_start - inner + bi.bwd_excess[d], Phase.BACKWARD, i)
        cost_d += bi.cost[d]
        if i > a:
            recompute = rec.copy()
            recompute.value = bi.bwd_start - inner - kept + rec.value
            peak, where = _first_max(blocks, terms, recompute)
            yield Segment(a, i, d, kind, peak, where, inner + kept + freed, cost_d + cost_r)
        rec.see(kept + bi.fwd_excess[d], Phase.RECOMPUTE, i)
        cost_r += bi.cost.get(RECOMPUTE, 0.0)
        kept_prev = kept
        kept += r - (left_in_span(blocks, i, d) if i + 1 < len(blocks) else 0)


def _keep_spans(
    blocks: Sequence[BlockCosts], a: int, end: int, freed: int
) -> Iterator[Segment]:
    """Spans with the blocks plain inside (``inner="keep"``)."""
    kind = SpanKind.OFFLOADED if freed else SpanKind.SPAN
    fwd = _Max()  # the forward terms of blocks a..z
    inner = 0  # sum_{a<=j<i} (retained[j][keep] - R_j), R = retained[recompute]
    kept = 0  # P_i = sum_{a<=j<i} R_j
    kept_prev = 0  # P_{i-1}
    held = blocks[a].held_to_end  # the span's input, freed at forward's end under keep
    restored = 0  # sum_{a<=j<i} retained[j][keep]
    rec = _Max()  # max_{a<=j<i} restored_j + fwd_excess[j][keep]
    bwd = _Max()  # max_{a<=j<i} bwd_start[j] + bwd_excess[j][keep] + held
    cost = 0.0  # sum_{a<=j<=i} cost[j][recompute]
    left = 0  # sum_{a<=j<i} L_j, L = left_in_span(.., recompute): alive to the span's backward end
    for i in range(a, end):
        bi = blocks[i]
        if RECOMPUTE not in bi.cost or RECOMPUTE not in bi.retained:
            return
        r = bi.retained[RECOMPUTE]
        mine = left_in_span(blocks, i, RECOMPUTE) if i + 1 < len(blocks) else 0
        v = bi.fwd_start - inner - kept_prev + bi.fwd_excess[RECOMPUTE] - (freed if i > a else 0)
        fwd.see(v, Phase.FORWARD, i)
        inner += bi.retained[KEEP] - r
        cost += bi.cost[RECOMPUTE]
        if i > a:
            saved = inner + kept
            recompute = rec.copy()
            recompute.value = bi.bwd_start - saved + rec.value
            last = _Max()
            last.see(
                bi.bwd_start - (bi.retained[KEEP] - r) + bi.bwd_excess[RECOMPUTE] + held + left,
                Phase.BACKWARD,
                i,
            )
            inside = bwd.copy()
            inside.value += left + mine
            peak, where = _first_max(blocks, fwd, recompute, last, inside)
            yield Segment(a, i, KEEP, kind, peak, where, saved + freed, cost)
        rec.see(restored + bi.fwd_excess[KEEP], Phase.RECOMPUTE, i)
        restored += bi.retained[KEEP]
        bwd.see(bi.bwd_start + bi.bwd_excess[KEEP] + held, Phase.BACKWARD, i)
        kept_prev = kept
        kept += r - mine
        left += mine


def _selective_spans(
    blocks: Sequence[BlockCosts], a: int, end: int, freed: int
) -> Iterator[Segment]:
    """Spans with each block selective inside (``inner="selective"``)."""
    kind = SpanKind.OFFLOADED if freed else SpanKind.SPAN
    terms = _Max()  # forward and backward terms of blocks a..z, in order
    kept = 0  # sum_{a<=j<i} retained[j][keep]
    inner = 0  # sum_{a<=j<=i} (retained[j][keep] - retained[j][selective])
    restored = 0  # sum_{a<=j<i} retained[j][selective]
    rec = _Max()  # max_{a<=j<=i} restored_j + fwd_excess[j][selective]
    cost = 0.0  # sum_{a<=j<=i} cost[j][selective]
    cost_r = 0.0  # sum_{a<=j<=i} cost[j][recompute]
    prev = 0  # retained[i - 1][recompute] - freed
    left = 0  # sum_{a<=j<i-1} left_in_span(.., recompute): alive to the span's backward
    for i in range(a, end):
        bi = blocks[i]
        if not {SELECTIVE, RECOMPUTE} <= bi.retained.keys() & bi.cost.keys():
            return
        v = bi.fwd_start - kept + prev + left + bi.fwd_excess[SELECTIVE]
        terms.see(v, Phase.FORWARD, i)
        if i > a:
            left += left_in_span(blocks, i - 1, RECOMPUTE)
        kept += bi.retained[KEEP]
        inner += bi.retained[KEEP] - bi.retained[SELECTIVE]
        terms.see(bi.bwd_start - inner + bi.bwd_excess[SELECTIVE], Phase.BACKWARD, i)
        rec.see(restored + bi.fwd_excess[SELECTIVE], Phase.RECOMPUTE, i)
        restored += bi.retained[SELECTIVE]
        cost += bi.cost[SELECTIVE]
        cost_r += bi.cost[RECOMPUTE]
        prev = bi.retained[RECOMPUTE] - freed
        if i > a:
            saved = kept - bi.retained[RECOMPUTE] - left
            recompute = rec.copy()
            recompute.value = bi.bwd_start - saved + rec.value
            peak, where = _first_max(blocks, terms, recompute)
            yield Segment(a, i, SELECTIVE, kind, peak, where, saved + freed, cost + cost_r)


def layout(
    blocks: Sequence[BlockCosts], decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> list[Segment]:
    """The segments of a plan: ``spans`` are :class:`~remat.planner.types.Span` s (or
    ``(first, last)`` block indices), ascending and disjoint; the blocks inside a span take
    their ``decisions``."""
    starts = {s.first: s for s in map(Span.of, spans)}
    out = []
    i = 0
    while i < len(blocks):
        if i in starts:
            sp = starts[i]
            inner = {decisions[j] for j in range(i, sp.last + 1)}
            if len(inner) != 1 or not inner <= set(SPAN_INNER):
                raise ValueError(
                    "a span's blocks must all be 'keep', all 'recompute', all 'selective' or "
                    f"all 'split', got {sorted(map(str, inner))} for blocks {i}..{sp.last}; give "
                    "the span's blocks one of these decisions, or drop the span."
                )
            out.append(span_segment(blocks, i, sp.last, decisions[i], sp.offloaded))
            i = sp.last + 1
        else:
            out.append(block_segment(blocks, i, decisions[i]))
            i += 1
    return out
