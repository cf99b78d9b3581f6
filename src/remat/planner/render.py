"""Text for people: the plan's table, the smallest reachable peak's error, byte sizes.

Rendered last from typed values (:mod:`remat.planner.types`); nothing parses it back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..engine.bytes import fmt_bytes
from .types import Phase, PlanData, StepPeak

#: What a step peak counts, said under every figure of one (the plan's table): the one
#: convention of a budget, :func:`remat.measure_peak`, ``PeakMeter`` and ``remat.verify``.
STEP_PEAK = (
    "step peak: parameters, buffers, inputs, gradients, optimizer state and activations "
    "together, as the budget, remat.measure_peak and PeakMeter count them"
)

#: Below this share of the unchecked step's activations in the blocks, the table warns.
LOW_SHARE = 0.5


def lever(phase: Phase | None, where: str) -> str:
    """What lowers a peak that no checkpointing plan can move (``where``: the peak's place
    in words)."""
    if phase in (Phase.OPTIMIZER_FIRST, Phase.OPTIMIZER_LATER):
        return (
            "The peak is in optimizer.step(), which no checkpointing plan lowers: use an "
            "optimizer with less state (SGD without momentum, a factored or 8-bit optimizer), "
            "foreach=False (fewer temporaries), or shard the optimizer state (FSDP2 "
            "fully_shard, ZeRO)."
        )
    if phase is Phase.AFTER_BLOCKS:
        return (
            f"The peak is {where}, where the head's and the loss's own tensors (logits, their "
            "softmax and gradient) stay whatever the blocks do: compute the loss in chunks (the "
            "head and the loss on slices of the sequence or batch, each slice checkpointed), "
            "or select the head as a block too (check_fn=...)."
        )
    return (
        f"The peak is {where}, where no checkpointing plan reaches: make the inputs or the "
        "layers before the first block smaller (batch, sequence length), or select them as "
        "blocks too (check_fn=...)."
    )


def _cost(value: float, unit: str) -> str:
    return f"{value * 1e3:.2f} ms" if unit == "s" else f"{value:.3g} FLOP"


def plan_table(plan: PlanData) -> str:
    """The plan as a table: each block's decision (and span), what it saves and adds, the
    predicted peak against the unchecked one and the budget, and where the peak falls."""
    w = max([len("module")] + [len(n) for n in plan.decisions])
    dw = max([10] + [len(d) + 2 for d in plan.decisions.values()])
    if plan.spans:
        dw = max(dw, max(len(f"recompute in span {a}..{b}") + 2 for a, b in plan.spans))
        if any(sp.offloaded for sp in plan.block_spans):
            dw += len(" (input offloaded)")
    lines = [f"{'module':<{w}}  {'decision':<{dw}}{'saves':>12}{'adds':>14}"]
    in_span = {}
    for sp, (first, last) in zip(plan.block_spans, plan.spans):
        for n in plan.members(sp):
            in_span[n] = f"{first}..{last}" + (" (input offloaded)" if sp.offloaded else "")
    for name, decision in plan.decisions.items():
        d = f"{decision} in span {in_span[name]}" if name in in_span else str(decision)
        saves = fmt_bytes(plan.saved_bytes.get(name, 0))
        adds = _cost(plan.added_cost.get(name, 0.0), plan.cost_unit)
        lines.append(f"{name:<{w}}  {d:<{dw}}{saves:>12}{adds:>14}")
    total = _cost(sum(plan.added_cost.values()), plan.cost_unit)
    saved = fmt_bytes(sum(plan.saved_bytes.values()))
    lines.append(f"{'total':<{w}}  {'':<{dw}}{saved:>12}{total:>14}")
    scratch = (
        f" + {fmt_bytes(plan.scratch_bytes)} scratch inside operators"
        if plan.scratch_bytes
        else ""
    )
    lines.append(
        f"predicted step peak {fmt_bytes(plan.predicted_peak_bytes)}{scratch} vs unchecked "
        f"{fmt_bytes(plan.unchecked_peak_bytes)} (budget {fmt_bytes(plan.budget_bytes)})"
    )
    lines.append(STEP_PEAK)
    if plan.scratch_unknown:
        lines.append(
            "planned from shapes: the scratch inside operators (cuBLAS, oneDNN) is not counted; "
            "remat.auto_checkpoint measures it in one step of the planned model"
        )
    if plan.breakdown:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.breakdown.items())
        lines.append(f"peak in {plan.peak_at}: {parts}")
    if not plan.peak_movable:
        lines.append(lever(plan.peak_phase, plan.peak_at))
    if plan.block_share is not None:
        lines.append(
            f"blocks: {name_ranges(list(plan.decisions))} (they keep "
            f"{100 * plan.block_share:.0f}% of the unchecked step's activations)"
        )
        note = coverage_note(plan.block_share)
        if note is not None:
            lines.append(f"warning: {note}")
    lines.extend(str(d) for d in plan.diagnostics)
    return "\n".join(lines)


def coverage_note(share: float) -> str | None:
    """The table's warning when the blocks keep less than :data:`LOW_SHARE` of the unchecked
    step's activations (``share``: :func:`~remat.planner.stepmodel.block_share`), else
    ``None``: how much they cover and how to pick others.

    Example:
        >>> coverage_note(0.9) is None, coverage_note(0.2)[:44]
        (True, 'the candidate blocks keep 20% of the uncheck')
    """
    if share >= LOW_SHARE:
        return None
    return (
        f"the candidate blocks keep {100 * share:.0f}% of the unchecked step's activations; "
        "the rest is in code outside them, which no plan of these blocks checkpoints. Pass "
        "check_fn=lambda name, module: ... to plan the modules that hold it."
    )


def name_ranges(names: Sequence[str]) -> str:
    """The block names, consecutive indices of one stack as a range, for the table.

    Example:
        >>> name_ranges(["encoder.block.0", "encoder.block.1", "encoder.block.2",
        ...              "decoder.block.0", "head"])
        'encoder.block.0-2, decoder.block.0, head'
    """
    parts: list[str] = []
    run: tuple[str, int, int] | None = None  # prefix, first, last
    for name in names:
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m and run and m[1] == run[0] and int(m[2]) == run[2] + 1:
            run = (run[0], run[1], int(m[2]))
            continue
        if run:
            parts.append(_range(run))
        run = (m[1], int(m[2]), int(m[2])) if m else None
        if not m:
            parts.append(name)
    if run:
        parts.append(_range(run))
    return ", ".join(parts)


def _range(run: tuple[str, int, int]) -> str:
    prefix, first, last = run
    return f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"


def miss_message(budget: int, floor: StepPeak, unchecked: int, scratch: int = 0) -> str:
    """``PlanError``'s text when no plan reaches ``budget``: the smallest reachable peak
    (``floor``, of tensors, plus ``scratch`` inside operators there), where it falls, what it
    is made of, and what else would lower it; ``unchecked``: the unchecked step's peak as
    the budget counts it (its scratch included)."""
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in floor.breakdown.items())
    if scratch:
        parts += f"; plus {fmt_bytes(scratch)} scratch inside operators"
    low = floor.bytes + scratch
    msg = (
        f"remat.plan: no plan keeps the predicted step peak within {fmt_bytes(budget)} "
        f"({budget} bytes); the smallest reachable peak is {fmt_bytes(low)} "
        f"({low} bytes, unchecked {fmt_bytes(unchecked)}), in {floor.where} "
        f"({parts}). "
    )
    if floor.movable:
        return msg + (
            "Raise the budget, use a smaller batch or sequence, or profile finer-grained "
            "blocks (check_fn=...)."
        )
    return msg + lever(floor.at.phase, floor.where)
