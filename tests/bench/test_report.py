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
    assert text.splitlines()[1:] == [  # one line per memory level, least memory first
        "  0.20x the activations: full, 1.30x the step time (as fast: torch-full)",
        "  0.48x the activations: auto-50%, 1.05x the step time",
        "  1.00x the activations: none (no checkpointing), with memory to spare",
    ]
    assert "every-2nd" not in text  # more memory than auto-50% and slower: not a choice
    assert "Timing:" in result.noise.describe() and "a quiet run" in result.noise.describe()


def test_noisy_reference_is_detected_and_said():
    noisy = {**QUIET, "none": [1.0, 1.6, 0.9, 2.5, 1.0]}
    result = make_result({k: v for k, v in noisy.items()}, ACT)
    assert result.noise.noisy and result.noise.reference_spread > stats.NOISY_REFERENCE
    assert result.noise.describe().startswith("Noisy machine:")
    assert report.recommendation(result).splitlines()[-1] == "Noisy run: see the timing note."


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


def test_recommendation_names_each_strategy_once_when_levels_tie():
    # the run: full, torch-full, auto-30% and auto-50% all within one spread; the
    # answer was "full, torch-full (as auto-30%); full, auto-30% (as auto-50%)"
    times = {
        "none": [1.00, 1.00, 1.00, 1.00, 1.00],
        "full": [1.30, 1.34, 1.28, 1.31, 1.33],
        "torch-full": [1.33, 1.30, 1.29, 1.32, 1.31],
        "auto-30%": [1.29, 1.33, 1.30, 1.31, 1.32],
        "auto-50%": [1.31, 1.30, 1.32, 1.29, 1.33],
    }
    act = {"none": 1000, "full": 240, "torch-full": 240, "auto-30%": 300, "auto-50%": 470}
    text = report.recommendation(make_result(times, act))
    assert text.splitlines()[1:] == [
        "  0.24x the activations: full, 1.31x the step time (as fast: torch-full)",
        "  1.00x the activations: none (no checkpointing), with memory to spare",
    ]


def test_each_plan_is_said_against_the_hull_of_the_uniform_rows():
    result = make_result(
        {**QUIET, "auto-30%": [1.40, 1.42, 1.41, 1.40, 1.41]}, {**ACT, "auto-30%": 300}
    )
    text = report.against_uniform(result)
    lines = text.splitlines()
    assert lines[0].startswith("Plans against the uniform strategies")
    # auto-50% at 0.48 (1.05x) lies below the full - every-2nd line there (1.15)
    assert lines[1].startswith("  auto-50%: 0.48x the activations at 1.05x (1.05-1.05)")
    assert "the hull there 1.15x (full to every-2nd): below it" in lines[1]
    assert "fastest uniform within its memory: full, 1.30x" in lines[1]
    # auto-30% at 0.30 and 1.41x: above the line (1.27x there)
    assert "auto-30%" in lines[2] and "ABOVE it" in lines[2]
    data = report.to_json(result, environment={}, skipped=[])["plans_vs_uniform"]
    assert data["text"] == text
    assert [(r["strategy"], r["verdict"]) for r in data["rows"]] == [
        ("auto-50%", "below"),
        ("auto-30%", "above"),
    ]


def test_no_plan_rows_means_no_hull_lines():
    result = make_result(
        {k: v for k, v in QUIET.items() if k != "auto-50%"},
        {k: v for k, v in ACT.items() if k != "auto-50%"},
    )
    assert report.against_uniform(result) == ""
