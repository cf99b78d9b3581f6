"""Reading step times (remat.bench.stats): spread, paired ratios, ties, noise.

Fixed numbers stand in for measured times, so every rule is checked exactly.
"""

from __future__ import annotations

import pytest

from remat.bench import stats


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


def _s(median: float, half: float = 0.01) -> stats.Spread:
    return stats.Spread(median, median - half, median + half)


def test_recommend_walks_from_the_least_memory_up_and_keeps_levels_told_apart():
    # two rows at the least memory told apart: the faster; a row slower than a smaller one:
    # left out; the reference, faster than all: taken
    got = stats.recommend([100, 20, 20, 50, 60], [_s(1.0), _s(1.3), _s(1.25), _s(1.1), _s(1.2)])
    assert got == [stats.Choice(2), stats.Choice(3), stats.Choice(0)]


def test_recommend_names_a_tie_at_one_level_once_and_drops_a_tie_with_more_memory():
    spreads = [_s(1.0), _s(1.30, 0.03), _s(1.29, 0.03), _s(1.28, 0.03), _s(1.1)]
    got = stats.recommend([100, 20, 20, 30, 50], spreads)
    # full (row 1) stands for its level although torch-full (row 2) has the lower median;
    # the 30% row is as fast as full with more memory: not a level of its own
    assert got == [stats.Choice(1, (2,)), stats.Choice(4), stats.Choice(0)]


@pytest.mark.parametrize("jitter", [-0.01, -0.005, 0.0, 0.005, 0.01])
def test_recommend_is_the_same_when_noise_reorders_tied_medians(jitter):
    # run to run, tied rows swap medians by a few per mille: the answer stays
    spreads = [_s(1.0), _s(1.30 + jitter, 0.03), _s(1.30 - jitter, 0.03), _s(1.29, 0.03), _s(1.1)]
    assert stats.recommend([100, 20, 20, 30, 50], spreads) == [
        stats.Choice(1, (2,)),
        stats.Choice(4),
        stats.Choice(0),
    ]


def test_load_above_the_cpus_counts_as_noisy_only_for_wall_clock_timing():
    ref = [1.0] * 5
    busy = dict(load_average=5.0, cpus=2)
    assert stats.noise(ref, [], wall_clock=True, **busy).noisy
    assert not stats.noise(ref, [], wall_clock=False, **busy).noisy


def test_a_tie_is_named_only_when_within_the_chosen_rows_spread():
    # the bench run on the 2-core machine: auto-30% (wide spread) the fastest by median,
    # full and torch-full both within it, but torch-full told apart from full
    spreads = [_s(1.0, 0.0), _s(1.23, 0.02), _s(1.39, 0.04), stats.Spread(1.18, 1.08, 1.37)]
    assert stats.recommend([100, 24, 24, 24], spreads) == [
        stats.Choice(1, (3,)),  # full, as fast as auto-30%; not torch-full
        stats.Choice(0),
    ]


def _pt(name, memory, time):
    return stats.HullPoint(name, memory, time)


UNIFORM = [_pt("none", 1.0, 1.0), _pt("full", 0.24, 1.30), _pt("every-2nd", 0.55, 1.10),
           _pt("selective", 0.63, 1.25), _pt("torch-full", 0.24, 1.33)]


def test_lower_hull_drops_points_above_the_line_of_their_neighbours():
    assert [p.name for p in stats.lower_hull(UNIFORM)] == ["full", "every-2nd", "none"]
    # selective below the every-2nd-none line joins the hull
    low = [*UNIFORM[:3], _pt("selective", 0.63, 1.05)]
    assert [p.name for p in stats.lower_hull(low)] == ["full", "every-2nd", "selective", "none"]


@pytest.mark.parametrize(
    ("memory", "low", "high", "verdict", "between", "hull"),
    [
        # the line full (0.24, 1.30) - every-2nd (0.55, 1.10) at 0.48: 1.145
        (0.48, 1.16, 1.25, "above", ("full", "every-2nd"), 1.30 - 0.2 * 0.24 / 0.31),
        (0.48, 1.10, 1.20, "on", ("full", "every-2nd"), 1.30 - 0.2 * 0.24 / 0.31),
        (0.48, 1.02, 1.08, "below", ("full", "every-2nd"), 1.30 - 0.2 * 0.24 / 0.31),
        (0.55, 1.11, 1.12, "above", ("every-2nd",), 1.10),  # at a hull point
        (0.20, 1.40, 1.50, "alone", (), None),  # less memory than every uniform row
    ],
)
def test_a_plan_is_read_against_the_hull_at_its_memory(memory, low, high, verdict, between, hull):
    r = stats.against_hull(_pt("auto", memory, (low + high) / 2), low, high, UNIFORM)
    assert r.verdict == verdict and r.between == between
    assert (r.time is None) if hull is None else r.time == pytest.approx(hull)


def test_a_faster_uniform_row_with_less_memory_sets_the_hull_where_it_is_lower():
    # every-2nd at 0.55 is faster than the line from it to a slow "none" at 1.0
    uni = [_pt("full", 0.24, 1.30), _pt("every-2nd", 0.55, 1.05), _pt("none", 1.0, 1.10)]
    r = stats.against_hull(_pt("auto-70%", 0.70, 1.08), 1.07, 1.09, uni)
    assert r.time == pytest.approx(1.05) and r.between == ("every-2nd",)
    assert r.verdict == "above" and r.fastest.name == "every-2nd"


def test_the_fastest_uniform_row_is_taken_among_those_within_the_plans_memory():
    r = stats.against_hull(_pt("auto-30%", 0.30, 1.2), 1.19, 1.21, UNIFORM)
    assert r.fastest.name == "full"  # not torch-full (slower), not every-2nd (more memory)
