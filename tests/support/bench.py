"""A benchmark result from fixed step times (:mod:`remat.bench.runner`), for the report and picture tests."""

from __future__ import annotations

from remat.bench import stats
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
