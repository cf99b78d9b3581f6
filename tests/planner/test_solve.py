"""remat.plan and the solvers (remat.planner.solve): DP, MILP and brute force agree exactly on
synthetic chains; budgets as percentages and sizes; near-ties go to the simplest plan, the
same plan every time.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import remat
from remat.planner.perblock import brute_force, solve_dp, solve_milp
from remat.planner.solve import smallest_chain, smallest_peak, solve
from remat.planner.stepmodel import parse_budget, predicted_cost, predicted_peak
from remat.planner.types import BlockCosts
from tests.support.chains import DECS, random_chain
from tests.support.models import ResMLP
from tests.support.plans import make_model, per_block_floor

pytestmark = pytest.mark.usefixtures("one_thread")


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


# ---------------------------------------------------------------- budgets


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


@pytest.mark.parametrize("pct", [25, 50, 60, 90, 100, 150])
def test_percentage_budget_is_static_plus_that_share_of_the_rest(adamw_profile, pct):
    prof = adamw_profile
    static, unchecked = prof.static_step_bytes, prof.unchecked_peak_bytes
    assert static == prof.static_bytes + prof.optim.state_bytes  # gradients None
    expected = static + (unchecked - static) * pct // 100
    assert parse_budget(f"{pct}%", static, unchecked) == expected
    # the largest scratch inside operators is on top of the share, as the static bytes are;
    # a budget under the smallest one a plan meets (its peak and the scratch there) is refused
    if expected + prof.scratch.bytes < prof.smallest_budget_bytes:
        with pytest.raises(remat.PlanError):
            remat.plan(prof, f"{pct}%")
        return
    p = remat.plan(prof, f"{pct}%")
    assert p.budget_bytes == expected + prof.scratch.bytes
    assert p.predicted_peak_bytes + p.scratch_bytes <= p.budget_bytes
    if pct >= 100:
        assert set(p.decisions.values()) == {"keep"}
        assert p.predicted_peak_bytes == unchecked


@pytest.mark.parametrize(
    "budget, expected",
    [
        ("18GB", 18 * 10**9),  # decimal prefixes are powers of 1000 (SI)
        ("18GiB", 18 * 2**30),  # binary prefixes powers of 1024
        ("1.5 MB", 1_500_000),
        ("512KiB", 512 * 1024),
        (2**30, 2**30),  # bytes
        (1e9, 10**9),  # a float of bytes
    ],
)
def test_size_budgets_are_absolute_bytes(adamw_profile, budget, expected):
    p = remat.plan(adamw_profile, budget)
    assert p.budget_bytes == expected
    assert set(p.decisions.values()) == {"keep"}  # all far above this model's step


@pytest.mark.parametrize("share", [0.5, 0.6, 0.05])
def test_a_share_as_a_float_is_refused_with_the_percentage_to_write(adamw_profile, share):
    with pytest.raises(ValueError, match=f"budget='{share * 100:g}%'"):
        remat.plan(adamw_profile, share)


# ---------------------------------------------------------------- bad inputs


def test_plan_without_a_profile_names_the_argument():
    with pytest.raises(TypeError, match=r"remat\.plan: profile must be a remat\.Profile.*NoneType"):
        remat.plan(None, "50%")


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


# ---------------------------------------------------------------- the same plan every time


def test_planning_a_flops_profile_twice_gives_the_same_plan():
    model, x = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, x, optimizer=opt, timer="flops")
    again = remat.profile(model, x, optimizer=opt, timer="flops")
    assert again.to_json() == prof.to_json()
    floor = per_block_floor(prof)
    for budget in (floor, (floor + prof.unchecked_peak_bytes) // 2):
        budget += prof.scratch.bytes
        a, b = remat.plan(prof, budget), remat.plan(again, budget)
        assert a == b and a.to_json() == b.to_json()


def test_timed_profiles_of_identical_blocks_give_identical_plans():
    # Issue #10's stability requirement: with timer="measured" the costs differ by noise from
    # run to run; identical blocks share one cost and near-ties go to the simplest plan.
    torch.manual_seed(0)
    model = nn.Sequential(*[ResMLP(32, 128) for _ in range(6)])
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(3):
        prof = remat.profile(model, x, timer="measured", repeats=3)
        floor = per_block_floor(prof)
        budget = (floor + prof.unchecked_peak_bytes) // 2
        assert floor < budget < prof.unchecked_peak_bytes
        p = remat.plan(prof, budget)
        runs.append((budget, p.decisions))
    assert runs[1] == runs[0] and runs[2] == runs[0], runs


def _uniform_rivals(prof, budget_bytes):
    """(cost, decisions) of every uniform plan within the budget, at the allocator's peak."""
    from remat.planner.solve import uniform_plans
    from remat.planner.stepmodel import with_scratch

    alloc = with_scratch(prof)
    return [
        (predicted_cost(prof.blocks, ds), ds)
        for ds in uniform_plans(prof)
        if alloc.peak(ds).bytes <= budget_bytes
    ]


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_no_uniform_plan_within_the_budget_costs_less_than_the_plan(name):
    model, x = make_model(name)
    prof = remat.profile(model, x, optimizer=torch.optim.AdamW(model.parameters()), timer="flops")
    lo, hi = prof.smallest_budget_bytes, prof.unchecked_peak_bytes + prof.scratch_bytes
    for k in range(9):
        budget = lo + (hi - lo) * k // 8
        p = remat.plan(prof, budget)
        rivals = _uniform_rivals(prof, budget)
        assert rivals or k == 0  # from the floor up, some uniform plan fits (all keep at hi)
        for cost, ds in rivals:
            assert p.predicted_overhead_s <= cost * (1 + 1e-9) + 1e-30, (budget, ds)


def test_a_plan_the_solver_returns_is_replaced_by_a_cheaper_uniform_one(monkeypatch):
    import remat.planner.solve as solve_mod

    model, x = make_model("mlp")
    prof = remat.profile(model, x, timer="flops")
    n = len(prof.blocks)
    budget = prof.unchecked_peak_bytes + prof.scratch_bytes  # everything kept fits
    # a solver that returns a dominated plan (every block recomputed) where keep-all fits
    monkeypatch.setattr(solve_mod, "solve", lambda *a, **k: (["recompute"] * n, []))
    p = remat.plan(prof, budget, spans=False)
    assert set(p.decisions.values()) == {"keep"} and p.predicted_overhead_s == 0.0
    # where every second block recomputed fits: the cheapest uniform plan that fits
    every2 = ["recompute" if i % 2 == 0 else "keep" for i in range(n)]
    from remat.planner.stepmodel import with_scratch

    low = with_scratch(prof).peak(every2).bytes
    assert low < budget
    p = remat.plan(prof, low, spans=False)
    cost, ds = min(_uniform_rivals(prof, low), key=lambda r: r[0])
    assert list(p.decisions.values()) == ds and p.predicted_overhead_s == cost
    assert "keep" in ds and "recompute" in ds  # not the solver's every block recomputed
