"""The least-cost plan of one pipeline stage whose step fits a byte budget.

The stage's peak (:func:`~remat.planner.stepmodel.stage.stage_peak`) is the largest over its
schedule's moments of ``c(e) + h(e) * kept(plan) + term(e, plan)``: ``kept(plan) = K - S``
where ``S`` is what the plan's checkpoints save over the whole chain, ``h(e)`` the
microbatches in flight. ``S`` couples every block to every moment, which the chain dynamic
program (:mod:`remat.planner.chain`, over running sums of what the blocks *before* a term
saved) cannot take directly. For a target ``T`` of the total saved, every moment becomes a
bound on one microbatch's forward or backward terms (``term <= budget - c(e) - h(e) * (K -
T)``: one budget per phase, which shifting the forward and backward terms apart turns into
one), and ``S >= T`` is the chain's last term (``top - S <= budget``). :func:`solve_stage`
solves that for targets ``T`` on a grid from 0 to what the smallest plan saves, keeps the
plans whose exact peak fits, and returns the cheapest (among equals the fewest blocks
checkpointed, a span's blocks included, then the fewest spans): exact in what it predicts,
optimal up to the grid's step in ``T``.
"""

from __future__ import annotations

import dataclasses
import json

from torch import nn

from ...engine.errors import PlanError
from ..apply import apply_plan
from ..solve import floor, solve
from ..stepmodel import predicted_cost
from ..stepmodel.schedule import Action, in_flight
from ..stepmodel.stage import held_bytes, kept_bytes, stage_peak
from ..types import BlockCosts, Decision, PlanData, ProfileData, Span
from .measure import StageProfile
from .probe import PREFIX

GRID = 24
"""Targets of the total saved bytes tried between none and the smallest plan's."""


@dataclasses.dataclass
class StagePlan:
    """One stage's plan for its schedule and its predicted peak (absolute bytes of the rank).

    Attributes:
        stage / stages: the stage's index and how many there are.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        microbatches: per step; ``in_flight`` the most the stage holds at once.
        decisions: block name (the stage module's) -> decision.
        block_spans: the spans (:class:`~remat.planner.types.Span`: indices into
            ``decisions``); :attr:`spans` renders them as block names, as the JSON has them.
        budget_bytes: the rank's budget.
        predicted_peak_bytes: the predicted peak of a step of the schedule on this rank,
            its optimizer step included.
        peak_at: the moment it falls at (``"B1 (in flight 2, grads)"``, ...).
        unchecked_peak_bytes: the same with every block kept.
        predicted_overhead_s: the time the plan adds to one step (all microbatches), in
            ``cost_unit``.
        cost_unit: ``"s"`` or ``"flop"``.
    """

    stage: int
    stages: int
    schedule: str
    microbatches: int
    in_flight: int
    decisions: dict[str, Decision]
    block_spans: list[Span]
    budget_bytes: int
    predicted_peak_bytes: int
    peak_at: str
    unchecked_peak_bytes: int
    predicted_overhead_s: float
    cost_unit: str = "s"

    @property
    def spans(self) -> list[list[str]]:
        """``[first, last]`` block names of each span (:attr:`block_spans`, rendered)."""
        names = list(self.decisions)
        return [[names[sp.first], names[sp.last]] for sp in self.block_spans]

    def apply(self, module: nn.Module) -> nn.Module:
        """Checkpoint the stage module's blocks in place as decided; returns the module."""
        plan = PlanData(
            decisions=dict(self.decisions),
            predicted_peak_bytes=self.predicted_peak_bytes,
            predicted_overhead_s=self.predicted_overhead_s,
            unchecked_peak_bytes=self.unchecked_peak_bytes,
            budget_bytes=self.budget_bytes,
            block_spans=list(self.block_spans),
        )
        return apply_plan(plan, module)

    def to_json(self) -> str:
        """Plain JSON: the spans by their blocks' names, as stage plans always wrote them."""
        data = dataclasses.asdict(self)
        data = {k: (self.spans if k == "block_spans" else v) for k, v in data.items()}
        return json.dumps({("spans" if k == "block_spans" else k): v for k, v in data.items()},
                          indent=2)  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> StagePlan:
        """Read a plan written by :meth:`to_json` (another rank's, a saved one).

        Raises:
            PlanError: the JSON has fields this version does not know.
        """
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)} - {"block_spans"} | {"spans"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"StagePlan.from_json: unknown fields {unknown}; the JSON was not written by "
                "StagePlan.to_json of this remat version."
            )
        data["decisions"] = {n: Decision(d) for n, d in data["decisions"].items()}
        index = {n: i for i, n in enumerate(data["decisions"])}
        spans = data.pop("spans", [])
        missing = sorted({n for sp in spans for n in sp if n not in index})
        if missing:
            raise PlanError(
                f"StagePlan.from_json: spans name blocks {missing} that have no decision."
            )
        data["block_spans"] = [Span(index[a], index[z]) for a, z in spans]
        return cls(**data)

    def __str__(self) -> str:
        checked = {n: str(d) for n, d in self.decisions.items() if d is not Decision.KEEP}
        return (
            f"stage {self.stage}/{self.stages} ({self.schedule}, {self.microbatches} "
            f"microbatches, up to {self.in_flight} in flight): predicted peak "
            f"{self.predicted_peak_bytes:,} B of {self.budget_bytes:,} B at {self.peak_at} "
            f"(unchecked {self.unchecked_peak_bytes:,} B); checkpointed: {checked or 'none'}"
            + (f"; spans {self.spans}" if self.spans else "")
        )


def _shifted(prof: ProfileData, fwd: int, bwd: int) -> tuple[list[BlockCosts], int]:
    """The blocks and ``top`` with the forward terms moved by ``fwd`` and the backward ones
    by ``bwd``."""
    blocks = [
        dataclasses.replace(b, fwd_start=b.fwd_start + fwd, bwd_start=b.bwd_start + bwd)
        for b in prof.blocks
    ]
    return blocks, prof.top + bwd


def _merged(
    freed: ProfileData, kept: ProfileData, shifts: tuple[int, int, int]
) -> tuple[list[BlockCosts], int]:
    """One set of terms under one budget of 0: the forward terms (shifted by ``shifts[0]``),
    the first backward's (the freed profile's, by ``shifts[1]``) and the later backwards'
    (the kept profile's, by ``shifts[2]``), each block's backward the larger of the two."""
    f_blocks, f_top = _shifted(freed, shifts[0], shifts[1])
    k_blocks, k_top = _shifted(kept, shifts[0], shifts[2])
    out = []
    for fb, kb in zip(f_blocks, k_blocks):
        start = max(fb.bwd_start, kb.bwd_start)
        excess = {
            d: max(fb.bwd_start + v, kb.bwd_start + kb.bwd_excess.get(d, v)) - start
            for d, v in fb.bwd_excess.items()
        }
        out.append(dataclasses.replace(fb, bwd_start=start, bwd_excess=excess))
    return out, max(f_top, k_top)


def _candidate(
    sp: StageProfile, budget: int, target: int, max_span: int
) -> tuple[list[Decision], list[Span]] | None:
    """The least-cost plan whose one-microbatch terms fit the budgets the moments leave with
    at least ``target`` bytes saved (see the module's docstring), or ``None``."""
    fwd = first = later = budget  # what the running microbatch's terms may reach
    for e in sp.events:
        c = held_bytes(sp.sizes, e, sp.sizes.kept_keep - target)
        if e.action is Action.BETWEEN:
            if c > budget:
                return None
        elif e.action is Action.FORWARD:
            fwd = min(fwd, budget - c)
        elif e.grads:
            later = min(later, budget - c + sp.sizes.probe_loss)
        else:
            first = min(first, budget - c + sp.sizes.probe_loss)
    blocks, top = _merged(sp.freed, sp.kept, (-fwd, -first, -later))
    fixed = max(sp.freed.pre - fwd, sp.freed.post - first, sp.kept.post - later)
    if fixed > 0:  # a term no plan moves (before the blocks, after them in backward)
        return None
    top = max(top, target)  # the chain's last term: top - S <= 0 needs S >= target
    return solve(
        blocks,
        top,
        0,
        sp.freed.decisions,
        max_span=max_span,
        chained=sp.freed.spans_may_join,
        kept_outputs=sp.freed.outputs_kept,
    )


def solve_stage(sp: StageProfile, budget: int, *, max_span: int = 16) -> StagePlan:
    """The cheapest plan of the stage whose predicted peak is within ``budget`` (bytes).

    Raises:
        PlanError: no plan fits (the message gives the smallest peak reachable).

    Example:
        >>> import torch
        >>> from remat.planner.pipeline import profile_stage
        >>> stage = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
        >>> sp = profile_stage(stage, (torch.randn(8, 32),), schedule="gpipe", stage=0,
        ...     stages=2, microbatches=4, timer="flops")
        >>> [str(e) for e in sp.events][:2]
        ['F0 (in flight 0)', 'F1 (in flight 1)']
        >>> plan = solve_stage(sp, 10**9)
        >>> plan.in_flight, plan.predicted_peak_bytes == plan.unchecked_peak_bytes
        (4, True)
    """
    freed = sp.freed
    n = len(freed.blocks)
    keep = [Decision.KEEP] * n
    low_ds, low_spans, _ = floor(freed, max_span)
    most = sp.sizes.kept_keep - kept_bytes(freed, sp.sizes.kept_keep, low_ds, low_spans)
    uniform: list[tuple[list[Decision], list[Span]]] = [([d] * n, []) for d in freed.decisions]
    tried: list[tuple[list[Decision], list[Span]]] = [*uniform, (low_ds, low_spans)]
    for i in range(GRID + 1):
        found = _candidate(sp, budget, most * i // GRID, max_span)
        if found is not None:
            tried.append(found)
    best = None
    for ds, spans in tried:
        peak = stage_peak(freed, sp.kept, sp.sizes, sp.events, ds, spans)
        if peak.bytes > budget:
            continue
        cost = predicted_cost(freed.blocks, ds, spans) * sp.sizes.microbatches
        in_spans = sum(s.last - s.first + 1 for s in spans)
        checked = sum(d is not Decision.KEEP for d in ds) + in_spans
        rank = (cost, checked, len(spans))  # equal cost: fewer blocks checkpointed, no spans
        if best is None or rank < best[0]:
            best = (rank, ds, spans, peak)
    unchecked = stage_peak(freed, sp.kept, sp.sizes, sp.events, keep)
    if best is None:
        low = min(
            (stage_peak(freed, sp.kept, sp.sizes, sp.events, ds, s) for ds, s in tried),
            key=lambda m: m.bytes,
        )
        raise PlanError(
            f"remat: no plan of pipeline stage {sp.stage} fits {budget:,} bytes: the smallest "
            f"predicted peak is {low.bytes:,} bytes (at {low.at}; every block kept: "
            f"{unchecked.bytes:,}). Raise this rank's budget, use more microbatches of a "
            "smaller size, or more stages."
        )
    (cost, _, _), ds, spans, peak = best
    names = [b.name.removeprefix(PREFIX) for b in freed.blocks]
    return StagePlan(
        stage=sp.stage,
        stages=sp.stages,
        schedule=sp.schedule,
        microbatches=sp.sizes.microbatches,
        in_flight=in_flight(sp.schedule, sp.stage, sp.stages, sp.sizes.microbatches),
        decisions=dict(zip(names, ds)),
        block_spans=[Span(s.first, s.last) for s in spans],  # as the JSON has them
        budget_bytes=budget,
        predicted_peak_bytes=peak.bytes,
        peak_at=peak.at,
        unchecked_peak_bytes=unchecked.bytes,
        predicted_overhead_s=cost,
        cost_unit=freed.cost_unit,
    )
