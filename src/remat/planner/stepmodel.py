"""The step model: every term of the peak and of the added time of one training step.

This module is the one home of the model: the per-block terms derived from the measured
timelines (corrections for pair effects included), the segments a plan is cut into (one
running-sum accumulator per kind of segment, which the reference evaluation and the chain
dynamic program both read), the peak of a step and where it falls, the cost of a plan and
what each block saves and adds. Nothing else in the planner writes a formula of the model.

The step
--------
The model is of the default training loop, the step a user runs::

    optimizer.zero_grad()        # grads None (set_to_none=True, PyTorch's default)
    out = model(*args)           # forward
    loss = loss_fn(out)
    loss.backward()              # gradients created as backward reaches each parameter
    optimizer.step()             # optimizer state created on the first step

with ``out`` and ``loss`` alive until the end of the step, as local variables
of a loop are. ``set_to_none=False`` (gradients kept and zeroed in place, or
accumulated over micro-batches) is modelled too: the gradients are then part
of the static bytes. Bytes are tensor storage bytes on the model's device, as
:mod:`remat.memory` counts them and as ``torch.cuda.max_memory_allocated()``
reports them.

The peak of a step is the largest of

* ``static + grads_kept + opt_state + act(plan)``  (forward and backward of a
  later step; the first step has no optimizer state yet, so it is lower);
* ``static + grads_kept + end + opt_first``       (the first ``optimizer.step()``,
  which creates the state);
* ``static + grads_kept + opt_state + end + opt_later`` (every later ``step()``);

where ``static`` is the bytes of parameters, buffers and inputs, ``end`` the
bytes alive when backward returns (the gradients when they were created in it,
``out``, ``loss``), and ``opt_*`` the peaks measured inside ``optimizer.step()``.
Only ``act(plan)`` depends on the plan.

Activations
-----------
``act(plan)`` is measured from the step's start in contiguous windows that
cover the whole forward and backward: before the first block (``pre``); block
``i``'s forward, from its start to the next block's start (the last block's to
its end); from there to the last block's backward (``top``: head, loss, their
backward); block ``i``'s backward, from the first gradient of one of its
outputs to the first gradient of the previous block's outputs (block 0's to
the end of backward, which covers the gradients of the layers before the
blocks). The candidates are a chain of blocks run in order in forward and in
reverse order in backward (a transformer's layers). For block ``i`` and
decision ``d`` the profile (:mod:`remat.planner.measure`) measures one
:class:`~remat.planner.types.Timeline` with every block under ``d``, from which
:func:`derive_blocks` makes:

* ``retained[i][d]``: bytes the block leaves alive for the rest of the
  step: what was allocated from its forward start to the next block's
  forward start (for the last block: to its own forward end). Measured up
  to the next block rather than to the block's end because what follows a
  block (a residual add, the loss) may free its output under ``keep`` while
  a selective cache holds it;
* ``fwd_excess[i][d]``: peak of its forward window above what was alive when it
  started;
* ``bwd_excess[i][d]``: peak of its backward window above what was alive when
  it started (recomputed activations and the block's new gradients live here), or
  above the start the model assumes where more was alive; for the
  last block also the peak of the ``top`` window under ``d``;
* ``cost[i][d]``: the time (or FLOPs) the decision adds to a step; ``keep`` is 0;

and, once, under all-``keep``: ``fwd_start[i]`` / ``bwd_start[i]``, the bytes
alive when block ``i``'s forward / backward window starts, and ``top``.
Gradients created in backward are in these terms: they are the same under
every decision, since a block's parameters get their gradients in its
backward whatever the decision.

With ``saved(i) = sum_{j<=i} retained[j][keep] - retained[j][d_j]`` the
activation peak is the largest of

* ``pre``                                                (before the first block)
* ``fwd_start[i] - saved(i-1) + fwd_excess[i][d_i]``   (block ``i``'s forward)
* ``bwd_start[i] - saved(i) + bwd_excess[i][d_i]``     (block ``i``'s backward)
* ``top - saved(n)``

Every term is linear in one-hot decision variables ``x[i][d]``, so "minimise
``sum cost[i][d] x[i][d]`` subject to every term ``<= budget``" is a small
mixed-integer linear program (:mod:`remat.planner.perblock`). Spans of blocks
(:func:`span_segments`) cut the chain into segments whose terms are ``term - s``,
``s`` what the segments before saved: the chain dynamic program
(:mod:`remat.planner.chain`) plans over them.

This is the chain formulation of Chen et al. 2016 ("Training Deep Nets with
Sublinear Memory Cost", arXiv:1604.06174) with per-block heterogeneous costs
as in Beaumont et al. (Rotor: "Optimal checkpointing for heterogeneous
chains", arXiv:1911.13214), solved as an integer program in the spirit of
Jain et al. 2020 (Checkmate, arXiv:1910.02653) at block rather than operator
granularity, with selective checkpointing and host offload as extra
per-block choices.

Not covered: blocks that are not a chain (skip connections across blocks
other than the residual stream), data-dependent shapes (the profile is valid
for the input shapes it was measured with), tensors the process holds that
are neither the model's nor the optimizer's nor the inputs, and allocator
fragmentation and caching on GPUs (the model counts tensor bytes, as
:mod:`remat.memory` does, i.e. ``max_memory_allocated``, not ``max_memory_reserved``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from .types import (
    NEVER,
    SPAN_INNER,
    BlockCosts,
    Decision,
    Measurements,
    Phase,
    ProfileData,
    Segment,
    Span,
    SpanKind,
    SpanLike,
    StepPeak,
    Timeline,
    Where,
)

KEEP, RECOMPUTE, SELECTIVE, OFFLOAD, SPLIT = (
    Decision.KEEP,
    Decision.RECOMPUTE,
    Decision.SELECTIVE,
    Decision.OFFLOAD,
    Decision.SPLIT,
)

#: The lines whose steps see which block inputs die when forward returns: the others
#: (checkpoints) hold every block input into backward.
HELD_LINES = (KEEP, OFFLOAD)


# --------------------------------------------------------------------------- the terms


def derive_blocks(m: Measurements) -> list[BlockCosts]:
    """The per-block terms of the model from the raw measurements of a profile, pair
    effects and the blocks' limits included (see the module docstring for the terms)."""
    out = _terms(m.names, m.lines, m.costs, m.noise, m.lines[KEEP].input_bytes, m.param_bytes)
    for b, f in zip(out, m.freed):
        # The next block (kept) frees this one's output as it runs, which the selective
        # cache may hold instead (a block ending in a saved matmul): counted as held, so a
        # selective block is never predicted low (over by ``f`` where nothing frees it).
        if f and SELECTIVE in b.retained:
            b.retained[SELECTIVE] += f
            if b.bwd_excess[SELECTIVE] > NEVER:  # a backward window was seen
                b.bwd_excess[SELECTIVE] -= f  # its own backward: as measured
    _held_to_end(out, m.held_to_end)
    for b, f, h in zip(out, m.offload_inputs, m.held_before):
        b.offload_input = 0 if b.name in m.mutating else f
        if h and OFFLOAD in b.retained:
            # The offload line freed this block's input as it ran; after a kept or selective
            # block that saved it, it lives on: counted as held (high by ``h`` after a block
            # that does not hold it, never low).
            b.retained[OFFLOAD] += h
    for b in out:
        # A block that changes its input in place cannot be recomputed from that input (the
        # region keeps it; autograd raises when backward reads it): it is kept, alone. A
        # block with fewer than two children with parameters cannot split.
        mutating = b.name in m.mutating
        dropped = [d for d in m.decisions if d != KEEP] if mutating else [SPLIT]
        if mutating or b.name not in m.splittable:
            for terms in (b.retained, b.fwd_excess, b.bwd_excess, b.cost, b.noise):
                for d in dropped:
                    terms.pop(d, None)
    equalize_costs(
        out, [(sig, b.name in m.mutating) for sig, b in zip(m.signatures, out)]
    )
    return out


def _terms(
    names: Sequence[str],
    lines: dict[Decision, Timeline],
    costs: dict[Decision, dict[str, float]],
    noise: dict[Decision, dict[str, float]],
    input_bytes: Sequence[int],
    param_bytes: Sequence[int],
) -> list[BlockCosts]:
    """The per-block terms from one measured timeline per uniform decision."""
    decisions = list(lines)
    keep = lines[KEEP]
    n = len(names)
    out = []
    # bytes each uniform step saved up to this block: alive in forward, and in backward
    saved_f = dict.fromkeys(decisions, 0)
    saved = dict.fromkeys(decisions, 0)
    exited = keep.top_pre_peak is not None  # an autocast region ended before backward
    exit_freed = {d: t.exit_freed or [0] * n for d, t in lines.items()}
    for i, name in enumerate(names):
        retained, retained_f = {}, {}
        for d, t in lines.items():
            nxt = t.fwd_start[i + 1] if i + 1 < n else t.top_start
            retained_f[d] = nxt - t.fwd_start[i]
            retained[d] = retained_f[d] - exit_freed[d][i]
        bwd_excess = {}
        kb = keep.bwd_start[i]
        pre_exit = {}
        for d, t in lines.items():
            saved[d] += retained[KEEP] - retained[d]
            saved_f[d] += retained_f[KEEP] - retained_f[d]
            start = t.bwd_start[i]
            if kb is None or start is None:  # no backward window: never the binding term
                bwd_excess[d] = NEVER
                continue
            # Above the start the model assumes (keep's start less what was saved), not the
            # start measured under d: a selective cache may hold more then (the last block's
            # output, freed after the loss under keep), and a recomputed block whose last op
            # saved its output (ReLU) starts lower; both are the block's own and hold for any
            # plan, so the peak relative to the assumed start is exact.
            assumed = kb - saved[d]
            bwd_excess[d] = t.bwd_peak[i] - assumed
            if i == n - 1:  # the same for the head, the loss and their backward
                bwd_excess[d] = max(bwd_excess[d], t.top_peak - assumed)
        if i == n - 1 and exited:  # the head and the loss before the region's end
            pre_exit = {
                d: t.top_pre_peak + saved_f[d]
                for d, t in lines.items()
                if t.top_pre_peak is not None
            }
        out.append(
            BlockCosts(
                name=name,
                retained=retained,
                fwd_excess={d: t.fwd_peak[i] - t.fwd_start[i] for d, t in lines.items()},
                bwd_excess=bwd_excess,
                cost={d: max(0.0, costs[d][name] - costs[KEEP][name]) for d in decisions},
                fwd_start=keep.fwd_start[i],
                bwd_start=kb if kb is not None else 0,
                input_bytes=input_bytes[i],
                param_bytes=param_bytes[i],
                bwd_grads=keep.bwd_grads[i],
                noise={d: noise[d][name] for d in decisions if name in noise.get(d, {})},
                exit_freed=(
                    {d: exit_freed[d][i] for d in decisions}
                    if exited and any(exit_freed[d][i] for d in decisions)
                    else {}
                ),
                pre_exit=pre_exit,
            )
        )
    return out


def _held_to_end(costs: list[BlockCosts], held: dict[Decision, list[int]]) -> None:
    """Block inputs that live to the end of forward and then die, measured per line in
    ``held``: the model's code keeps them (a list of hidden states) and the block keeps none
    of them on the device (under ``keep``: it saves none, or only autocast's copy; under
    ``offload``: its saved copy is in host memory), while a checkpoint of the block holds
    them into its backward. They count as kept in forward and not after it under that
    decision (``exit_freed``, in place), so every backward term from the block's on has
    them exactly when the plan holds them. The uniform lines' derived backward terms had
    them (or not) for every block before: moved out of them here."""
    n = len(costs)
    lines = {d: held.get(d, [0] * n) for d in HELD_LINES}
    total: dict[Decision, int] = {}
    for i, b in enumerate(costs):
        mine = {d: v[i] for d, v in lines.items() if v[i] and d in b.retained}
        b.held_to_end = mine.get(KEEP, 0)
        if mine:
            x = dict(b.exit_freed) or dict.fromkeys(b.retained, 0)
            for d, h in mine.items():
                b.retained[d] -= h
                x[d] = x.get(d, 0) + h
            b.exit_freed = x
        for d in b.bwd_excess:  # what keep's line freed and d's line held, from block 0 on
            total[d] = total.get(d, 0) + mine.get(KEEP, 0) - mine.get(d, 0)
            if total[d] and b.bwd_excess[d] > NEVER:
                b.bwd_excess[d] -= total[d]


def equalize_costs(blocks: list[BlockCosts], signatures: Sequence[Any]) -> None:
    """Give blocks with the same signature (same class, parameter and buffer shapes, inputs)
    the same cost and noise per decision: the median over the group, in place.

    Identical layers cost the same; their timed costs differ only by noise, and
    without this a solver would pick among them by that noise, a different
    plan on every run.
    """
    groups: dict[Any, list[BlockCosts]] = {}
    for b, sig in zip(blocks, signatures):
        groups.setdefault(sig, []).append(b)
    for members in groups.values():
        if len(members) < 2:
            continue
        for d in members[0].cost:
            cost = statistics.median(b.cost[d] for b in members)
            noise = statistics.median(b.noise.get(d, 0.0) for b in members)
            for b in members:
                b.cost[d] = cost
                if d in b.noise:
                    b.noise[d] = noise


def options(blocks: Sequence[BlockCosts], allowed: Sequence[str]) -> list[list[Decision]]:
    """For each block, the allowed decisions it was measured under (and may take)."""
    return [[Decision(d) for d in allowed if d in b.retained and d in b.cost] for b in blocks]


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


# ------------------------------------------------------------------------ the segments


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


def block_terms(b: BlockCosts, d: str) -> BlockTerms:
    """Block ``b`` alone under ``d`` (see the module docstring for its two terms)."""
    d = Decision(d)
    saves = b.retained[KEEP] - b.retained[d]
    return BlockTerms(
        b.fwd_start, b.fwd_excess[d], b.bwd_start, b.bwd_excess[d], saves, float(b.cost[d])
    )


def block_segment(blocks: Sequence[BlockCosts], i: int, d: str) -> Segment:
    """Block ``i`` alone under ``d``: the larger of its two terms (:func:`block_terms`)."""
    b = blocks[i]
    t = block_terms(b, d)
    fwd = t.forward_start + t.forward_excess
    bwd = t.backward_start - t.saves + t.backward_excess
    where = Where(Phase.FORWARD, b.name) if fwd >= bwd else Where(Phase.BACKWARD, b.name)
    return Segment(i, i, Decision(d), SpanKind.BLOCK, max(fwd, bwd), where, t.saves, t.cost)


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
    blocks: Sequence[BlockCosts], a: int, end: int, d: str, offload: bool = False
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
    d = Decision(d)
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
    blocks: Sequence[BlockCosts], a: int, z: int, d: str, offload: bool = False
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

    ``offload``: see :func:`span_segments`.
    """
    if z <= a:
        raise ValueError(f"a span needs two or more blocks, got blocks {a}..{z}.")
    for seg in span_segments(blocks, a, z + 1, d, offload):
        if seg.last == z:
            return seg
    raise ValueError(
        f"blocks {a}..{z} cannot form a span with inner decision {Decision(d)!r}: a block "
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
        kept += r


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
    for i in range(a, end):
        bi = blocks[i]
        if RECOMPUTE not in bi.cost or RECOMPUTE not in bi.retained:
            return
        r = bi.retained[RECOMPUTE]
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
                bi.bwd_start - (bi.retained[KEEP] - r) + bi.bwd_excess[RECOMPUTE] + held,
                Phase.BACKWARD,
                i,
            )
            peak, where = _first_max(blocks, fwd, recompute, last, bwd)
            yield Segment(a, i, KEEP, kind, peak, where, saved + freed, cost)
        rec.see(restored + bi.fwd_excess[KEEP], Phase.RECOMPUTE, i)
        restored += bi.retained[KEEP]
        bwd.see(bi.bwd_start + bi.bwd_excess[KEEP] + held, Phase.BACKWARD, i)
        kept_prev = kept
        kept += r


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
    for i in range(a, end):
        bi = blocks[i]
        if not {SELECTIVE, RECOMPUTE} <= bi.retained.keys() & bi.cost.keys():
            return
        terms.see(bi.fwd_start - kept + prev + bi.fwd_excess[SELECTIVE], Phase.FORWARD, i)
        kept += bi.retained[KEEP]
        inner += bi.retained[KEEP] - bi.retained[SELECTIVE]
        terms.see(bi.bwd_start - inner + bi.bwd_excess[SELECTIVE], Phase.BACKWARD, i)
        rec.see(restored + bi.fwd_excess[SELECTIVE], Phase.RECOMPUTE, i)
        restored += bi.retained[SELECTIVE]
        cost += bi.cost[SELECTIVE]
        cost_r += bi.cost[RECOMPUTE]
        prev = bi.retained[RECOMPUTE] - freed
        if i > a:
            saved = kept - bi.retained[RECOMPUTE]
            recompute = rec.copy()
            recompute.value = bi.bwd_start - saved + rec.value
            peak, where = _first_max(blocks, terms, recompute)
            yield Segment(a, i, SELECTIVE, kind, peak, where, saved + freed, cost + cost_r)


def layout(
    blocks: Sequence[BlockCosts], decisions: Sequence[str], spans: Sequence[SpanLike] = ()
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


# ------------------------------------------------------------------ views of the terms


def has_exit(blocks: Sequence[BlockCosts]) -> bool:
    """Whether some block keeps bytes in forward that it does not keep into backward (an
    autocast region ended before backward, or inputs the model keeps to forward's end):
    the step model then needs its two running sums."""
    return any(b.exit_freed or b.pre_exit for b in blocks)


def exit_view(blocks: Sequence[BlockCosts], safe: bool) -> list[BlockCosts]:
    """Terms in one running sum, for the solvers, where an autocast region ends before
    backward (:func:`has_exit`).

    What a block keeps in forward is ``retained + exit_freed`` and in backward
    ``retained``, so the exact forward terms (:func:`activation_terms`) subtract
    ``s_F``, what the blocks before saved in forward, and the backward terms ``s_B``:
    ``s_B - s_F = sum_{j} (exit_freed[j][d_j] - exit_freed[j][keep])``: the cached casts of
    the checkpointed blocks, less the inputs kept to forward's end that they hold. The
    dynamic program has one running sum, ``s_B``; its forward terms are here either
    ``safe`` (raised by ``sum_{j<i} max_d (exit_freed[j][d] - exit_freed[j][keep])``, never
    below the exact term, above it by the casts of the kept blocks before) or optimistic
    (``s_B`` as if it were ``s_F``: never above the exact term). :func:`remat.plan` solves
    the optimistic terms first: a plan they choose that meets the budget under the exact
    terms is optimal; otherwise it solves the safe ones.
    """
    out = []
    over = 0
    for b in blocks:
        nb = dataclasses.replace(b, fwd_start=b.fwd_start + (over if safe else 0))
        if b.exit_freed:
            keep = b.exit_freed.get(KEEP, 0)
            over += max(0, max(b.exit_freed.values()) - keep)
        if b.pre_exit:  # the last block: its forward-phase term as a backward one
            excess = dict(b.bwd_excess)
            for d, v in b.pre_exit.items():
                if d in excess:
                    excess[d] = max(excess[d], v - b.bwd_start + (over if safe else 0))
            nb.bwd_excess = excess
        out.append(nb)
    return out


def checkpointed_view(
    blocks: Sequence[BlockCosts], top: int, shared: int
) -> tuple[list[BlockCosts], int]:
    """The terms of plans with at least one checkpoint, when the model's forward makes
    ``shared`` bytes of tensors it passes to several blocks (an attention mask, rotary
    tables) that die when the forward returns under ``keep``.

    A checkpointed block keeps them as inputs until its backward, so they are alive in the
    backward of every block from the last down to the first checkpointed one. The uniform
    lines measured them inside the checkpointed decisions' backward terms; here they are
    in every backward term (``bwd_start``) and in ``top`` instead: exact for checkpointed
    blocks, high by ``shared`` for kept blocks before the first checkpoint (whose backward
    comes after it has been freed).
    """
    out = []
    for b in blocks:
        excess = dict(b.bwd_excess)
        for d in excess:
            if d.holds_inputs and excess[d] > NEVER:
                excess[d] -= shared
        out.append(dataclasses.replace(b, bwd_start=b.bwd_start + shared, bwd_excess=excess))
    return out, top + shared


@dataclasses.dataclass(frozen=True)
class Terms:
    """The blocks' terms and ``top`` a solver plans over, and whether they are exact for
    every plan or (``views``) a bound and its optimistic counterpart to try first."""

    blocks: list[BlockCosts]
    top: int
    optimistic: list[BlockCosts] | None = None


def solver_terms(prof: ProfileData, checkpointed: bool = True) -> Terms:
    """The terms the solvers plan over: with ``checkpointed`` (plans that checkpoint
    something) those of :func:`checkpointed_view`; where an autocast region ends before
    backward the safe single-sum terms, and the optimistic ones to try first
    (:func:`exit_view`)."""
    blocks, top = list(prof.blocks), prof.top
    if checkpointed and prof.shared_bytes:
        blocks, top = checkpointed_view(blocks, top, prof.shared_bytes)
    if has_exit(blocks):
        return Terms(exit_view(blocks, safe=True), top, exit_view(blocks, safe=False))
    return Terms(blocks, top)


def plan_terms(
    prof: ProfileData, decisions: Sequence[str], spans: Sequence[SpanLike] = ()
) -> tuple[Sequence[BlockCosts], int]:
    """The blocks and ``top`` the model uses for a plan (see :func:`checkpointed_view`)."""
    if prof.shared_bytes and (spans or any(d != KEEP for d in decisions)):
        return checkpointed_view(prof.blocks, prof.top, prof.shared_bytes)
    return prof.blocks, prof.top


# ------------------------------------------------------------------- peak and cost


_BEFORE = Where(Phase.BEFORE_BLOCKS)
_AFTER = Where(Phase.AFTER_BLOCKS)


def _exact_terms(
    blocks: Sequence[BlockCosts], top: int, decisions: Sequence[str], pre: int
) -> tuple[int, Where]:
    """:func:`activation_terms` of a plan without spans, in two running sums (forward and
    backward: see :func:`exit_view`)."""
    saved_f = saved_b = 0
    peak, where = pre, _BEFORE
    for b, d in zip(blocks, map(Decision, decisions)):
        fwd = b.fwd_start - saved_f + b.fwd_excess[d]
        if fwd > peak:
            peak, where = fwd, Where(Phase.FORWARD, b.name)
        x = b.exit_freed
        saved_f += b.retained[KEEP] + x.get(KEEP, 0) - b.retained[d] - x.get(d, 0)
        saved_b += b.retained[KEEP] - b.retained[d]
        bwd = b.bwd_start - saved_b + b.bwd_excess[d]
        if bwd > peak:
            peak, where = bwd, Where(Phase.BACKWARD, b.name)
        if d in b.pre_exit and b.pre_exit[d] - saved_f > peak:
            peak, where = b.pre_exit[d] - saved_f, _AFTER
    if top - saved_b > peak:
        peak, where = top - saved_b, _AFTER
    return peak, where


def activation_terms(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[str],
    pre: int = 0,
    spans: Sequence[SpanLike] = (),
) -> tuple[int, Where]:
    """The activation peak and where it falls.

    Where an autocast region ends before backward (:func:`has_exit`), a plan without
    spans is exact in two running sums, and a plan with spans is bounded by the safe
    single-sum terms of :func:`exit_view` (never low; high by the cached casts of kept
    blocks in forward terms).
    """
    if has_exit(blocks):
        if not spans:
            return _exact_terms(blocks, top, decisions, pre)
        blocks = exit_view(blocks, safe=True)
    saved = 0
    peak, where = pre, _BEFORE
    for seg in layout(blocks, decisions, spans):
        if seg.peak - saved > peak:
            peak, where = seg.peak - saved, seg.where
        saved += seg.saved
    if top - saved > peak:
        peak, where = top - saved, _AFTER
    return peak, where


def predicted_peak(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[str],
    pre: int = 0,
    spans: Sequence[SpanLike] = (),
) -> int:
    """Activation peak (bytes above the step's start) the model predicts for a plan."""
    return activation_terms(blocks, top, decisions, pre, spans)[0]


def predicted_cost(
    blocks: Sequence[BlockCosts], decisions: Sequence[str], spans: Sequence[SpanLike] = ()
) -> float:
    """Added time (or FLOPs) the model predicts for a plan."""
    if not spans:
        return float(sum(b.cost[Decision(d)] for b, d in zip(blocks, decisions)))
    return float(sum(seg.cost for seg in layout(blocks, decisions, spans)))


def step_peak(
    prof: ProfileData, decisions: Sequence[str], spans: Sequence[SpanLike] = ()
) -> StepPeak:
    """The peak of one step of the default loop under a plan (first and later steps).

    ``spans`` as in :func:`layout`.
    """
    static = prof.static_bytes
    kept = prof.grad_bytes if prof.grads_kept else 0
    state = prof.optimizer_state_bytes
    blocks, top = plan_terms(prof, decisions, spans)
    act, where = activation_terms(blocks, top, decisions, prof.pre, spans)
    grads_at = _grads_at(prof, where)
    base = {"static": static, "gradients": kept, "optimizer": state}
    best = StepPeak(
        static + kept + state + act,
        where,
        {**base, "gradients": kept + grads_at, "activations": act - grads_at},
    )
    if prof.optimizer is None:
        return best
    end_act = prof.end_bytes - prof.end_grads
    grads = kept + prof.end_grads
    first = prof.optimizer_first_bytes
    later = prof.optimizer_later_bytes
    for c in (
        StepPeak(
            static + kept + prof.end_bytes + first,
            Where(Phase.OPTIMIZER_FIRST),
            {
                "static": static,
                "gradients": grads,
                "optimizer": min(state, first),
                "activations": end_act + first - min(state, first),
            },
        ),
        StepPeak(
            static + kept + state + prof.end_bytes + later,
            Where(Phase.OPTIMIZER_LATER),
            {**base, "gradients": grads, "activations": end_act + later},
        ),
    ):
        if c.bytes > best.bytes:  # a tie goes to what a plan can move
            best = c
    return best


def _grads_at(prof: ProfileData, where: Where) -> int:
    """Gradient bytes alive at the end of the window ``where`` (created in this step)."""
    if where.phase is Phase.BACKWARD:
        for b in prof.blocks:
            if b.name == where.block:
                return int(b.bwd_grads)
    if where.phase is Phase.AFTER_BLOCKS:
        return int(prof.top_grads)
    return 0


def attribution(
    blocks: Sequence[BlockCosts], decisions: Sequence[str], spans: Sequence[SpanLike] = ()
) -> tuple[dict[str, int], dict[str, float]]:
    """Per block, the bytes its decision saves at the peak and the time (or FLOPs) it adds,
    spans shared out among their blocks; they add up to the plan's saving and cost."""
    ds = [Decision(d) for d in decisions]
    saved = {b.name: b.retained[KEEP] - b.retained[d] for b, d in zip(blocks, ds)}
    added = {b.name: float(b.cost[d]) for b, d in zip(blocks, ds)}
    for sp in map(Span.of, spans):
        a, z = sp.first, sp.last
        # the span's recompute runs its blocks once more: all of them when they are plain
        # or selective inside it, all but the last when each is checkpointed inside it
        whole = ds[a] in (KEEP, SELECTIVE)
        for j in range(a, z + 1 if whole else z):
            added[blocks[j].name] += float(blocks[j].cost.get(RECOMPUTE, 0.0))
        for j in range(a, z):  # block outputs inside a span are not kept either
            saved[blocks[j].name] += blocks[j].retained[ds[j]]
        if whole:  # the last block leaves its output only
            r = blocks[z].retained
            saved[blocks[z].name] = r[KEEP] - r[RECOMPUTE]
        if sp.offloaded:  # the copies of the input, which is not on the device either
            added[blocks[a].name] += input_offload_cost(blocks, a)
            saved[blocks[a].name] += blocks[a].offload_input
    return saved, added


# ----------------------------------------------------------------------------- budgets


def parse_budget(budget: int | float | str, static: int, unchecked: int) -> int:
    """Bytes from ``budget``: the absolute step peak it allows.

    Bytes are an int (``2**30``) or a size string: ``"1.5GiB"``, ``"512MiB"``,
    ``"18GB"``. Binary prefixes (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers
    of 1024; decimal ones (``KB``, ``MB``, ``GB``, ``TB``) powers of 1000, as
    in the SI (and in Hugging Face's ``max_memory``). A percentage ``"60%"``
    is ``static`` plus that share of what the unchecked step allocates above
    ``static`` (``unchecked - static``); it must be above ``0%``, and ``100%``
    or more is met by keeping every block.

    Example:
        >>> parse_budget("50%", 1000, 3000), parse_budget(2048, 0, 1), parse_budget("1.5KiB", 0, 1)
        (2000, 2048, 1536)
        >>> parse_budget("2GB", 0, 1), parse_budget("2GiB", 0, 1)
        (2000000000, 2147483648)
    """
    hint = (
        "Pass the step's peak in bytes (a positive int such as 2**30, or a size such as "
        "'1.5GiB' or '18GB'), or a percentage above 0% such as '60%' of what the unchecked "
        "step allocates above its static bytes."
    )
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(
            f"remat.plan: budget must be bytes (int) or a string, got {type(budget).__name__} "
            f"{budget!r}. {hint}"
        )
    if isinstance(budget, (int, float)):
        if isinstance(budget, float) and 0 < budget < 1:
            raise ValueError(
                f"remat.plan: budget={budget!r} is read as bytes (less than one); for a share "
                f"write it as a percentage string: budget='{budget * 100:g}%'."
            )
        if not math.isfinite(budget) or budget < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return int(budget)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*%\s*", budget)
    if m:
        pct = float(m.group(1))
        if not pct > 0:
            raise ValueError(
                f"remat.plan: budget percentage must be above 0%, got {budget!r}. {hint}"
            )
        return static + int(max(unchecked - static, 0) * pct / 100)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
    if m:
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}.get(unit) or {
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }[unit]
        out = int(float(m.group(1)) * scale)
        if out < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return out
    raise ValueError(f"remat.plan: cannot read budget {budget!r}. {hint}")


def unchecked_peak(prof: ProfileData) -> StepPeak:
    """The step's peak with every block kept."""
    return step_peak(prof, [KEEP] * len(prof.blocks))


def budget_of(prof: ProfileData, budget: int | float | str) -> int:
    """``budget`` in bytes for ``prof``: a percentage is of the activations, with the
    static bytes and the scratch inside operators (which no plan changes) on top."""
    scratch = prof.scratch_bytes
    return parse_budget(
        budget, prof.static_step_bytes + scratch, unchecked_peak(prof).bytes + scratch
    )
