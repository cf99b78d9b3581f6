"""``remat.plan`` and :class:`Plan`: decisions chosen by the solver, with the model's prediction."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from .._errors import PlanError
from .apply import apply_plan
from .model import (
    DECISIONS,
    StepPeak,
    checkpointed_view,
    exit_view,
    fmt_bytes,
    has_exit,
    input_offload_cost,
    parse_budget,
    predicted_cost,
)
from .solve import smallest_chain, solve


@dataclasses.dataclass
class Plan:
    """One decision per candidate block, with what the step model predicts for it.

    Bytes are absolute: the peak of one training step of the default loop
    (parameters, buffers, inputs, gradients, optimizer state and activations).
    ``predicted_peak_bytes`` counts tensor storages, as :mod:`remat.memory` measures
    them; the allocator (``torch.cuda.max_memory_allocated()``) also counts the
    scratch memory operators free before they return, at most ``scratch_bytes`` more.
    A plan keeps ``predicted_peak_bytes + scratch_bytes`` within ``budget_bytes``.

    Attributes:
        decisions: block name -> ``keep`` / ``recompute`` / ``selective`` / ``offload``.
        predicted_peak_bytes: predicted peak of a step under this plan (first and
            later steps).
        predicted_overhead_s: predicted added time per step (FLOPs when the
            profile was made with ``timer="flops"``; see ``cost_unit``).
        unchecked_peak_bytes: predicted peak with every block kept.
        budget_bytes: the budget the plan was made for.
        saved_bytes: block name -> bytes the decision saves at the peak.
        added_cost: block name -> time (or FLOPs) the decision adds.
        cost_unit: ``"s"`` or ``"flop"``.
        static_bytes: parameters, buffers and inputs.
        peak_at: where the predicted peak falls (``"backward of 'layers.0'"``,
            ``"optimizer.step() of the first step (optimizer state created)"``, ...).
        breakdown: the peak split into ``static``, ``gradients``, ``optimizer``
            and ``activations``.
        peak_movable: ``False`` when no plan can lower the peak (it is in the
            optimizer step or before the first block).
        spans: ``[first, last]`` block names of each region that spans consecutive
            blocks: one checkpointed region whose blocks run inside it as their
            decision says (``keep``: plain, one checkpoint over the span as in Chen et
            al.'s segments; ``recompute`` or ``split``: checkpointed inside it too).
        scratch_bytes: the largest scratch one operator allocates inside
            (``Profile.scratch_bytes``), added to the predicted peak for the budget.
        offloaded_spans: the spans (of ``spans``) whose input is kept in host memory
            until their own backward asks for it (on a device:
            ``apply_span(offload_inputs=True, prefetch=False)``).
    """

    decisions: dict[str, str]
    predicted_peak_bytes: int
    predicted_overhead_s: float
    unchecked_peak_bytes: int
    budget_bytes: int
    saved_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    added_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    cost_unit: str = "s"
    static_bytes: int = 0
    peak_at: str = ""
    breakdown: dict[str, int] = dataclasses.field(default_factory=dict)
    peak_movable: bool = True
    spans: list[list[str]] = dataclasses.field(default_factory=list)
    scratch_bytes: int = 0
    offloaded_spans: list[list[str]] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        """Plain JSON (no pickle)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`."""
        data = json.loads(text)
        bad = sorted(set(data.get("decisions", {}).values()) - set(DECISIONS))
        if bad:
            raise PlanError(f"Plan.from_json: unknown decisions {bad}; expected {list(DECISIONS)}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"Plan.from_json: unknown fields {unknown}; the JSON was not written by "
                "Plan.to_json of this remat version."
            )
        return cls(**data)

    def apply(self, model: Any) -> Any:
        """Checkpoint ``model``'s blocks in place as decided; returns the model."""
        return apply_plan(self, model)

    def __str__(self) -> str:
        unit = "s" if self.cost_unit == "s" else "FLOP"
        w = max([len("module")] + [len(n) for n in self.decisions])
        dw = max([10] + [len(d) + 2 for d in self.decisions.values()])
        if self.spans:
            dw = max(dw, max(len(f"recompute in span {a}..{b}") + 2 for a, b in self.spans))
            if self.offloaded_spans:
                dw += len(" (input offloaded)")
        lines = [f"{'module':<{w}}  {'decision':<{dw}}{'saves':>12}{'adds':>14}"]
        in_span = {}
        names = list(self.decisions)
        moved = {first for first, _ in self.offloaded_spans}
        for first, last in self.spans:
            for n in names[names.index(first) : names.index(last) + 1]:
                in_span[n] = f"{first}..{last}" + (" (input offloaded)" if first in moved else "")
        for name, d in self.decisions.items():
            if name in in_span:
                d = f"{d} in span {in_span[name]}"
            add = self.added_cost.get(name, 0.0)
            add_s = f"{add * 1e3:.2f} ms" if unit == "s" else f"{add:.3g} FLOP"
            lines.append(
                f"{name:<{w}}  {d:<{dw}}{fmt_bytes(self.saved_bytes.get(name, 0)):>12}{add_s:>14}"
            )
        total = sum(self.added_cost.values())
        total_s = f"{total * 1e3:.2f} ms" if unit == "s" else f"{total:.3g} FLOP"
        lines.append(
            f"{'total':<{w}}  {'':<{dw}}{fmt_bytes(sum(self.saved_bytes.values())):>12}{total_s:>14}"
        )
        scratch = (
            f" + {fmt_bytes(self.scratch_bytes)} scratch inside operators"
            if self.scratch_bytes
            else ""
        )
        lines.append(
            f"predicted step peak {fmt_bytes(self.predicted_peak_bytes)}{scratch} vs unchecked "
            f"{fmt_bytes(self.unchecked_peak_bytes)} (budget {fmt_bytes(self.budget_bytes)})"
        )
        if self.breakdown:
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.breakdown.items())
            lines.append(f"peak in {self.peak_at}: {parts}")
        if not self.peak_movable:
            lines.append(_lever(self.peak_at))
        return "\n".join(lines)


def _lever(where: str) -> str:
    """What lowers a peak that no checkpointing plan can move."""
    if where.startswith("optimizer.step()"):
        return (
            "The peak is in optimizer.step(), which no checkpointing plan lowers: use an "
            "optimizer with less state (SGD without momentum, a factored or 8-bit optimizer), "
            "foreach=False (fewer temporaries), or shard the optimizer state (FSDP2 "
            "fully_shard, ZeRO)."
        )
    return (
        f"The peak is {where}, where no checkpointing plan reaches: make the inputs or the "
        "layers before the first block smaller (batch, sequence length), or select them as "
        "blocks too (check_fn=...)."
    )


def _solver(name: str) -> str:
    if name not in ("auto", "milp", "dp"):
        raise ValueError(f"remat.plan: solver must be 'auto', 'milp' or 'dp', got {name!r}.")
    if name == "auto":
        try:
            import scipy.optimize  # noqa: F401

            return "milp"
        except ImportError:
            return "dp"
    return name


def _tolerance(profile: Any, allowed: list[str]) -> float:
    """Timing noise of a plan's cost: near-ties within it go to the simpler plan."""
    if profile.cost_unit != "s":
        return 0.0
    sq = 0.0
    for b in profile.blocks:
        sq += max([b.noise.get(d, 0.0) for d in allowed] + [0.0]) ** 2
    return math.sqrt(sq)


def budget_of(profile: Any, budget: int | float | str) -> int:
    """``budget`` in bytes for ``profile``: a percentage is of the activations, with the
    static bytes and the scratch inside operators (which no plan changes) on top."""
    scratch = int(getattr(profile, "scratch_bytes", 0))
    return parse_budget(
        budget, profile.static_step_bytes + scratch, profile.unchecked_peak_bytes + scratch
    )


def _check_profile(profile: Any) -> None:
    if not (hasattr(profile, "blocks") and hasattr(profile, "peak")):
        raise TypeError(
            f"remat.plan: profile must be a remat.Profile (from remat.profile(model, *inputs)), "
            f"got {type(profile).__name__} ({profile!r:.60}). Profile the model first, or call "
            "remat.auto_checkpoint(model, *inputs, budget=...) to do all steps at once."
        )


def plan(
    profile: Any,
    budget: int | float | str,
    *,
    solver: str = "auto",
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
            optimizer state). Anything else raises ``ValueError``/``TypeError`` naming it.
        solver: ``"auto"`` (default), ``"dp"`` or ``"milp"``, all exact. With spans
            (the default) the chain dynamic program of
            :func:`remat.planner.solve.solve_chain` plans (``"auto"`` and ``"dp"``);
            ``"milp"`` (HiGHS via scipy, the ``remat[plan]`` extra) plans one decision
            per block, so it implies ``spans=False``. Without spans ``"auto"`` is
            milp when scipy is installed, else the per-block dynamic program.
        spans: also consider regions that span up to ``max_span`` consecutive
            blocks, the blocks inside plain (``keep``), checkpointed (``recompute``),
            selective (``selective``) or split into their children (``split``): this
            goes below the every-block floor, at the cost of recomputing the span's
            blocks once more. Only blocks the model calls back to back join a span
            (``Profile.chained``), and a block whose output the model keeps past the
            next block (a skip connection: ``Profile.kept_outputs``) is never in a
            span with the two blocks after it. ``None
            (default): ``True``, unless ``solver="milp"``. ``False``: one decision
            per block. A span plan costs at most what the best per-block plan costs.
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
    blocks = profile.blocks
    allowed = list(profile.decisions)
    unchecked = profile.unchecked_peak_bytes
    static = profile.static_step_bytes
    scratch = int(getattr(profile, "scratch_bytes", 0))
    budget_bytes = budget_of(profile, budget)
    if spans is not None and not isinstance(spans, bool):
        raise TypeError(f"remat.plan: spans must be True, False or None, got {spans!r}.")
    if spans and solver == "milp":
        raise ValueError(
            "remat.plan: solver='milp' plans one decision per block, got spans=True with it. "
            "Pass solver='auto' (or 'dp') to plan spans, or spans=False (or leave it out) "
            "for the MILP."
        )
    if spans is None:
        spans = solver != "milp"
    checked = _solver(solver)
    name = "chain" if spans else checked
    longest = max_span if spans else 1
    chained = list(getattr(profile, "chained", []))
    if len(chained) != max(len(blocks) - 1, 0):  # not recorded: no spans
        chained = [False] * max(len(blocks) - 1, 0)
    held = list(getattr(profile, "kept", [])) or None
    top = profile.top
    shared = int(getattr(profile, "shared_bytes", 0))
    if shared:  # plans with a checkpoint keep what the forward passes to every block
        blocks, top = checkpointed_view(blocks, top, shared)
    exited = has_exit(blocks)  # an autocast region ends before backward: see exit_view
    safe = exit_view(blocks, safe=True) if exited else blocks
    floor_ds, floor_spans = smallest_chain(safe, top, allowed, longest, chained, held)
    floor = profile.peak(floor_ds, floor_spans)
    keep_all = profile.peak(["keep"] * len(blocks))
    if keep_all.bytes < floor.bytes:  # only when shared: no checkpoint, nothing kept
        floor_ds, floor_spans, floor = ["keep"] * len(blocks), [], keep_all
    if floor.bytes + scratch > budget_bytes:
        raise PlanError(_miss(budget_bytes, floor, unchecked, scratch))
    if shared and keep_all.bytes + scratch <= budget_bytes:
        found: tuple[list[str], list[tuple[int, ...]]] | None = (["keep"] * len(blocks), [])
    else:
        found = None
        # Where an autocast region ends before backward the solvers' single running sum
        # cannot be exact in forward: optimistic terms first (a plan that fits under the
        # exact ones is then optimal), else the safe ones (see exit_view).
        for terms in [exit_view(blocks, safe=False), safe] if exited else [blocks]:
            found = solve(
                terms,
                top,
                budget_bytes - static - scratch,
                allowed,
                tolerance=_tolerance(profile, allowed),
                solver=name,
                max_span=longest,
                chained=chained,
                held=held,
            )
            if found is None or profile.peak(*found).bytes + scratch <= budget_bytes:
                break
    if found is None:  # cannot happen when the floor fits; kept as a guard
        raise PlanError(_miss(budget_bytes, floor, unchecked, scratch))
    decisions, chosen_spans = found
    peak = profile.peak(decisions, chosen_spans)
    added = {b.name: float(b.cost[d]) for b, d in zip(blocks, decisions)}
    moved = [(sp[0], sp[1]) for sp in chosen_spans if len(sp) > 2 and sp[2]]
    for sp in chosen_spans:
        a, z = sp[0], sp[1]
        # the span's recompute runs its blocks once more: all of them when they are plain
        # or selective inside it, all but the last when each is checkpointed inside it
        whole = decisions[a] in ("keep", "selective")
        for j in range(a, z + 1 if whole else z):
            added[blocks[j].name] += float(blocks[j].cost.get("recompute", 0.0))
    for a, _ in moved:  # the copies of the offloaded input
        added[blocks[a].name] += input_offload_cost(blocks, a)
    saved = {b.name: b.retained["keep"] - b.retained[d] for b, d in zip(blocks, decisions)}
    for sp in chosen_spans:  # block outputs inside a span are not kept either
        a, z = sp[0], sp[1]
        for j in range(a, z):
            saved[blocks[j].name] += blocks[j].retained[decisions[j]]
        if decisions[a] in ("keep", "selective"):  # the last block leaves its output only
            r = blocks[z].retained
            saved[blocks[z].name] = r["keep"] - r["recompute"]
    for a, _ in moved:  # nor is the offloaded input, on the device
        saved[blocks[a].name] += blocks[a].offload_input
    return Plan(
        decisions={b.name: d for b, d in zip(blocks, decisions)},
        predicted_peak_bytes=peak.bytes,
        predicted_overhead_s=predicted_cost(blocks, decisions, chosen_spans),
        unchecked_peak_bytes=unchecked,
        budget_bytes=budget_bytes,
        saved_bytes=saved,
        added_cost=added,
        cost_unit=profile.cost_unit,
        static_bytes=profile.static_bytes,
        peak_at=peak.where,
        breakdown=peak.breakdown,
        peak_movable=peak.movable,
        spans=[[blocks[sp[0]].name, blocks[sp[1]].name] for sp in chosen_spans],
        scratch_bytes=scratch,
        offloaded_spans=[[blocks[a].name, blocks[z].name] for a, z in moved],
    )


def _miss(budget: int, floor: StepPeak, unchecked: int, scratch: int = 0) -> str:
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in floor.breakdown.items())
    if scratch:
        parts += f"; plus {fmt_bytes(scratch)} scratch inside operators"
    low = floor.bytes + scratch
    msg = (
        f"remat.plan: no plan keeps the predicted step peak within {fmt_bytes(budget)} "
        f"({budget} bytes); the smallest reachable peak is {fmt_bytes(low)} "
        f"({low} bytes, unchecked {fmt_bytes(unchecked + scratch)}), in {floor.where} "
        f"({parts}). "
    )
    if floor.movable:
        return msg + (
            "Raise the budget, use a smaller batch or sequence, or profile finer-grained "
            "blocks (check_fn=...)."
        )
    return msg + _lever(floor.where)
