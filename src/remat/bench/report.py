"""What ``remat bench`` prints and writes: the table, its footnotes, the recommendation, JSON.

Everything the table and the picture show is in :func:`to_json`'s data too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from . import stats
from .runner import Result, Row

TIE_LEGEND = (
    "tie: rows sharing a letter are within each other's spread (interquartile range of the "
    "per-round time ratios): their step times are not distinguishable on this run."
)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def footnotes(rows: Sequence[Row]) -> list[tuple[Row, str]]:
    """``(row, note)`` for every row with a note, in table order (marked [1], [2], ...)."""
    return [(r, r.note) for r in rows if r.note is not None]


def format_table(result: Result) -> str:
    """The results as a fixed-width table, with its footnotes and the tie legend."""
    rows = result.rows
    marks = {r.strategy: f" [{k}]" for k, (r, _) in enumerate(footnotes(rows), 1)}
    w = max([10, *(len(r.strategy) + len(marks.get(r.strategy, "")) + 2 for r in rows)])
    head = (
        f"{'strategy':<{w}}{'peak step':>11}{'mem x':>7}{'activations':>13}{'act x':>7}"
        f"{'step time':>11}{'time x':>8}{'spread':>13}{'tie':>5}{'max |dgrad|':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r.strategy + marks.get(r.strategy, "")
        spread = (
            "reference"
            if r.strategy == result.reference
            else f"{r.time_ratio_low:.2f}-{r.time_ratio_high:.2f}"
        )
        lines.append(
            f"{name:<{w}}{_mib(r.peak_bytes):>11}{r.memory_ratio:>7.2f}"
            f"{_mib(r.activation_bytes):>13}{r.activation_ratio:>7.2f}"
            f"{r.step_time_s * 1e3:>8.0f} ms{r.time_ratio:>8.2f}{spread:>13}{r.ties:>5}"
            f"{r.max_grad_diff:>13.2g}"
        )
    for k, (r, note) in enumerate(footnotes(rows), 1):
        lines.append(f"[{k}] {r.strategy}: {note}.")
    return "\n".join(lines)


def how_measured(result: Result) -> str:
    """One line: rounds, clock, threads."""
    clock = (
        "wall time"
        if result.clock == "wall"
        else "the thread's CPU time (one thread: time other processes take is not counted)"
    )
    return (
        f"step time: median of {result.rounds} interleaved rounds, {clock}, "
        f"{result.threads} thread{'s' if result.threads != 1 else ''}; time x: median of the "
        "per-round ratios to none, spread: their interquartile range."
    )


def recommendation(result: Result) -> str:
    """One line per recommended memory level, least memory first
    (:func:`remat.bench.stats.recommend`): the strategy that stands for it, its
    activations and step time as ratios to no checkpointing (the ``act x`` and ``time x``
    columns), and the strategies as fast as it at that memory, each named once.

    Example (the shape of the text)::

        Recommendation (the fastest at each memory level; rows within each other's spread
        count as equally fast):
          0.24x the activations: full, 1.36x the step time (as fast: torch-full)
          0.47x the activations: auto-50%, 1.15x the step time
          1.00x the activations: none (no checkpointing), with memory to spare
    """
    lines = [
        "Recommendation (the fastest at each memory level; rows within each other's spread "
        "count as equally fast):"
    ]
    for c in result.choices():
        r = result.rows[c.row]
        if r.strategy == result.reference:
            what = f"{r.strategy} (no checkpointing), with memory to spare"
        else:
            what = f"{r.strategy}, {r.time_ratio:.2f}x the step time"
        if c.ties:
            what += f" (as fast: {', '.join(result.rows[i].strategy for i in c.ties)})"
        lines.append(f"  {r.activation_ratio:.2f}x the activations: {what}")
    if result.noise.noisy:
        lines.append("Noisy run: see the timing note.")
    return "\n".join(lines)


def is_plan(strategy: str) -> bool:
    """Whether a row is a planned strategy (``auto-N%``, ``auto-floor-N%``): the others apply
    one rule to every block (or none), as a user would by hand."""
    return strategy.startswith("auto")


def hull_readings(result: Result) -> list[tuple[Row, stats.HullReading]]:
    """Each planned row read against the lower hull of the uniform rows of the same run
    (activation ratio against time ratio; :func:`remat.bench.stats.against_hull`)."""
    uniform = [
        stats.HullPoint(r.strategy, r.activation_ratio, r.time_ratio)
        for r in result.rows
        if not is_plan(r.strategy)
    ]
    return [
        (
            r,
            stats.against_hull(
                stats.HullPoint(r.strategy, r.activation_ratio, r.time_ratio),
                r.time_ratio_low,
                r.time_ratio_high,
                uniform,
            ),
        )
        for r in result.rows
        if is_plan(r.strategy)
    ]


_VERDICTS = {
    "below": "below it (faster beyond the plan's spread)",
    "on": "on it (within the plan's spread)",
    "above": "ABOVE it (slower beyond the plan's spread: a uniform strategy or a mix of two beats it)",
}


def against_uniform(result: Result) -> str:
    """One line per planned row: the hull of the uniform rows at its memory, where it lies
    against that hull, and the fastest uniform row within its memory; ``""`` without
    planned rows.

    Example (the shape of the text)::

        Plans against the uniform strategies (the lower hull of their act x / time x, this run):
          auto-50%: 0.48x the activations at 1.22x (1.16-1.25); the hull there 1.17x
            (full to every-2nd): on it (within the plan's spread); fastest uniform within
            its memory: full, 1.24x
    """
    readings = hull_readings(result)
    if not readings:
        return ""
    lines = [
        "Plans against the uniform strategies (the lower hull of their act x / time x, this run):"
    ]
    for r, h in readings:
        head = (
            f"  {r.strategy}: {r.activation_ratio:.2f}x the activations at {r.time_ratio:.2f}x "
            f"({r.time_ratio_low:.2f}-{r.time_ratio_high:.2f}); "
        )
        if h.time is None:
            where = "less memory than every uniform strategy (none reaches it)"
        else:
            at = " to ".join(h.between)
            where = f"the hull there {h.time:.2f}x ({at}): {_VERDICTS[h.verdict]}"
        fastest = (
            f"; fastest uniform within its memory: {h.fastest.name}, {h.fastest.time:.2f}x"
            if h.fastest is not None
            else ""
        )
        lines.append(head + where + fastest)
    return "\n".join(lines)


def to_json(
    result: Result,
    *,
    environment: dict[str, Any],
    skipped: Sequence[dict[str, str]],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the table and the picture show, as plain JSON data."""
    return {
        "environment": environment,
        "timing": {
            "rounds": result.rounds,
            "clock": result.clock,
            "threads": result.threads,
            "reference": result.reference,
            "reference_step_s": result.reference_step_s,
            "load_average_start": result.load_average[0],
            "load_average_end": result.load_average[1],
            "how": how_measured(result),
        },
        "rows": [dataclasses.asdict(r) for r in result.rows],
        "skipped": list(skipped),
        "footnotes": [{"strategy": r.strategy, "note": n} for r, n in footnotes(result.rows)],
        "recommendation": {
            "text": recommendation(result),
            "fastest_per_memory": [r.strategy for r in result.recommended()],
        },
        "noise": {**dataclasses.asdict(result.noise), "text": result.noise.describe()},
        "plans_vs_uniform": {
            "text": against_uniform(result),
            "rows": [
                {
                    "strategy": r.strategy,
                    "hull_time_ratio": h.time,
                    "between": list(h.between),
                    "verdict": h.verdict,
                    "fastest_uniform": None if h.fastest is None else h.fastest.name,
                }
                for r, h in hull_readings(result)
            ],
        },
        "tie_legend": TIE_LEGEND,
        **(extra or {}),
    }
