"""Reading a benchmark run: spread, ties, noise, recommendation, table, JSON, picture.

Fixed numbers stand in for measured times, so every rule is checked exactly.
"""

from __future__ import annotations

import json

import pytest

from remat.bench import report, stats
from remat.bench.runner import Result, Row


def make_result(
    times: dict[str, list[float]],
    act: dict[str, int],
    details: dict[str, dict] | None = None,
    load: float = 0.1,
) -> Result:
    """A run from per-round step times and activation bytes (``none`` is the reference)."""
    rows = []
    for name, ts in times.items():
        ratios = stats.paired_ratios(ts, times["none"])
        q, t = stats.spread(ratios), stats.spread(ts)
        rows.append(
            Row(
                strategy=name,
                description=f"{name} strategy",
                peak_bytes=act[name] + 1000,
                activation_bytes=act[name],
                step_time_s=t.median,
                step_time_low_s=t.low,
                step_time_high_s=t.high,
                memory_ratio=(act[name] + 1000) / (act["none"] + 1000),
                activation_ratio=act[name] / act["none"],
                time_ratio=q.median,
                time_ratio_low=q.low,
                time_ratio_high=q.high,
                step_times_s=ts,
                time_ratios=ratios,
                details=(details or {}).get(name, {}),
            )
        )
    letters = stats.tie_letters(
        [stats.Spread(r.time_ratio, r.time_ratio_low, r.time_ratio_high) for r in rows]
    )
    for r, tie in zip(rows, letters):
        r.ties = tie
    ref = rows[0]
    return Result(
        rows=rows,
        noise=stats.noise(
            ref.step_times_s,
            [stats.Spread(r.time_ratio, r.time_ratio_low, r.time_ratio_high) for r in rows[1:]],
            load_average=load,
            cpus=2,
        ),
        reference="none",
        rounds=len(ref.step_times_s),
        clock="cpu",
        threads=1,
        reference_step_s=ref.step_time_s,
        load_average=(load, load),
    )


QUIET = {
    "none": [1.00, 1.01, 0.99, 1.00, 1.00],
    "full": [1.30, 1.31, 1.29, 1.30, 1.31],
    "torch-full": [1.31, 1.30, 1.30, 1.32, 1.30],
    "every-2nd": [1.10, 1.12, 1.10, 1.11, 1.10],
    "auto-50%": [1.05, 1.06, 1.04, 1.05, 1.06],
}
ACT = {"none": 1000, "full": 200, "torch-full": 200, "every-2nd": 550, "auto-50%": 480}


def test_spread_is_the_interquartile_range_from_five_rounds_and_the_range_below():
    assert stats.spread([5.0, 1.0, 2.0, 3.0, 4.0]) == stats.Spread(3.0, 2.0, 4.0)
    assert stats.spread([1.0, 9.0, 2.0]) == stats.Spread(2.0, 1.0, 9.0)  # < 5 rounds: min-max
    with pytest.raises(ValueError, match="at least one timed round"):
        stats.spread([])


def test_paired_ratios_cancel_a_slow_round():
    # round 2 ran while the machine was busy: every strategy 3x slower in it
    ref = [1.0, 3.0, 1.0]
    full = [1.3, 3.9, 1.3]
    assert stats.paired_ratios(full, ref) == pytest.approx([1.3, 1.3, 1.3])
    with pytest.raises(ValueError, match="every round must time every strategy"):
        stats.paired_ratios([1.0], ref)


@pytest.mark.parametrize(
    "spreads, letters",
    [
        # apart from each other: one letter each, ordered by median
        ([(1.0, 1.0, 1.0), (1.3, 1.2, 1.4), (2.0, 1.9, 2.1)], ["a", "b", "c"]),
        # all overlapping: one group
        ([(1.0, 0.9, 1.2), (1.1, 1.0, 1.3), (1.2, 1.1, 1.4)], ["a", "a", "a"]),
        # a chain: the middle one ties with both ends, the ends are told apart
        ([(1.0, 1.0, 1.0), (1.1, 0.9, 1.2), (1.3, 1.15, 1.4)], ["a", "ab", "b"]),
        # touching ranges share a point: tied
        ([(1.0, 0.9, 1.0), (1.1, 1.0, 1.2)], ["a", "a"]),
    ],
)
def test_tie_letters_group_rows_whose_spreads_overlap(spreads, letters):
    got = stats.tie_letters([stats.Spread(*s) for s in spreads])
    assert got == letters
    for i, a in enumerate(spreads):  # the invariant: sharing a letter <=> overlapping ranges
        for j, b in enumerate(spreads):
            overlap = a[1] <= b[2] and b[1] <= a[2]
            assert bool(set(got[i]) & set(got[j])) == overlap


def test_fastest_per_memory_walks_from_the_least_memory_up():
    # two rows at the least memory: the faster one; a row slower than a smaller one: left out
    assert stats.fastest_per_memory([100, 20, 20, 50, 60], [1.0, 1.3, 1.25, 1.1, 1.2]) == [2, 3, 0]


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


def test_load_above_the_cpus_counts_as_noisy_only_for_wall_clock_timing():
    ref = [1.0] * 5
    busy = dict(load_average=5.0, cpus=2)
    assert stats.noise(ref, [], wall_clock=True, **busy).noisy
    assert not stats.noise(ref, [], wall_clock=False, **busy).noisy


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


def test_spread_labels_keep_order_and_gap_within_bounds():
    from remat.bench.plot import spread_labels

    wanted = [0.5, 0.5, 0.5, 0.51, 0.95, 0.96, 0.0]
    ys = spread_labels(wanted, 0.1, low=0.05, high=0.95)
    order = sorted(range(len(wanted)), key=lambda i: (wanted[i], i))
    placed = [ys[i] for i in order]
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(placed, placed[1:]))
    assert 0.05 - 1e-9 <= min(ys) and max(ys) <= 0.95 + 1e-9


def test_picture_labels_and_caption_never_overlap(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (remat[plot]) is not installed")
    from remat.bench.plot import plot

    # many strategies at the same point: the case where labels collided before
    times = {"none": QUIET["none"]}
    act = {"none": 1000}
    for k in range(12):
        times[f"strategy-{k}"] = [1.3 + 0.001 * k] * 5
        act[f"strategy-{k}"] = 200 + k % 2
    result = make_result(times, act)
    path = tmp_path / "bench.png"
    fig, labels = plot(
        result.rows,
        str(path),
        recommended=[r.strategy for r in result.recommended()],
        caption=[report.recommendation(result), result.noise.describe()],
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure was closed after saving: draw it again
    canvas.draw()
    renderer = canvas.get_renderer()
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text, not its line
    boxes += [t.get_window_extent(renderer) for t in fig.texts]  # the caption
    ax = fig.axes[0]
    boxes += [ax.xaxis.label.get_window_extent(renderer), ax.title.get_window_extent(renderer)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert len(labels) == len(result.rows)
