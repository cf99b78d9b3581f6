"""The planner against real measurements: predicted peak == measured peak, optimal plans, API."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.apply import apply_decision
from remat.planner.perblock import brute_force, solve_dp, solve_milp
from remat.planner.stepmodel import predicted_cost

CFG = ModelConfig(layers=4, d_model=64, seq=32, batch=2, heads=2, vocab=128)
DECS = ("keep", "recompute", "selective")


pytestmark = pytest.mark.usefixtures("one_thread")


ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def gpt():
    model = build(CFG)
    x = example_input(CFG)
    prof = remat.profile(model, x, timer="flops", set_to_none=False, decisions=DECS)
    return model, x, prof


def share(prof, fraction):
    """The absolute budget at ``fraction`` of the way from static bytes to the unchecked peak,
    and the activation budget the solvers see."""
    static = prof.static_step_bytes
    budget = static + int((prof.unchecked_peak_bytes - static) * fraction)
    return budget, budget - static


@pytest.mark.slow  # the fast form: tests/test_step_model.py's grids
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


def test_profile_leaves_the_model_as_it_was():
    model = build(CFG)
    remat.checkpoint_wrapper(model.blocks[1])
    before = repr(model)
    remat.profile(model, example_input(CFG), timer="flops", set_to_none=False)
    assert repr(model) == before


def test_profile_leaves_input_gradients_as_they_were():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    fresh = torch.randn(4, 8, requires_grad=True)
    x.grad = torch.full((4, 8), 7.0)
    mine = x.grad
    remat.profile(model, x, timer="flops", set_to_none=False)
    remat.profile(model, fresh, timer="flops", set_to_none=False)
    assert x.grad is mine and torch.equal(mine, torch.full((4, 8), 7.0))
    assert fresh.grad is None


def test_plan_table_and_apply_to_wrong_model():
    model = build(CFG)
    p = remat.plan(
        remat.profile(model, example_input(CFG), timer="flops", set_to_none=False), "60%"
    )
    text = str(p)
    assert "blocks.0" in text and "predicted step peak" in text
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(remat.PlanError, match="no submodule named"):
        p.apply(other)


def test_auto_checkpoint_meets_the_budget_and_keeps_gradients():
    model = build(CFG)
    x = example_input(CFG)
    ref = build(CFG)
    torch.manual_seed(0)
    ref(x).backward()
    unchecked = remat.measure_peak(model, x, set_to_none=False)
    p = remat.auto_checkpoint(model, x, budget="50%", timer="flops", set_to_none=False)
    prof = remat.profile(model, x, timer="flops", set_to_none=False)
    static, scratch = prof.static_step_bytes, prof.scratch_bytes
    # half the activations; the static bytes and the scratch inside operators on top
    assert p.budget_bytes == static + scratch + (unchecked - static) // 2
    assert remat.measure_peak(model, x, set_to_none=False) + scratch <= p.budget_bytes
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(x).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_auto_checkpoint_with_a_given_profile_plans_as_if_it_had_profiled(gpt):
    _, x, prof = gpt
    a, b = build(CFG), build(CFG)
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
    model = build(CFG)
    kwargs = {"set_to_none": False, "profile": prof, **call}
    x = kwargs.pop("x", x)
    if kwargs.get("optimizer") == "sgd":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    error = TypeError if call.get("profile") else ValueError
    with pytest.raises(error, match=match):
        remat.auto_checkpoint(model, x, budget="50%", **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"timer": "wall"}, ValueError, "timer must be"),
        ({"repeats": 0}, ValueError, "repeats must be"),
        ({"decisions": ["recompute"]}, ValueError, "must include 'keep'"),
        ({"decisions": ["keep", "offload"]}, ValueError, "needs a device"),
        ({"check_fn": lambda n, m: False}, ValueError, "no candidate blocks"),
    ],
)
def test_profile_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        remat.profile(build(CFG), example_input(CFG), **kwargs, set_to_none=False)


def test_remat_plan_cli_prints_plan_and_writes_json(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent(
            """
            from remat.bench.models import ModelConfig, build, example_input

            def make():
                cfg = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)
                return build(cfg), (example_input(cfg),)
            """
        )
    )
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "remat",
            "plan",
            "mymodel:make",
            "--budget",
            "90%",
            "--timer",
            "flops",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ONE_THREAD_ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "blocks.0" in proc.stdout and "predicted step peak" in proc.stdout
    assert "peak in " in proc.stdout  # where the peak falls and its breakdown
    plan = remat.Plan.from_json(out.read_text())
    assert set(plan.decisions) == {"blocks.0", "blocks.1", "blocks.2"}


@pytest.mark.parametrize(
    "flags, optimizer, set_to_none",
    [
        ([], None, True),  # the default loop: no optimizer step, gradients None
        (["--optimizer", "adamw"], "adamw", True),
        (["--optimizer", "sgd-momentum", "--keep-grads"], "sgd-momentum", False),
    ],
)
def test_remat_plan_cli_optimizer_and_keep_grads_plan_the_same_step_as_the_api(
    tmp_path, flags, optimizer, set_to_none
):
    from remat.cli import main

    (tmp_path / "cli_step_model.py").write_text(
        textwrap.dedent(
            """
            from remat.bench.models import ModelConfig, build, example_input

            CFG = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)

            def make():
                return build(CFG), (example_input(CFG),)
            """
        )
    )
    out = tmp_path / "plan.json"
    target = f"{tmp_path / 'cli_step_model.py'}:make"
    argv = ["plan", target, "--budget", "90%", "--timer", "flops", "--json", str(out), *flags]
    assert main(argv) == 0
    from_cli = remat.Plan.from_json(out.read_text())
    cfg = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)
    model = build(cfg)
    opt = {
        None: None,
        "adamw": lambda: torch.optim.AdamW(model.parameters()),
        "sgd-momentum": lambda: torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
    }[optimizer]
    prof = remat.profile(
        model,
        example_input(cfg),
        optimizer=None if opt is None else opt(),
        set_to_none=set_to_none,
        timer="flops",
    )
    assert from_cli == remat.plan(prof, "90%")
    assert (from_cli.breakdown["optimizer"] > 0) == (optimizer is not None)
    if not set_to_none:
        assert from_cli.breakdown["gradients"] == prof.grad_bytes


@pytest.mark.parametrize(
    "target, match",
    [
        ("nomodule:make", "cannot import module 'nomodule'"),
        ("remat:nothing", "has no attribute 'nothing'"),
        ("justaname", "MODULE:FACTORY"),
    ],
)
def test_remat_plan_cli_errors(target, match, capsys):
    # in-process (python -m remat is run once above): exit code 2 and one line naming the mistake
    from remat.cli import main

    assert main(["plan", target, "--budget", "60%"]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_time_profile_has_positive_costs_and_step_cost():
    model = build(CFG)
    prof = remat.profile(model, example_input(CFG), repeats=1, set_to_none=False)
    assert prof.cost_unit == "s" and prof.step_cost > 0
    assert all(b.cost["keep"] == 0.0 and b.cost["recompute"] >= 0.0 for b in prof.blocks)
    assert all(
        b.retained["recompute"] < b.retained["selective"] < b.retained["keep"] for b in prof.blocks
    )


def test_profile_at_current_threads_uses_wall_time():
    prof = remat.profile(build(CFG), example_input(CFG), repeats=1, threads=None, set_to_none=False)
    assert prof.step_cost > 0 and all(b.cost["recompute"] >= 0 for b in prof.blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_decision_on_cuda_fits_budget_and_keeps_grads():
    cfg = ModelConfig(layers=4, d_model=256, seq=128, batch=4, heads=4, vocab=256)
    model = build(cfg, "cuda")
    x = example_input(cfg, "cuda")
    prof = remat.profile(model, x, set_to_none=False)
    assert "offload" in prof.decisions
    assert all(b.retained["offload"] < b.retained["keep"] for b in prof.blocks)
    p = remat.plan(prof, "50%")
    p.apply(model)
    assert remat.measure_peak(model, x, set_to_none=False) <= p.budget_bytes
    for block in model.blocks:
        apply_decision(block, "offload")
    ref = build(cfg, "cuda")
    torch.manual_seed(0)
    ref(x).backward()
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad)
