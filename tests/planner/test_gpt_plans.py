"""The planner on the built-in GPT, profiled once: predicted peak == measured peak, the chosen
plan the cheapest that fits, the solvers agree, profile and plan files, and
``auto_checkpoint`` given that profile.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.apply import apply_decision
from remat.planner.perblock import brute_force, solve_dp, solve_milp
from remat.planner.stepmodel import predicted_cost
from remat.planner.types import KEEP, RECOMPUTE, SELECTIVE
from tests.support.models import SMALL_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


DECS = (KEEP, RECOMPUTE, SELECTIVE)


@pytest.fixture(scope="module")
def gpt():
    model = build(SMALL_GPT)
    x = example_input(SMALL_GPT)
    prof = remat.profile(model, x, timer="flops", set_to_none=False, decisions=DECS)
    return model, x, prof


def share(prof, fraction):
    """The absolute budget at ``fraction`` of the way from static bytes to the unchecked peak,
    and the activation budget the solvers see."""
    static = prof.static_step_bytes
    budget = static + int((prof.unchecked_peak_bytes - static) * fraction)
    return budget, budget - static


@pytest.mark.slow  # the fast form: tests/planner/test_stepmodel.py's grids
def test_predicted_peak_equals_measured_for_all_81_plans(gpt):
    model, x, prof = gpt
    mismatches = []
    for ds in itertools.product(DECS, repeat=4):
        for block, d in zip(model.blocks, ds):
            apply_decision(block, d)
        measured = remat.measure_peak(model, x, set_to_none=False)
        predicted = prof.peak(ds).bytes
        if predicted != measured:
            mismatches.append((ds, predicted, measured))
    for block in model.blocks:
        apply_decision(block, "keep")
    assert mismatches == []


@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.7, 0.9])
def test_chosen_plan_fits_measured_and_is_cheapest_under_the_model(gpt, fraction):
    model, x, prof = gpt
    budget, act = share(prof, fraction)
    best = brute_force(prof.blocks, prof.top, act, DECS)
    try:
        p = remat.plan(prof, budget)  # spans too
    except remat.PlanError:
        assert best is None  # spans reach at least what per-block plans reach
        return
    if best is not None:
        per_block = remat.plan(prof, budget, spans=False)
        ds = [per_block.decisions[b.name] for b in prof.blocks]
        assert predicted_cost(prof.blocks, ds) == predicted_cost(prof.blocks, best)
        assert p.predicted_overhead_s <= per_block.predicted_overhead_s
    p.apply(model)
    assert remat.measure_peak(model, x, set_to_none=False) <= budget
    assert p.predicted_peak_bytes <= budget


def test_flops_profile_is_deterministic(gpt):
    model, x, prof = gpt
    again = remat.profile(model, x, timer="flops", set_to_none=False, decisions=DECS)
    assert again.to_json() == prof.to_json()
    assert prof.cost_unit == "flop"
    assert all(b.cost["recompute"] > 0 for b in prof.blocks)


def test_milp_and_dp_agree_on_a_real_profile(gpt):
    _, _, prof = gpt
    for fraction in (0.4, 0.6, 0.8):
        _, budget = share(prof, fraction)
        a = solve_dp(prof.blocks, prof.top, budget, DECS)
        b = solve_milp(prof.blocks, prof.top, budget, DECS)
        assert (a is None) == (b is None)
        if a is not None:
            assert predicted_cost(prof.blocks, a) == pytest.approx(predicted_cost(prof.blocks, b))


def test_profile_and_plan_json_round_trip(gpt, tmp_path):
    _, _, prof = gpt
    path = tmp_path / "profile.json"
    prof.save(str(path))
    assert remat.Profile.load(str(path)) == prof
    json.loads(path.read_text())  # plain JSON
    p = remat.plan(prof, "80%")
    assert remat.Plan.from_json(p.to_json()) == p


def test_infeasible_budget_error_gives_smallest_reachable_peak(gpt):
    _, _, prof = gpt
    with pytest.raises(remat.PlanError, match="smallest reachable peak is"):
        remat.plan(prof, 1000)


def test_profile_records_what_it_is_valid_for(gpt):
    _, x, prof = gpt
    assert prof.input_shapes == [list(x.shape)]
    assert prof.device == "cpu" and prof.torch_version == torch.__version__
    assert [b.name for b in prof.blocks] == [f"blocks.{i}" for i in range(4)]
    assert prof.decisions == list(DECS)


def test_auto_checkpoint_with_a_given_profile_plans_as_if_it_had_profiled(gpt):
    _, x, prof = gpt
    a, b = build(SMALL_GPT), build(SMALL_GPT)
    pa = remat.auto_checkpoint(a, x, budget="50%", timer="flops", set_to_none=False)
    pb = remat.auto_checkpoint(b, x, budget="50%", set_to_none=False, profile=prof)
    assert pb.budget_bytes == pa.budget_bytes  # same static and unchecked bytes
    assert pb.decisions == remat.plan(prof, pb.budget_bytes).decisions  # the given profile's
    assert remat.measure_peak(b, x, set_to_none=False) <= pb.budget_bytes


@pytest.mark.parametrize(
    "call, match",
    [
        ({"set_to_none": True}, "set_to_none=False, not True"),
        ({"x": example_input(ModelConfig(seq=16, batch=2, vocab=128))}, "inputs of shapes"),
        ({"optimizer": "sgd"}, "optimizer=None, not SGD"),
        ({"check_fn": lambda n, m: n == "blocks.0"}, "candidate blocks"),
        ({"profile": "prof.json"}, "must be a remat.Profile"),
    ],
)
def test_auto_checkpoint_refuses_a_profile_of_another_model_or_step(gpt, call, match):
    _, x, prof = gpt
    model = build(SMALL_GPT)
    kwargs = {"set_to_none": False, "profile": prof, **call}
    x = kwargs.pop("x", x)
    if kwargs.get("optimizer") == "sgd":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    error = TypeError if call.get("profile") else ValueError
    with pytest.raises(error, match=match):
        remat.auto_checkpoint(model, x, budget="50%", **kwargs)
