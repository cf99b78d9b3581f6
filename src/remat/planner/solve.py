"""``remat.plan``: the least-cost plan that meets a budget; :class:`Profile` and :class:`Plan`.

Planning is two exact solves over the same constraints (every activation term of the
step model, :mod:`remat.planner.stepmodel`, ``<= budget``):

1. the least predicted added cost ``C*``;
2. among plans costing at most ``C* + tolerance`` (the timing noise, 0 for
   FLOPs), the simplest: fewest non-``keep`` blocks, weighted ``keep`` <
   ``selective`` < ``recompute`` < ``offload`` < ``split``, then earlier blocks first
   (:func:`~remat.planner.chain.simplicity`). The second objective is integral and
   depends on bytes and structure only, so near-ties from timing noise always resolve
   the same way.

Before a plan is returned its predicted cost is compared with every uniform plan a user
could pick by hand (:func:`uniform_plans`: none, every block or every ``k``-th block under
one decision) that meets the budget under the step model's exact peak: a cheaper one is
returned instead (:func:`cheaper_uniform`; the solvers search those plans too, so this acts
only where their terms are a bound).

With spans (the default) the chain dynamic program (:mod:`remat.planner.chain`) does
both; without, the per-block solvers (:mod:`remat.planner.perblock`: HiGHS or a dynamic
program). The floor (the smallest reachable peak), the plan's table and ``PlanError``'s
numbers all come from the same step model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from ..engine.errors import PlanError
from . import advice
from .apply import apply_plan
from .chain import (
    TooManyStates,
    cost_to_go,
    segment_table,
    simplest,
    smallest,
    unpack,
)
from .perblock import solve_dp, solve_milp
from .render import miss_message, plan_table
from .stepmodel import (
    attribution,
    block_share,
    budget_of,
    predicted_cost,
    predicted_peak,
    share_note,
    solver_terms,
    step_peak,
    unchecked_peak,
    with_scratch,
)
from .types import (
    BlockCosts,
    Decision,
    PlanData,
    ProfileData,
    Span,
    SpanLike,
    StepPeak,
    as_decisions,
)

__all__ = [
    "Plan",
    "Profile",
    "floor",
    "plan",
    "smallest_chain",
    "smallest_peak",
    "solve",
    "solve_chain",
]


class Profile(ProfileData):
    """Measured costs of a model's training step and candidate blocks; input of
    :func:`remat.plan` (the fields: :class:`~remat.planner.types.ProfileData`), with the
    step model's answers.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(8, 16), timer="flops")
        >>> prof.floor_bytes <= prof.unchecked_peak_bytes
        True
    """

    def peak(self, decisions: Sequence[str], spans: Sequence[SpanLike] = ()) -> StepPeak:
        """The step model's peak for a plan: one decision per block and spans as
        :class:`~remat.planner.types.Span` s (or ``(first, last)`` block indices); the
        decisions by name (``"keep"``) or as :class:`~remat.planner.types.Decision` s."""
        return step_peak(self, as_decisions(decisions), spans)

    @property
    def unchecked_peak_bytes(self) -> int:
        """Predicted peak of a step with every block kept (absolute bytes of tensors; the
        allocator's adds at most ``scratch.bytes``)."""
        return unchecked_peak(self).bytes

    @property
    def floor_bytes(self) -> int:
        """The smallest predicted step peak any plan reaches (absolute bytes of tensors):
        the smallest budget :func:`remat.plan` meets is at most this plus
        ``scratch.bytes`` (exactly :attr:`smallest_budget_bytes`)."""
        return floor(self)[2].bytes

    @property
    def smallest_budget_bytes(self) -> int:
        """The smallest budget :func:`remat.plan` meets: the smallest step peak any plan
        reaches with the scratch inside operators counted where it happens (the
        allocator's peak, :func:`~remat.planner.stepmodel.allocator_peak`)."""
        return floor(with_scratch(self))[2].bytes


class Plan(PlanData):
    """One decision per candidate block, with what the step model predicts for it (the
    fields: :class:`~remat.planner.types.PlanData`). ``str(plan)`` is its table."""

    def apply(self, model: nn.Module) -> nn.Module:
        """Checkpoint ``model``'s blocks in place as decided; returns the model."""
        return apply_plan(self, model)

    def __str__(self) -> str:
        return plan_table(self)


_HOST = torch.device("cpu")
"""Where the chain dynamic program's tables are made, whatever device the caller made the
default (a model built under ``with torch.device("meta"):`` is often planned inside it)."""


def solve_chain(
    blocks: Sequence[BlockCosts],
    top: int,
    budget: int,
    allowed: Sequence[str],
    *,
    max_span: int = 16,
    cost_cap: float | None = None,
    chained: Sequence[bool] | None = None,
    kept_outputs: Sequence[bool] | None = None,
) -> tuple[list[Decision], list[Span]] | None:
    """Exact optimum over per-block decisions and spans of consecutive blocks.

    The chain dynamic program of :mod:`remat.planner.chain` (Chen et al. 2016,
    arXiv:1604.06174; Griewank & Walther's Revolve, ACM TOMS 2000, for two nesting
    levels; heterogeneous costs and memory as in Beaumont et al. 2019, Rotor,
    arXiv:1911.13214). Without ``cost_cap``: a plan of the least cost; with it: the
    simplest plan whose cost is at most ``cost_cap``. Spans join block ``i`` to ``i + 1``
    only where ``chained[i]`` (default: everywhere), and never hold blocks ``i..i+2``
    where ``kept_outputs[i]`` (:func:`~remat.planner.chain.span_end`).

    Returns ``(decisions, spans)``, or ``None``.
    """
    n = len(blocks)
    with _HOST:
        t = segment_table(blocks, as_decisions(allowed), max(1, max_span), chained, kept_outputs)
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
    solver: Literal["milp", "dp", "chain"] = "milp",
    max_span: int = 1,
    chained: Sequence[bool] | None = None,
    kept_outputs: Sequence[bool] | None = None,
) -> tuple[list[Decision], list[Span]] | None:
    """The simplest plan within ``tolerance`` of the least cost: ``(decisions, spans)``, or
    ``None`` when none fits. ``max_span > 1`` allows spans (solved by :func:`solve_chain`);
    otherwise ``solver`` picks the MILP or the per-block DP."""
    allowed = as_decisions(allowed)
    if max_span > 1 or solver == "chain":
        n = len(blocks)
        with _HOST:
            t = segment_table(blocks, allowed, max(1, max_span), chained, kept_outputs)
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


def smallest_chain(
    blocks: Sequence[BlockCosts],
    top: int,
    allowed: Sequence[str],
    max_span: int,
    chained: Sequence[bool] | None = None,
    kept_outputs: Sequence[bool] | None = None,
) -> tuple[list[Decision], list[Span]]:
    """A plan (with spans up to ``max_span`` blocks, joining blocks only where ``chained``
    and ``kept_outputs`` allow: :func:`~remat.planner.chain.span_end`) of the smallest
    predicted activation peak."""
    with _HOST:
        t = segment_table(blocks, as_decisions(allowed), max(1, max_span), chained, kept_outputs)
        return unpack(t, smallest(t, len(blocks), top))


def smallest_peak(blocks: Sequence[BlockCosts], top: int, allowed: Sequence[str]) -> int:
    """The smallest predicted activation peak any plan without spans reaches."""
    return predicted_peak(blocks, top, smallest_chain(blocks, top, allowed, 1)[0])


def floor(
    profile: ProfileData, max_span: int = 16
) -> tuple[list[Decision], list[Span], StepPeak]:
    """The plan of the smallest predicted step peak (spans up to ``max_span`` blocks), and
    that peak."""
    terms = solver_terms(profile)
    # the safe terms' floor, and where those are a bound, the optimistic ones' (either may
    # be lower under the exact terms of step_peak)
    tries = [terms.blocks] + ([terms.optimistic] if terms.optimistic else [])
    # and without spans where the terms are a bound: a span plan is evaluated by its bound,
    # a per-block plan exactly, which may be lower
    longest = [max_span] + ([1] if terms.optimistic and max_span > 1 else [])
    plans = [
        smallest_chain(
            blocks,
            terms.top,
            profile.decisions,
            span,
            profile.spans_may_join,
            profile.outputs_kept,
        )
        for blocks in tries
        for span in longest
    ]
    ds, spans = min(plans, key=lambda p: step_peak(profile, *p).bytes)
    low = step_peak(profile, ds, spans)
    keep_all = unchecked_peak(profile)
    if keep_all.bytes < low.bytes:  # only with shared bytes: no checkpoint, nothing kept
        return [Decision.KEEP] * len(profile.blocks), [], keep_all
    return ds, spans, low


def uniform_plans(profile: ProfileData) -> list[list[Decision]]:
    """The plans a user picks by hand, simplest first: no checkpoint; then for each measured
    decision, every block under it and every ``k``-th block (the first of each ``k``, ``k``
    from 2 to the number of blocks). A block that cannot take a decision (one that changes
    its input in place) keeps."""
    n = len(profile.blocks)
    out = [[Decision.KEEP] * n]
    for d in profile.decisions:
        if d is Decision.KEEP:
            continue
        for k in range(1, n + 1):
            out.append(
                [
                    d if i % k == 0 and d in b.cost else Decision.KEEP
                    for i, b in enumerate(profile.blocks)
                ]
            )
    return out


def cheaper_uniform(alloc: ProfileData, budget: int, cost: float) -> list[Decision] | None:
    """The cheapest uniform plan (:func:`uniform_plans`) within ``budget`` under the
    allocator's terms (``alloc``: :func:`~remat.planner.stepmodel.with_scratch`) that costs
    less than ``cost`` (beyond float rounding), or ``None``: a plan the solvers return is
    never beaten, in predicted cost beyond the timing noise (:func:`plan` passes its cost
    less that noise), by one a user could pick by hand. The solvers search
    every uniform plan too, so this only acts where their terms (a bound, under spans or an
    autocast region's end) are looser than the step model's exact peak.

    Example:
        >>> import torch, remat
        >>> from remat.planner.stepmodel import with_scratch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        >>> prof = remat.profile(model, torch.randn(8, 16), timer="flops")
        >>> cheaper_uniform(with_scratch(prof), 10**9, cost=0.0) is None  # nothing costs less
        True
    """
    best: tuple[float, list[Decision]] | None = None
    below = cost - 1e-9 * max(abs(cost), 1e-30)  # float sums in another order are equal
    for ds in uniform_plans(alloc):
        c = predicted_cost(alloc.blocks, ds)
        if c >= below or (best is not None and c >= best[0]):
            continue
        if step_peak(alloc, ds).bytes <= budget:
            best = (c, ds)
    return None if best is None else best[1]


#: :func:`plan`'s solvers (``"auto"``: the MILP where scipy is installed, else the DP).
Solver = Literal["auto", "milp", "dp"]


def _solver(name: Solver) -> Literal["milp", "dp"]:
    if name not in ("auto", "milp", "dp"):
        raise ValueError(f"remat.plan: solver must be 'auto', 'milp' or 'dp', got {name!r}.")
    if name == "auto":
        try:
            import scipy.optimize  # noqa: F401

            return "milp"
        except ImportError:
            return "dp"
    return name


def _tolerance(profile: ProfileData, allowed: Sequence[Decision]) -> float:
    """Timing noise of a plan's cost: near-ties within it go to the simpler plan."""
    if profile.cost_unit != "s":
        return 0.0
    sq = 0.0
    for b in profile.blocks:
        sq += max([b.noise.get(d, 0.0) for d in allowed] + [0.0]) ** 2
    return math.sqrt(sq)


def _miss(
    profile: ProfileData,
    budget: int,
    ds: Sequence[Decision],
    spans: Sequence[Span],
    low: StepPeak,
    unchecked: StepPeak,
) -> str:
    """``PlanError``'s text: the floor plan's peak of tensors, and what the scratch inside
    operators adds to it (``low`` is its allocator peak; ``unchecked`` the unchecked step's)."""
    tensors = step_peak(profile, ds, spans)
    head = advice.loss_head(profile, tensors, ds, spans)
    return miss_message(budget, tensors, unchecked.bytes, low.bytes - tensors.bytes) + "".join(
        f" {d.message[:1].upper()}{d.message[1:]}" for d in head
    )


def _check_profile(profile: object) -> None:
    if not isinstance(profile, ProfileData):
        raise TypeError(
            f"remat.plan: profile must be a remat.Profile (from remat.profile(model, *inputs)), "
            f"got {type(profile).__name__} ({profile!r:.60}). Profile the model first, or call "
            "remat.auto_checkpoint(model, *inputs, budget=...) to do all steps at once."
        )


def plan(
    profile: ProfileData,
    budget: int | float | str,
    *,
    solver: Solver = "auto",
    spans: bool | None = None,
    max_span: int = 16,
) -> Plan:
    """Choose one decision per block: least predicted added time with predicted step peak <= budget.

    Near-ties (plans whose predicted costs differ by less than the timing
    noise the profile measured) go to the simpler plan, the same one every
    time (see :mod:`remat.planner.solve`).

    Args:
        profile: a :class:`~remat.Profile` from :func:`remat.profile`.
        budget: the peak of one training step in bytes (an int, or ``"18GiB"``;
            ``"18GB"`` is 18 * 10**9), counting parameters, gradients, optimizer
            state and activations, as ``torch.cuda.max_memory_allocated()`` does; or a
            percentage above ``0%`` (``"60%"``) of what the unchecked step allocates
            above its static bytes (parameters, buffers, inputs, kept gradients and
            optimizer state); that share counts gradients and optimizer state no plan removes,
            so a percentage no plan reaches raises ``PlanError`` naming the smallest
            reachable one. A bare number string (``"50"``) is refused, naming both readings
            (``"50%"`` or ``"50B"``). Anything else raises ``ValueError``/``TypeError``
            naming it.
        solver: ``"auto"`` (default), ``"dp"`` or ``"milp"``, all exact. With spans
            (the default) the chain dynamic program of :func:`solve_chain` plans
            (``"auto"`` and ``"dp"``); ``"milp"`` (HiGHS via scipy, the ``remat[plan]``
            extra) plans one decision per block, so it implies ``spans=False``. Without
            spans ``"auto"`` is milp when scipy is installed, else the per-block dynamic
            program.
        spans: also consider regions that span up to ``max_span`` consecutive
            blocks, the blocks inside plain (``keep``), checkpointed (``recompute``),
            selective (``selective``) or split into their children (``split``): this
            goes below the every-block floor, at the cost of recomputing the span's
            blocks once more. Only blocks the model calls back to back join a span
            (``Profile.chained``), and a block whose output the model keeps past the
            next block (a skip connection: ``Profile.kept_outputs``) is never in a
            span with the two blocks after it. ``None`` (default): ``True``, unless
            ``solver="milp"``. ``False``: one decision per block. A span plan costs at
            most what the best per-block plan costs.
        max_span: the longest span considered (blocks).

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: when no plan reaches the budget; the message gives the
            smallest reachable peak, where it falls, and what else would lower it.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(8, 16), timer="flops")
        >>> p = remat.plan(prof, "100%")
        >>> set(p.decisions.values())
        {'keep'}
    """
    _check_profile(profile)
    if isinstance(max_span, bool) or not isinstance(max_span, int) or max_span < 1:
        raise ValueError(f"remat.plan: max_span must be an int >= 1, got {max_span!r}.")
    if spans is not None and not isinstance(spans, bool):
        raise TypeError(f"remat.plan: spans must be True, False or None, got {spans!r}.")
    if spans and solver == "milp":
        raise ValueError(
            "remat.plan: solver='milp' plans one decision per block, got spans=True with it. "
            "Pass solver='auto' (or 'dp') to plan spans, or spans=False (or leave it out) "
            "for the MILP."
        )
    if spans and profile.compiled:
        raise ValueError(
            "remat.plan: spans=True with a compiled profile (compile=True): spans of compiled "
            "blocks are not planned; leave spans out."
        )
    if spans is None:
        spans = solver != "milp" and not profile.compiled
    checked = _solver(solver)
    longest = max_span if spans else 1
    budget_bytes = budget_of(profile, budget)
    # every term with the scratch inside operators of its window: the allocator's peak
    alloc = with_scratch(profile)
    unchecked = unchecked_peak(profile)
    checked_all = unchecked_peak(alloc)
    low_ds, low_spans, low = floor(alloc, longest)
    if low.bytes > budget_bytes:
        raise PlanError(
            _miss(profile, budget_bytes, low_ds, low_spans, low, checked_all)
            + share_note(profile, budget, low.bytes)
        )
    n = len(profile.blocks)
    found: tuple[list[Decision], list[Span]] | None = None
    if profile.shared.bytes and checked_all.bytes <= budget_bytes:
        found = ([Decision.KEEP] * n, [])  # no checkpoint: the shared bytes die in forward
    else:
        terms = solver_terms(alloc)
        # Where an autocast region ends before backward the solvers' single running sum
        # cannot be exact in forward: optimistic terms first (a plan that fits under the
        # exact ones is then optimal), else the safe ones (see stepmodel.exit_view).
        tries = [terms.blocks] if terms.optimistic is None else [terms.optimistic, terms.blocks]
        for blocks in tries:
            found = solve(
                blocks,
                terms.top,
                budget_bytes - profile.static_step_bytes,
                profile.decisions,
                tolerance=_tolerance(profile, profile.decisions),
                solver="chain" if spans else checked,
                max_span=longest,
                chained=profile.spans_may_join,
                kept_outputs=profile.outputs_kept,
            )
            if found is None or step_peak(alloc, *found).bytes <= budget_bytes:
                break
    if found is None:  # cannot happen when the floor fits; kept as a guard
        raise PlanError(_miss(profile, budget_bytes, low_ds, low_spans, low, checked_all))
    decisions, chosen = found
    # a uniform plan cheaper beyond the timing noise (within it the simpler plan was chosen)
    tolerance = _tolerance(profile, profile.decisions)
    rival = cheaper_uniform(alloc, budget_bytes, predicted_cost(alloc.blocks, *found) - tolerance)
    if rival is not None:  # the solvers' terms bound the step's where a uniform plan is exact
        decisions, chosen = rival, []
    peak = step_peak(profile, decisions, chosen)
    scratch = step_peak(alloc, decisions, chosen).bytes - peak.bytes
    blocks = profile.blocks
    saved, added = attribution(blocks, decisions, chosen)
    return Plan(
        decisions={b.name: d for b, d in zip(blocks, decisions)},
        predicted_peak_bytes=peak.bytes,
        predicted_overhead_s=predicted_cost(blocks, decisions, chosen),
        unchecked_peak_bytes=unchecked.bytes,
        budget_bytes=budget_bytes,
        saved_bytes=saved,
        added_cost=added,
        cost_unit=profile.cost_unit,
        static_bytes=profile.static_bytes,
        peak_at=peak.where,
        breakdown=peak.breakdown,
        peak_movable=peak.movable,
        scratch_bytes=scratch,
        peak_phase=peak.at.phase,
        block_share=block_share(profile),
        diagnostics=advice.loss_head(profile, peak, decisions, chosen),
        scratch_unknown=profile.from_shapes and not profile.scratch.located,
        compiled=profile.compiled,
        block_spans=chosen,
    )
