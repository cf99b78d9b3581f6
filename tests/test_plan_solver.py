"""The planner's solvers on synthetic chains: DP, MILP and brute force agree exactly."""

from __future__ import annotations

import itertools
import random

import pytest

from remat.planner.model import BlockCosts, parse_budget, predicted_cost, predicted_peak
from remat.planner.plan import Plan
from remat.planner.solve import brute_force, smallest_peak, solve_dp, solve_milp

DECS = ("keep", "recompute", "selective")


def random_chain(seed: int, n: int) -> tuple[list[BlockCosts], int]:
    rng = random.Random(seed)
    blocks = []
    live = 1000
    for i in range(n):
        keep = rng.randint(200, 400)
        sel = rng.randint(60, keep - 50)
        rec = rng.randint(10, 40)
        retained = {"keep": keep, "selective": sel, "recompute": rec}
        blocks.append(
            BlockCosts(
                name=f"blocks.{i}",
                retained=retained,
                fwd_excess={d: rng.randint(20, 80) for d in DECS},
                bwd_excess={
                    "keep": rng.randint(20, 60),
                    "selective": rng.randint(100, 250),
                    "recompute": rng.randint(200, 450),
                },
                cost={
                    "keep": 0.0,
                    "selective": rng.randint(1, 5) / 10,
                    "recompute": rng.randint(6, 12) / 10,
                },
                fwd_start=live,
                bwd_start=0,
            )
        )
        live += keep
    top = live + 150
    # backward of block i starts with everything up to i alive (all-keep), plus some grads
    for i, b in enumerate(blocks):
        b.bwd_start = sum(x.retained["keep"] for x in blocks[: i + 1]) + 1000 + 30 * (n - i)
    return blocks, top


@pytest.mark.parametrize("seed", range(6))
def test_dp_milp_and_brute_force_find_the_same_optimum(seed):
    blocks, top = random_chain(seed, 5)
    lo = smallest_peak(blocks, top, DECS)
    hi = predicted_peak(blocks, top, ["keep"] * 5)
    assert lo == min(predicted_peak(blocks, top, ds) for ds in itertools.product(DECS, repeat=5))
    for budget in sorted({lo, (lo + hi) // 2, hi, lo + (hi - lo) // 4}):
        bf = brute_force(blocks, top, budget, DECS)
        dp = solve_dp(blocks, top, budget, DECS)
        mi = solve_milp(blocks, top, budget, DECS)
        assert bf is not None and dp is not None and mi is not None
        assert predicted_peak(blocks, top, dp) <= budget
        assert predicted_peak(blocks, top, mi) <= budget
        assert predicted_cost(blocks, dp) == pytest.approx(predicted_cost(blocks, bf), abs=1e-12)
        assert predicted_cost(blocks, mi) == pytest.approx(predicted_cost(blocks, bf), abs=1e-9)


def test_budget_below_smallest_peak_is_infeasible_for_every_solver():
    blocks, top = random_chain(1, 4)
    lo = smallest_peak(blocks, top, DECS)
    assert solve_dp(blocks, top, lo - 1, DECS) is None
    assert solve_milp(blocks, top, lo - 1, DECS) is None
    assert brute_force(blocks, top, lo - 1, DECS) is None


def test_milp_solves_a_hundred_blocks_and_matches_dp():
    blocks, top = random_chain(7, 100)
    lo = smallest_peak(blocks, top, DECS)
    hi = predicted_peak(blocks, top, ["keep"] * 100)
    budget = (lo + hi) // 2
    dp = solve_dp(blocks, top, budget, DECS)
    mi = solve_milp(blocks, top, budget, DECS)
    assert predicted_cost(blocks, mi) == pytest.approx(predicted_cost(blocks, dp), rel=1e-9)


@pytest.mark.parametrize(
    "budget, expected",
    [
        ("60%", 600),  # percentage of the reference
        ("12.5%", 125),
        (4096, 4096),  # bytes
        ("2KiB", 2048),
        ("1.5 MiB", int(1.5 * 2**20)),
        ("1.5 MB", 1_500_000),  # decimal prefixes are powers of 1000
        ("18GB", 18 * 10**9),
    ],
)
def test_parse_budget(budget, expected):
    assert parse_budget(budget, 0, 1000) == expected


def test_percent_budget_is_static_plus_a_share_of_what_the_step_allocates_above_it():
    assert parse_budget("50%", 400, 1000) == 700


def test_a_fraction_as_budget_suggests_a_percentage():
    with pytest.raises(ValueError, match="'50%'"):
        parse_budget(0.5, 0, 1000)


@pytest.mark.parametrize("bad", ["lots", "-5%", 0, -3, True])
def test_parse_budget_rejects_garbage_with_a_hint(bad):
    with pytest.raises((ValueError, TypeError), match="budget"):
        parse_budget(bad, 0, 1000)


def test_plan_json_round_trip_and_table():
    p = Plan(
        decisions={"blocks.0": "recompute", "blocks.1": "keep"},
        predicted_peak_bytes=3 * 2**20,
        predicted_overhead_s=0.012,
        unchecked_peak_bytes=5 * 2**20,
        budget_bytes=4 * 2**20,
        saved_bytes={"blocks.0": 2**20, "blocks.1": 0},
        added_cost={"blocks.0": 0.012, "blocks.1": 0.0},
    )
    q = Plan.from_json(p.to_json())
    assert q == p
    text = str(p)
    assert "blocks.0" in text and "recompute" in text and "predicted step peak 3.00 MiB" in text
