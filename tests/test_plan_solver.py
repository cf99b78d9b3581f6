"""The planner's solvers on synthetic chains: DP, MILP and brute force agree exactly."""

from __future__ import annotations

import itertools
import random

import pytest

from remat import PlanError
from remat.planner.perblock import brute_force, solve_dp, solve_milp
from remat.planner.solve import Plan, smallest_chain, smallest_peak, solve
from remat.planner.stepmodel import BlockCosts, parse_budget, predicted_cost, predicted_peak
from remat.planner.types import Phase

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
    assert predicted_peak(blocks, top, smallest_chain(blocks, top, DECS, 1)[0]) == lo
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
    lo = predicted_peak(blocks, top, smallest_chain(blocks, top, DECS, 1)[0])
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
        static_bytes=2**20,
        peak_at="backward of 'blocks.0'",
        breakdown={"static": 2**20, "gradients": 2**19, "optimizer": 0, "activations": 3 * 2**19},
    )
    q = Plan.from_json(p.to_json())
    assert q == p
    text = str(p)
    assert "blocks.0" in text and "recompute" in text and "predicted step peak 3.00 MiB" in text
    assert "peak in backward of 'blocks.0': static 1.00 MiB, gradients 512.00 KiB" in text
    assert "optimizer.step()" not in text  # a movable peak names no lever


def test_plan_table_names_the_lever_when_the_optimizer_step_is_the_peak():
    p = Plan(
        decisions={"blocks.0": "keep"},
        predicted_peak_bytes=4 * 2**20,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=4 * 2**20,
        budget_bytes=4 * 2**20,
        peak_at="optimizer.step() of the first step (optimizer state created)",
        breakdown={"static": 2**20, "gradients": 2**20, "optimizer": 2**21, "activations": 0},
        peak_movable=False,
        peak_phase=Phase.OPTIMIZER_FIRST,
    )
    text = str(_round_trip(p))
    assert "no checkpointing plan lowers" in text and "shard the optimizer state" in text


def _round_trip(p: Plan) -> Plan:
    q = Plan.from_json(p.to_json())
    assert q == p
    return q


@pytest.mark.parametrize("extra", ['"peak_where": "x"', '"budget": 1'])
def test_plan_from_json_refuses_unknown_fields(extra):
    text = Plan(
        decisions={"blocks.0": "keep"},
        predicted_peak_bytes=1,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=1,
        budget_bytes=1,
    ).to_json()
    with pytest.raises(PlanError, match="unknown fields"):
        Plan.from_json(text.replace("{", "{" + extra + ", ", 1))


# ---------------------------------------------------------------- near-ties: the simplest plan


RETAINED = {"keep": 300, "selective": 100, "recompute": 20, "offload": 20}


def identical_chain(n: int, cost: dict[str, float]) -> tuple[list[BlockCosts], int]:
    """``n`` identical blocks whose only binding term is the one after the last block
    (``top - saved``): selective saves 200 bytes a block, recompute and offload 280."""
    decs = list(cost)
    blocks = [
        BlockCosts(
            name=f"blocks.{i}",
            retained={d: RETAINED[d] for d in decs},
            fwd_excess=dict.fromkeys(decs, 10),
            bwd_excess=dict.fromkeys(decs, 10),
            cost=dict(cost),
            fwd_start=0,
            bwd_start=0,
        )
        for i in range(n)
    ]
    return blocks, 1000


SOLVERS = ["milp", "dp", "chain"]


@pytest.mark.parametrize("solver", SOLVERS)
def test_equal_cost_ties_go_to_the_simplest_decision_on_the_earliest_block(solver):
    # one block must save 200 bytes: selective or recompute on any of 4 blocks, all costing 1
    blocks, top = identical_chain(4, {"keep": 0.0, "selective": 1.0, "recompute": 1.0})
    for _ in range(3):  # and the same plan every time
        found = solve(blocks, top, 800, ["keep", "selective", "recompute"], solver=solver)
        assert found == (["selective", "keep", "keep", "keep"], [])


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(
    "tolerance, expected",
    [
        (0.0, "recompute"),  # exact costs: the cheapest
        (0.1, "selective"),  # within the timing noise: the simpler
    ],
)
def test_near_ties_within_the_tolerance_go_to_the_simpler_plan(solver, tolerance, expected):
    blocks, top = identical_chain(3, {"keep": 0.0, "selective": 1.05, "recompute": 1.0})
    found = solve(
        blocks, top, 800, ["keep", "selective", "recompute"], tolerance=tolerance, solver=solver
    )
    assert found == ([expected, "keep", "keep"], [])


@pytest.mark.parametrize("solver", SOLVERS)
def test_recompute_is_simpler_than_offload(solver):
    blocks, top = identical_chain(3, {"keep": 0.0, "offload": 1.0, "recompute": 1.0})
    found = solve(blocks, top, 800, ["keep", "offload", "recompute"], solver=solver)
    assert found == (["recompute", "keep", "keep"], [])


@pytest.mark.parametrize("solver", SOLVERS)
def test_fewer_changed_blocks_beat_more_at_equal_cost(solver):
    # saving 280 bytes: one recompute (cost 2) or two selective blocks (cost 1 + 1)
    blocks, top = identical_chain(3, {"keep": 0.0, "selective": 1.0, "recompute": 2.0})
    found = solve(blocks, top, 720, ["keep", "selective", "recompute"], solver=solver)
    assert found == (["recompute", "keep", "keep"], [])
