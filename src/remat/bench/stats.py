"""Reading step times of interleaved rounds: ratios, spread, ties, noise, recommendation.

Pure functions of the measured numbers (no timing here), so each rule is tested
with fixed inputs.

* **Paired ratios.** Every round runs one step of every strategy, back to back.
  A strategy's time ratio in a round is its step time over the reference's step
  time *in the same round*; the row's ratio is the median over rounds. A slow
  patch of the machine that hits a whole round cancels out of that round's ratios.
* **Spread.** The interquartile range of a row's per-round ratios (with fewer
  than :data:`MIN_ROUNDS_FOR_IQR` rounds, the full range). The reference's own
  ratio is 1 in every round: its spread is nil by construction, its step
  times' spread is reported apart.
* **Ties.** Two rows whose spreads overlap are not distinguishable. Rows are
  given letters (a "compact letter display"): rows that share a letter are
  within each other's spread; a letter of its own means the row is told apart
  from every other row. The letters are the maximal sets of rows whose spreads
  share a common point, ordered by median.
* **Noise.** A run is called noisy when the reference's step times vary by more
  than :data:`NOISY_REFERENCE` (interquartile range over median) or the paired
  ratios by more than :data:`NOISY_RATIO` (median over rows of the interquartile
  range over the median), or the load average exceeded the CPU count. Both
  thresholds were set on the project's 2-core CI machine: quiet runs stayed
  under 5% and 3%, runs sharing the cores with test suites went to 20-200%.
* **Recommendation.** One strategy per memory level, chosen so that the same
  machine gives the same answer run after run. Memory is measured exactly, so the
  levels (rows of equal activation memory, as the table rounds it) do not move;
  only times are noisy, so times decide only where they are told apart. At each
  level the rows whose spreads overlap the fastest one's are as fast as it: the
  first of them in the table's order (fixed) stands for the level, and the rows of
  the level within its spread are named as its ties. Walking from the least memory up, a level is recommended when its
  row is faster than the last recommended one beyond both spreads; a level whose
  row is not told apart from it is left out (as fast, with more memory). A
  ranking by medians alone would flip between rows a few percent apart.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

MIN_ROUNDS_FOR_IQR = 5
"""Below this many rounds the spread is the full range (quartiles of 3 values say little)."""

NOISY_REFERENCE = 0.15
"""Interquartile range over median of the reference's step times above which a run is noisy."""

NOISY_RATIO = 0.08
"""Median relative interquartile range of the paired ratios above which a run is noisy."""


@dataclasses.dataclass(frozen=True)
class Spread:
    """Median and spread (low, high) of a sample."""

    median: float
    low: float
    high: float

    def overlaps(self, other: Spread) -> bool:
        """True when the two ranges share a point."""
        return self.low <= other.high and other.low <= self.high


def spread(values: Sequence[float]) -> Spread:
    """Median and interquartile range (full range below :data:`MIN_ROUNDS_FOR_IQR` values).

    Example:
        >>> spread([1.0, 2.0, 3.0, 4.0, 100.0])
        Spread(median=3.0, low=2.0, high=4.0)
        >>> spread([1.0, 3.0])
        Spread(median=2.0, low=1.0, high=3.0)
    """
    if not values:
        raise ValueError("spread: no values (at least one timed round is needed).")
    med = statistics.median(values)
    if len(values) < MIN_ROUNDS_FOR_IQR:
        return Spread(med, min(values), max(values))
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(med, q1, q3)


def paired_ratios(times: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per-round ratios ``times[r] / reference[r]`` (rounds in the same order).

    Example:
        >>> paired_ratios([2.0, 6.0], [1.0, 4.0])
        [2.0, 1.5]
    """
    if len(times) != len(reference):
        raise ValueError(
            f"paired_ratios: {len(times)} times but {len(reference)} reference times; "
            "every round must time every strategy."
        )
    return [t / r for t, r in zip(times, reference)]


def tie_letters(spreads: Sequence[Spread]) -> list[str]:
    """Letters per row: rows sharing a letter have overlapping spreads (not distinguishable).

    Example:
        >>> rows = [Spread(1.0, 1.0, 1.0), Spread(1.3, 1.2, 1.4), Spread(1.35, 1.3, 1.5)]
        >>> tie_letters(rows)
        ['a', 'b', 'b']
        >>> tie_letters([Spread(1.0, 1.0, 1.0), Spread(1.1, 0.9, 1.2), Spread(1.3, 1.15, 1.4)])
        ['a', 'ab', 'b']
    """
    n = len(spreads)
    # every maximal set of ranges with a common point contains some range's low end
    cliques = []
    for k in range(n):
        point = spreads[k].low
        members = frozenset(j for j in range(n) if spreads[j].low <= point <= spreads[j].high)
        cliques.append(members)
    maximal = {c for c in cliques if not any(c < other for other in cliques)}
    ordered = sorted(maximal, key=lambda c: (min(spreads[j].median for j in c), sorted(c)))
    letters = [""] * n
    for i, clique in enumerate(ordered):
        for j in sorted(clique):
            letters[j] += _letter(i)
    return letters


def _letter(i: int) -> str:
    """a..z, then aa, ab, ... (more than 26 groups only with very many strategies)."""
    out = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out = chr(ord("a") + r) + out
    return out


@dataclasses.dataclass(frozen=True)
class Noise:
    """How much the timing varied in a run, and whether that makes it noisy."""

    reference_spread: float
    ratio_spread: float
    load_average: float | None
    cpus: int
    noisy: bool

    def describe(self) -> str:
        """One sentence for the end of the table."""
        load = (
            ""
            if self.load_average is None
            else f", load average up to {self.load_average:.1f} on {self.cpus} CPUs"
        )
        measured = (
            f"step times of the reference varied {100 * self.reference_spread:.0f}% and time "
            f"ratios {100 * self.ratio_spread:.0f}% between rounds (interquartile range){load}"
        )
        if self.noisy:
            return (
                f"Noisy machine: {measured}. Differences smaller than the spread are not "
                "meaningful; rerun with more --steps, or where nothing else runs (other "
                "processes, or other virtual machines on the same host, disturb the timing)."
            )
        return f"Timing: {measured}; a quiet run."


def noise(
    reference_times: Sequence[float],
    ratio_spreads: Sequence[Spread],
    *,
    load_average: float | None,
    cpus: int,
    wall_clock: bool = True,
) -> Noise:
    """Judge a run's timing noise (thresholds in the module docstring).

    The load average counts only for wall-clock timing (a thread's CPU time does not
    include time the scheduler gave to other processes).

    Example:
        >>> n = noise([1.0, 1.02, 0.99, 1.01, 1.0], [Spread(1.3, 1.29, 1.31)], load_average=0.2, cpus=2)
        >>> n.noisy, round(n.reference_spread, 3)
        (False, 0.01)
    """
    ref = spread(reference_times)
    ref_rel = (ref.high - ref.low) / ref.median if ref.median > 0 else 0.0
    rels = [(s.high - s.low) / s.median for s in ratio_spreads if s.median > 0]
    ratio_rel = statistics.median(rels) if rels else 0.0
    busy = wall_clock and load_average is not None and load_average > cpus
    return Noise(
        reference_spread=ref_rel,
        ratio_spread=ratio_rel,
        load_average=load_average,
        cpus=cpus,
        noisy=ref_rel > NOISY_REFERENCE or ratio_rel > NOISY_RATIO or busy,
    )


@dataclasses.dataclass(frozen=True)
class Choice:
    """One recommended memory level: the row that stands for it and its ties (row indices)."""

    row: int
    ties: tuple[int, ...] = ()


def recommend(memory: Sequence[int], spreads: Sequence[Spread]) -> list[Choice]:
    """The recommended row of each memory level worth taking, least memory first (see the
    module docstring): ties at a level go to the row listed first.

    Example:
        >>> def s(m, lo, hi):
        ...     return Spread(m, lo, hi)
        >>> # none; full and torch-full (tied, torch-full's median lower); a 50% plan;
        >>> # a 30% plan as fast as full (more memory: left out)
        >>> rows = [s(1.0, 1.0, 1.0), s(1.31, 1.29, 1.33), s(1.30, 1.28, 1.32),
        ...         s(1.1, 1.08, 1.12), s(1.3, 1.27, 1.34)]
        >>> recommend([100, 20, 20, 48, 30], rows)
        [Choice(row=1, ties=(2,)), Choice(row=3, ties=()), Choice(row=0, ties=())]
    """
    levels: dict[int, list[int]] = {}
    for i, m in enumerate(memory):
        levels.setdefault(m, []).append(i)
    out: list[Choice] = []
    for m in sorted(levels):
        rows = levels[m]
        fastest = min(rows, key=lambda i: (spreads[i].median, i))
        # the first in the table's order of the rows as fast as the fastest
        row = next(i for i in rows if spreads[i].overlaps(spreads[fastest]))
        if out and not spreads[row].high < spreads[out[-1].row].low:
            continue  # not told apart from the last level taken, which uses less memory
        ties = tuple(i for i in rows if i != row and spreads[i].overlaps(spreads[row]))
        out.append(Choice(row, ties))
    return out


@dataclasses.dataclass(frozen=True)
class HullPoint:
    """A measured strategy as the hull reads it: its activation ratio and time ratio."""

    name: str
    memory: float
    time: float


def lower_hull(points: Sequence[HullPoint]) -> list[HullPoint]:
    """The lower convex hull of ``points`` (time against memory), least memory first.

    Between two hull points the line joining them is what the uniform strategies reach by
    the usual reading of a trade-off curve (a plan that lies above it is beaten by a mix of
    the two ends); points above the hull are dropped.

    Example:
        >>> pts = [HullPoint("none", 1.0, 1.0), HullPoint("full", 0.24, 1.3),
        ...        HullPoint("every-2nd", 0.55, 1.1), HullPoint("selective", 0.63, 1.25)]
        >>> [p.name for p in lower_hull(pts)]
        ['full', 'every-2nd', 'none']
    """
    pts = sorted(points, key=lambda p: (p.memory, p.time))
    hull: list[HullPoint] = []
    for p in pts:
        if hull and p.memory == hull[-1].memory:
            continue  # the faster of equal memory came first
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def _cross(o: HullPoint, a: HullPoint, b: HullPoint) -> float:
    return (a.memory - o.memory) * (b.time - o.time) - (a.time - o.time) * (b.memory - o.memory)


@dataclasses.dataclass(frozen=True)
class HullReading:
    """Where a plan lies against the uniform strategies' hull (:func:`against_hull`).

    Attributes:
        time: the hull's time ratio at the plan's memory; ``None`` when the plan uses less
            memory than every uniform strategy (no uniform strategy reaches it).
        between: the hull points the value was read between (one name at a point).
        verdict: ``"below"`` (faster than the hull beyond the plan's spread), ``"on"``
            (the hull's time within the plan's spread), ``"above"`` (slower beyond it) or
            ``"alone"`` (less memory than any uniform strategy).
        fastest: the fastest uniform strategy that uses no more activation memory than the
            plan (what a user would pick by hand under the same budget), or ``None``.
    """

    time: float | None
    between: tuple[str, ...]
    verdict: str
    fastest: HullPoint | None


def against_hull(
    plan: HullPoint, spread_low: float, spread_high: float, uniform: Sequence[HullPoint]
) -> HullReading:
    """Read ``plan`` (with its time ratio's spread) against the lower hull of ``uniform``.

    The hull's value at the plan's memory is the line between the two hull points around
    it, or a uniform strategy with less memory and less time where one is (it fits the
    same budget).

    Example:
        >>> uni = [HullPoint("none", 1.0, 1.0), HullPoint("full", 0.24, 1.3),
        ...        HullPoint("every-2nd", 0.55, 1.1)]
        >>> r = against_hull(HullPoint("auto-70%", 0.70, 1.08), 1.04, 1.15, uni)
        >>> round(r.time, 3), r.between, r.verdict, r.fastest.name
        (1.067, ('every-2nd', 'none'), 'on', 'every-2nd')
        >>> against_hull(HullPoint("auto-50%", 0.48, 1.3), 1.28, 1.32, uni).verdict
        'above'
    """
    within = [u for u in uniform if u.memory <= plan.memory + 1e-9]
    fastest = min(within, key=lambda u: (u.time, u.memory)) if within else None
    hull = lower_hull(uniform)
    if not hull or plan.memory < hull[0].memory - 1e-9:
        return HullReading(None, (), "alone", fastest)
    between: tuple[str, ...] = (hull[-1].name,)
    value = hull[-1].time
    at = [h for h in hull if abs(h.memory - plan.memory) <= 1e-9]
    for a, b in [] if at else zip(hull, hull[1:]):
        if a.memory - 1e-9 <= plan.memory <= b.memory + 1e-9:
            t = (plan.memory - a.memory) / (b.memory - a.memory)
            value, between = a.time + t * (b.time - a.time), (a.name, b.name)
            break
    if at:
        value, between = at[0].time, (at[0].name,)
    if fastest is not None and fastest.time < value:
        value, between = fastest.time, (fastest.name,)
    if spread_high < value:
        verdict = "below"
    elif spread_low > value:
        verdict = "above"
    else:
        verdict = "on"
    return HullReading(value, between, verdict, fastest)
