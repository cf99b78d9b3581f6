"""The peak of a training step under a plan, where it falls, the plan's cost, and what each
block saves and adds; the views of the terms the solvers plan over (see
:mod:`remat.planner.stepmodel`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from ..types import (
    KEEP,
    NEVER,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
    BlockCosts,
    Decision,
    Phase,
    ProfileData,
    SharedInput,
    Span,
    SpanLike,
    StepPeak,
    Where,
)
from .segments import input_offload_cost, layout, left_in_span


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
    (:func:`exit_view`); where tensors are handed to several blocks, the optimistic ones
    count each by its last receiver only (:func:`shared_view`)."""
    blocks, top = list(prof.blocks), prof.top
    if checkpointed and prof.shared.bytes:
        blocks, top = checkpointed_view(blocks, top, prof.shared.bytes)
    groups = prof.shared.groups
    low = shared_view(blocks, groups) if groups else blocks
    if has_exit(blocks) or has_exit(low):
        return Terms(exit_view(blocks, safe=True), top, exit_view(low, safe=False))
    return Terms(blocks, top, low if groups else None)


def plan_terms(
    prof: ProfileData, decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> tuple[Sequence[BlockCosts], int]:
    """The blocks and ``top`` the model uses for a plan (see :func:`checkpointed_view`)."""
    if prof.shared.bytes and (spans or any(d != KEEP for d in decisions)):
        return checkpointed_view(prof.blocks, prof.top, prof.shared.bytes)
    return prof.blocks, prof.top


_BEFORE = Where(Phase.BEFORE_BLOCKS)
_POST = Where(Phase.BEFORE_BLOCKS_BACKWARD)
_AFTER = Where(Phase.AFTER_BLOCKS)


@dataclasses.dataclass
class _Copies:
    """The bytes of :class:`~remat.planner.types.SharedInput` s a plan's terms count more
    than once (once per checkpointed consumer; alive once), per window."""

    fwd: list[int]
    bwd: list[int]
    top: int = 0
    pre_exit: int = 0


def _extra_copies(
    blocks: Sequence[BlockCosts], ds: Sequence[Decision], groups: Sequence[SharedInput]
) -> _Copies:
    """Per window, what the terms of plan ``ds`` count of ``groups`` beyond the once it is
    alive: the terms count a tensor once per holding consumer up to the window (backward:
    consumers ``<= i``; forward, where it dies before the last block: ``< k``), while it is
    alive once from the first holder's window (backward) or after the window it dies in
    under ``keep`` (forward; in that window only above the part after the block returned)."""
    n = len(blocks)
    out = _Copies([0] * n, [0] * n)
    for g in groups:
        held = [j for j in g.consumers if ds[j].holds_inputs]
        s, w = g.bytes, g.dies
        if not held or (len(held) == 1 and w >= n):  # counted once: exact as it is
            continue
        upto = list(itertools.accumulate(int(i in held) for i in range(n)))  # holders <= i
        for i in range(n):  # block i's backward: alive (once) if a consumer j <= i holds it
            out.bwd[i] += s * max(0, upto[i] - 1)
        out.top += s * (len(held) - 1)
        if w >= n:  # counted in backward only (exit_freed): forward is exact
            continue
        out.pre_exit += s * (len(held) - 1)
        for k in range(n):
            before = upto[k - 1] if k else 0
            if k < w:  # alive under keep as well
                alive = 0
            elif k > w:
                alive = s
            elif before == 0 or ds[k].holds_inputs:  # its own line held it (or none did)
                alive = 0
            else:  # under keep it died after block w returned: the tail holds it now
                b = blocks[k]
                tail = b.fwd_tail if b.fwd_tail > NEVER else b.fwd_excess[ds[k]]
                alive = max(0, tail + s - b.fwd_excess[ds[k]])
            out.fwd[k] += s * before - alive
    return out


def _exact_terms(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[Decision],
    pre: int,
    groups: Sequence[SharedInput] = (),
) -> tuple[int, Where]:
    """:func:`activation_terms` of a plan without spans, in two running sums (forward and
    backward: see :func:`exit_view`), each tensor of ``groups`` counted once."""
    ds = decisions
    over = _extra_copies(blocks, ds, groups)
    saved_f = saved_b = 0
    peak, where = pre, _BEFORE
    for i, (b, d) in enumerate(zip(blocks, ds)):
        fwd = b.fwd_start - saved_f + b.fwd_excess[d] - over.fwd[i]
        if fwd > peak:
            peak, where = fwd, Where(Phase.FORWARD, b.name)
        x = b.exit_freed
        saved_f += b.retained[KEEP] + x.get(KEEP, 0) - b.retained[d] - x.get(d, 0)
        saved_b += b.retained[KEEP] - b.retained[d]
        bwd = b.bwd_start - saved_b + b.bwd_excess[d] - over.bwd[i]
        if bwd > peak:
            peak, where = bwd, Where(Phase.BACKWARD, b.name)
        if d in b.pre_exit and b.pre_exit[d] - saved_f - over.pre_exit > peak:
            peak, where = b.pre_exit[d] - saved_f - over.pre_exit, _AFTER
    if top - saved_b - over.top > peak:
        peak, where = top - saved_b - over.top, _AFTER
    return peak, where


def shared_view(
    blocks: Sequence[BlockCosts], groups: Sequence[SharedInput]
) -> list[BlockCosts]:
    """Terms never above the exact ones (:func:`_exact_terms`) for the solvers to try first
    where tensors are handed to several blocks: each counted by its last consumer only
    (the profile's terms count it by every consumer, never below the exact ones; see
    :func:`~remat.planner.stepmodel.derive._shared_inputs`). Where it dies before the last
    block, that consumer counts it in forward too (never above the exact terms unless it
    dies after a later block than its last consumer's window)."""
    out = [
        dataclasses.replace(b, retained=dict(b.retained), exit_freed=dict(b.exit_freed))
        for b in blocks
    ]
    n = len(out)
    for g in groups:
        last = max(g.consumers)
        for j in g.consumers:
            if j == last:
                continue
            b = out[j]
            for d in (KEEP, OFFLOAD):
                if d in b.retained:
                    b.retained[d] += g.bytes
                    if g.dies >= n and d in b.exit_freed:
                        b.exit_freed[d] -= g.bytes
    for b in out:
        if b.exit_freed and not any(b.exit_freed.values()):
            b.exit_freed = {}
    return out


def activation_terms(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[Decision],
    pre: int = 0,
    spans: Sequence[SpanLike] = (),
    groups: Sequence[SharedInput] = (),
    post: int = 0,
) -> tuple[int, Where]:
    """The activation peak and where it falls (``pre`` and ``post``: the terms before the
    blocks and in the backward of the layers before them, which no plan moves).

    Where an autocast region ends before backward (:func:`has_exit`), a plan without
    spans is exact in two running sums, and a plan with spans is bounded by the safe
    single-sum terms of :func:`exit_view` (never low; high by the cached casts of kept
    blocks in forward terms). The tensors of ``groups`` (the profile's
    :class:`~remat.planner.types.SharedInput` s) are counted once in a plan without spans;
    a plan with spans counts them once per checkpointed consumer (never low).
    """
    peak, where = _activation_terms(blocks, top, decisions, pre, spans, groups)
    return (post, _POST) if post > peak else (peak, where)


def _activation_terms(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[Decision],
    pre: int,
    spans: Sequence[SpanLike],
    groups: Sequence[SharedInput],
) -> tuple[int, Where]:
    if groups and not spans:
        return _exact_terms(blocks, top, decisions, pre, groups)
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
    decisions: Sequence[Decision],
    pre: int = 0,
    spans: Sequence[SpanLike] = (),
) -> int:
    """Activation peak (bytes above the step's start) the model predicts for a plan."""
    return activation_terms(blocks, top, decisions, pre, spans)[0]


def predicted_cost(
    blocks: Sequence[BlockCosts], decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> float:
    """Added time (or FLOPs) the model predicts for a plan."""
    if not spans:
        return float(sum(b.cost[d] for b, d in zip(blocks, decisions)))
    return float(sum(seg.cost for seg in layout(blocks, decisions, spans)))


def step_peak(
    prof: ProfileData, decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> StepPeak:
    """The peak of one step of the default loop under a plan (first and later steps).

    ``spans`` as in :func:`layout`.
    """
    base = prof.step_start
    static, kept, state = base["static"], base["gradients"], base["optimizer"]
    blocks, top = plan_terms(prof, decisions, spans)
    groups = prof.shared.groups
    act, where = activation_terms(blocks, top, decisions, prof.pre, spans, groups, prof.post)
    grads_at = _grads_at(prof, where)
    best = StepPeak(
        prof.static_step_bytes + act,
        where,
        {**base, "gradients": kept + grads_at, "activations": act - grads_at},
    )
    if prof.optim.name is None:
        return best
    end_act = prof.end_bytes - prof.end_grads
    grads = kept + prof.end_grads
    first = prof.optim.first_bytes
    later = prof.optim.later_bytes
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
    if where.phase is Phase.BEFORE_BLOCKS_BACKWARD:
        return int(prof.end_grads)
    return 0


def attribution(
    blocks: Sequence[BlockCosts], decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> tuple[dict[str, int], dict[str, float]]:
    """Per block, the bytes its decision saves at the peak and the time (or FLOPs) it adds,
    spans shared out among their blocks; they add up to the plan's saving and cost."""
    ds = decisions
    saved = {b.name: b.retained[KEEP] - b.retained[d] for b, d in zip(blocks, ds)}
    added = {b.name: float(b.cost[d]) for b, d in zip(blocks, ds)}
    for sp in map(Span.of, spans):
        a, z = sp.first, sp.last
        # the span's recompute runs its blocks once more: all of them when they are plain
        # or selective inside it, all but the last when each is checkpointed inside it
        whole = ds[a] in (KEEP, SELECTIVE)
        for j in range(a, z + 1 if whole else z):
            added[blocks[j].name] += float(blocks[j].cost.get(RECOMPUTE, 0.0))
        # block outputs inside a span are not kept either (what else their checkpoints hold
        # is, to the span's backward)
        inner = RECOMPUTE if ds[a] in (KEEP, SELECTIVE) else ds[a]
        for j in range(a, z):
            left = left_in_span(blocks, j, inner)
            saved[blocks[j].name] += blocks[j].retained[ds[j]] - left
        if whole:  # the last block leaves its output only
            r = blocks[z].retained
            saved[blocks[z].name] = r[KEEP] - r[RECOMPUTE]
        if sp.offloaded:  # the copies of the input, which is not on the device either
            added[blocks[a].name] += input_offload_cost(blocks, a)
            saved[blocks[a].name] += blocks[a].offload_input
    return saved, added


def unchecked_peak(prof: ProfileData) -> StepPeak:
    """The step's peak with every block kept."""
    return step_peak(prof, [KEEP] * len(prof.blocks))


def block_share(prof: ProfileData) -> float:
    """The share (0 to 1) of the unchecked step's activations that the blocks keep for
    backward: the sum of their ``retained[keep]`` against what the step holds above its
    start between the last block's forward and its backward, gradients excluded (``top -
    top_grads``: the blocks' saved tensors, those of the model's code outside them, the
    head's and the loss's); 0 when the step has none. What it leaves out is in code outside
    the blocks (a stem at full resolution, a large head, an encoder beside the planned
    decoder), which no plan of these blocks checkpoints.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> prof = remat.profile(model, torch.randn(32, 64), timer="flops")
        >>> round(block_share(prof), 2)
        1.0
    """
    activations = prof.top - prof.top_grads
    if activations <= 0:
        return 0.0
    kept = sum(b.retained.get(KEEP, 0) for b in prof.blocks)
    return min(max(kept / activations, 0.0), 1.0)


def head_bytes(prof: ProfileData) -> int:
    """The bytes of the head and the loss at their peak (every block kept): what the step
    holds after the last block's forward (``top``) less what is alive when that forward
    ends (the blocks' kept tensors, the last block's output and what the model's code
    holds). 0 without blocks."""
    if not prof.blocks:
        return 0
    last = prof.blocks[-1]
    return max(0, prof.top - last.fwd_start - last.retained[Decision.KEEP])
