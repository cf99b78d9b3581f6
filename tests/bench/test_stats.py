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


def test_fastest_per_memory_walks_from_the_least_memory_up():
    # two rows at the least memory: the faster one; a row slower than a smaller one: left out
    assert stats.fastest_per_memory([100, 20, 20, 50, 60], [1.0, 1.3, 1.25, 1.1, 1.2]) == [2, 3, 0]


def test_load_above_the_cpus_counts_as_noisy_only_for_wall_clock_timing():
    ref = [1.0] * 5
    busy = dict(load_average=5.0, cpus=2)
    assert stats.noise(ref, [], wall_clock=True, **busy).noisy
    assert not stats.noise(ref, [], wall_clock=False, **busy).noisy
