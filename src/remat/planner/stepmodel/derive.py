"""The per-block terms of the step model, derived from the measured timelines, with the
pair-effect corrections (see :mod:`remat.planner.stepmodel` for the terms)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..types import (
    KEEP,
    NEVER,
    OFFLOAD,
    SELECTIVE,
    SPLIT,
    BlockCosts,
    Decision,
    Measurements,
    SharedInput,
    Timeline,
    shared_inputs,
)

#: The lines whose steps see which block inputs die when forward returns: the others
#: (checkpoints) hold every block input into backward.
HELD_LINES = (KEEP, OFFLOAD)


def derive_blocks(m: Measurements) -> list[BlockCosts]:
    """The per-block terms of the model from the raw measurements of a profile, pair
    effects and the blocks' limits included (see the module docstring for the terms)."""
    out = _terms(m.names, m.lines, m.costs, m.noise, m.lines[KEEP].input_bytes, m.param_bytes)
    if m.compiled:  # a compiled level can make the step faster than keeping: as measured
        for b in out:
            b.cost = {d: m.costs[d][b.name] - m.costs[KEEP][b.name] for d in b.cost}
    for i, (b, f) in enumerate(zip(out, m.freed)):
        # The next block (kept) frees this one's output as it runs, which the selective
        # cache may hold instead (a block ending in a saved matmul): counted as held, so a
        # selective block is never predicted low (over by ``f`` where nothing frees it).
        # The last block's next is the head, kept in every line: the selective line saw
        # what it freed there, the cache held the rest, exact.
        if i == len(out) - 1 and SELECTIVE in m.head_freed:
            f = max(0, f - m.head_freed[SELECTIVE])
        if f and SELECTIVE in b.retained:
            b.retained[SELECTIVE] += f
            if b.bwd_excess[SELECTIVE] > NEVER:  # a backward window was seen
                b.bwd_excess[SELECTIVE] -= f  # its own backward: as measured
    keep = m.lines[KEEP]
    for i, b in enumerate(out):
        b.held_to_end = m.held_to_end.get(KEEP, [0] * len(out))[i]
        if keep.fwd_tail:
            b.fwd_tail = keep.fwd_tail[i] - keep.fwd_start[i]
    groups = shared_inputs(m.shared_inputs)
    _shared_inputs(out, groups)
    if OFFLOAD in m.held_to_end:
        _offload_held(out, m.held_to_end[OFFLOAD], groups)
    _outputs_freed(out, {d: t.outputs_freed for d, t in m.lines.items()})
    last = len(out) - 1
    for i, (b, f, h) in enumerate(zip(out, m.offload_inputs, m.held_before)):
        b.offload_input = 0 if b.name in m.mutating else f
        if i == last:  # its input died as the forward returned: in ``held_to_end``
            h = min(h, m.held_to_end.get(OFFLOAD, [0] * (i + 1))[i])
        if h and OFFLOAD in b.retained:
            # The offload line freed this block's input as it ran (the last block's: as the
            # forward returned); after a kept or selective block that saved it, it lives on:
            # counted as held (high by ``h`` after a block that does not hold it, never low).
            b.retained[OFFLOAD] += h
            if i == last:  # and not freed at the forward's end (``exit_freed``)
                _not_freed_at_exit(b, h)
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


def _not_freed_at_exit(b: BlockCosts, h: int) -> None:
    """Take ``h`` bytes of ``offload``'s ``exit_freed`` back (they count as held into
    backward, in ``retained``); an ``exit_freed`` left all zero is dropped."""
    b.exit_freed[OFFLOAD] -= h
    if not any(b.exit_freed.values()):
        b.exit_freed = {}


def _shared_inputs(costs: list[BlockCosts], groups: Sequence[SharedInput]) -> None:
    """Tensors handed to several blocks (or dying in a later block's window) that die in
    forward with every block kept (:class:`~remat.planner.types.SharedInput`), in place.

    Each is counted as kept by every consumer that holds its inputs (``retained[keep]``,
    and ``offload``'s, lower by its bytes; where it dies as forward returns only into
    backward: ``exit_freed``), so a plan's terms count it once per checkpointed consumer:
    never low, exact with one; :func:`~remat.planner.stepmodel.peak.step_peak` takes the
    extra copies back. The uniform lines' terms are made free of it: a checkpointing line
    held it from the first consumer's backward window on (measured once in each
    ``bwd_excess``), and did not free it in the window it dies in under ``keep`` (that
    block's ``retained``).
    """
    n = len(costs)
    for g in groups:
        s, first = g.bytes, min(g.consumers)
        for j in g.consumers:
            b = costs[j]
            for d in HELD_LINES:
                if d in b.retained:
                    b.retained[d] -= s
                    if g.dies == n:
                        b.exit_freed = b.exit_freed or dict.fromkeys(b.retained, 0)
                        b.exit_freed[d] = b.exit_freed.get(d, 0) + s
        if g.dies < n:
            b = costs[g.dies]
            for d in b.retained:
                if d.holds_inputs:
                    b.retained[d] -= s
        for i, b in enumerate(costs):
            for d, v in b.bwd_excess.items():
                if d.holds_inputs and v > NEVER:
                    b.bwd_excess[d] = v - s * (i >= first) + s * (g.dies <= i)


def _offload_held(
    costs: list[BlockCosts], held: Sequence[int], groups: Sequence[SharedInput]
) -> None:
    """Block inputs the ``offload`` line freed as forward returned and the ``keep`` line
    kept into backward (a block input its saved tensors hold, which ``offload`` moved to host
    memory), per block in ``held`` (with those of ``groups``, which both free: taken out):
    kept by the block in forward, not after it, under ``offload`` (``exit_freed``, in place),
    so every backward term from the block's on is without them exactly when the plan offloads
    the block; the ``offload`` line's backward terms had them freed from block 0 on."""
    mine = [0] * len(costs)
    for g in groups:
        for j in g.consumers:
            if j != g.dies:
                mine[j] += g.bytes
    total = 0
    for i, b in enumerate(costs):
        extra = max(0, held[i] - mine[i]) if OFFLOAD in b.retained else 0
        if extra:
            b.retained[OFFLOAD] -= extra
            b.exit_freed = b.exit_freed or dict.fromkeys(b.retained, 0)
            b.exit_freed[OFFLOAD] = b.exit_freed.get(OFFLOAD, 0) + extra
        total += extra
        v = b.bwd_excess.get(OFFLOAD, NEVER)
        if total and v > NEVER:
            b.bwd_excess[OFFLOAD] = v + total


def _outputs_freed(costs: list[BlockCosts], freed: dict[Decision, list[int]]) -> None:
    """Block outputs the next block did not receive (the blocks are not one chain there:
    two towers whose outputs the model's head combines) that the model's code holds to the
    end of forward and that die before the block's backward, per line in ``freed``: under
    ``keep`` the head uses them and frees them in its backward, while a ``selective`` cache
    holds them to the block's own backward. They count as kept in forward and not after it
    under the decisions whose line freed them (``exit_freed``, in place), so the backward
    terms of the blocks after this one (whose backward comes first) have them exactly when
    the plan holds them; the uniform lines' derived backward terms are moved as in
    :func:`_shared_inputs`."""
    n = len(costs)
    lines = {d: v if len(v) == n - 1 else [0] * (n - 1) for d, v in freed.items()}
    total: dict[Decision, int] = {}
    for i, b in enumerate(costs):
        mine = {d: v[i] for d, v in lines.items() if i < n - 1 and v[i] and d in b.retained}
        if mine:
            x = dict(b.exit_freed) or dict.fromkeys(b.retained, 0)
            for d, f in mine.items():
                b.retained[d] -= f
                x[d] = x.get(d, 0) + f
            b.exit_freed = x
        for d in b.bwd_excess:  # what keep's line freed and d's line held, from this block on
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
