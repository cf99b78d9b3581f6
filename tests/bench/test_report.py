"""What ``remat bench`` prints and writes (remat.bench.report): recommendation, noise note,
table, JSON.

Fixed numbers stand in for measured times, so every rule is checked exactly.
"""

from __future__ import annotations

import json

from remat.bench import report, stats
from tests.support.bench import ACT, QUIET, make_result


def test_quiet_run_recommends_the_fastest_at_each_memory_level_and_names_ties():
    result = make_result(QUIET, ACT)
    assert not result.noise.noisy
    assert [r.strategy for r in result.recommended()] == ["full", "auto-50%", "none"]
    text = report.recommendation(result)
    assert text.startswith("Recommendation: for the least memory use full (0.20x the activations")
    assert "for 0.48x, auto-50% (1.05x)" in text and "with memory to spare, none" in text
    assert "torch-full (as full)" in text  # same memory, overlapping spread
    assert "every-2nd" not in text  # more memory than auto-50% and slower: not a choice
    assert text.count(". ") <= 2  # one or two sentences
    assert "Timing:" in result.noise.describe() and "a quiet run" in result.noise.describe()


def test_noisy_reference_is_detected_and_said():
    noisy = {**QUIET, "none": [1.0, 1.6, 0.9, 2.5, 1.0]}
    result = make_result({k: v for k, v in noisy.items()}, ACT)
    assert result.noise.noisy and result.noise.reference_spread > stats.NOISY_REFERENCE
    assert result.noise.describe().startswith("Noisy machine:")
    assert report.recommendation(result).endswith("Noisy run: see the timing note.")


def test_table_shows_spread_ties_and_footnotes():
    note = "no plan reaches 30% (remat.PlanError); the smallest reachable budget, 35%, was used"
    result = make_result(
        {**QUIET, "auto-30%": [1.25, 1.27, 1.26, 1.25, 1.26]},
        {**ACT, "auto-30%": 210},
        {"auto-30%": {"note": note, "plan": {"decisions": {"0": "recompute"}}}},
    )
    table = report.format_table(result)
    lines = table.splitlines()
    row = next(r for r in result.rows if r.strategy == "full")
    full = next(line for line in lines if line.startswith("full "))
    spread = f"{row.time_ratio_low:.2f}-{row.time_ratio_high:.2f}"
    assert full.split()[-3:] == [spread, row.ties, "0"]  # spread, tie letter, grad diff
    assert next(line for line in lines if line.startswith("none ")).count("reference") == 1
    assert any(line.startswith("auto-30% [1]") for line in lines)
    assert lines[-1] == f"[1] auto-30%: {note}."


def test_json_has_everything_the_table_and_picture_show():
    note = "fell back"
    result = make_result(
        {**QUIET, "auto-30%": [1.25, 1.27, 1.26, 1.25, 1.26]},
        {**ACT, "auto-30%": 210},
        {"auto-30%": {"note": note, "plan": {"decisions": {"0": "recompute"}}}},
    )
    data = json.loads(
        json.dumps(
            report.to_json(
                result,
                environment={"torch": "x"},
                skipped=[{"strategy": "offload", "reason": "needs a device"}],
            )
        )
    )
    rows = {r["strategy"]: r for r in data["rows"]}
    for r in result.rows:
        got = rows[r.strategy]
        for key in ("activation_ratio", "time_ratio", "time_ratio_low", "time_ratio_high", "ties"):
            assert got[key] == getattr(r, key)
    assert rows["auto-30%"]["details"]["plan"]["decisions"] == {"0": "recompute"}
    assert data["footnotes"] == [{"strategy": "auto-30%", "note": note}]
    assert data["skipped"] == [{"strategy": "offload", "reason": "needs a device"}]
    assert data["recommendation"]["text"] == report.recommendation(result)
    assert data["recommendation"]["fastest_per_memory"] == ["full", "auto-30%", "auto-50%", "none"]
    assert data["noise"]["text"] == result.noise.describe()
    assert data["timing"]["clock"] == "cpu" and data["timing"]["rounds"] == 5
