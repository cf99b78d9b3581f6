"""``remat.plan_pipeline_stage`` in one process: a stage's module planned for its schedule
(the runs of real pipelines are ``test_pipeline_ranks.py``)."""

from __future__ import annotations

import json

import pytest
import torch

import remat
from remat.planner.pipeline import StagePlan, profile_stage, solve_stage


def _stage() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            for _ in range(4)
        ]
    )


def _profile(stage: int, stages: int = 4, schedule: str = "1f1b"):
    return profile_stage(
        _stage(),
        (torch.randn(16, 64),),
        schedule=schedule,
        stage=stage,
        stages=stages,
        microbatches=8,
        timer="flops",
    )


def test_first_stage_checkpoints_more_at_one_budget():
    first, later = _profile(0), _profile(2)  # 4 and 2 microbatches in flight
    budget = (
        solve_stage(first, 10**12).unchecked_peak_bytes
        + solve_stage(later, 10**12).unchecked_peak_bytes
    ) // 2
    p0, p2 = solve_stage(first, budget), solve_stage(later, budget)
    assert p0.predicted_peak_bytes <= budget and p2.predicted_peak_bytes <= budget
    checked = [sum(d != "keep" for d in p.decisions.values()) for p in (p0, p2)]
    assert checked[0] > checked[1], checked
    assert (p0.in_flight, p2.in_flight) == (4, 2)


def test_unchecked_plan_when_the_budget_allows():
    sp = _profile(0)
    plan = solve_stage(sp, 10**12)
    assert set(map(str, plan.decisions.values())) == {"keep"}
    assert plan.predicted_peak_bytes == plan.unchecked_peak_bytes
    assert plan.predicted_overhead_s == 0


def test_budget_below_every_plan_raises_with_the_smallest_peak():
    with pytest.raises(remat.PlanError, match="smallest predicted peak"):
        solve_stage(_profile(0), 1000)


def test_plan_names_the_stage_modules_blocks_and_applies_in_place():
    module = _stage()
    x = torch.randn(16, 64)
    ref = torch.autograd.grad(module(x).sum(), list(module.parameters()))
    unchecked = remat.plan_pipeline_stage(
        module,
        x,
        stage_index=0,
        num_stages=2,
        schedule="gpipe",
        microbatches=4,
        budget=10**12,
        timer="flops",
    ).unchecked_peak_bytes
    plan = remat.plan_pipeline_stage(
        module,
        x,
        stage_index=0,
        num_stages=2,
        schedule="gpipe",
        microbatches=4,
        budget=unchecked - 1,
        timer="flops",
    )
    assert set(plan.decisions) == {"0", "1", "2", "3"}
    assert any(d != "keep" for d in plan.decisions.values())
    plan.apply(module)
    got = torch.autograd.grad(module(x).sum(), list(module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert json.loads(plan.to_json())["stage"] == 0
    assert StagePlan.from_json(plan.to_json()) == plan
    assert "stage 0/2 (gpipe" in str(plan)


def test_needs_the_stage_index_for_a_plain_module():
    with pytest.raises(TypeError, match="stage_index"):
        remat.plan_pipeline_stage(
            _stage(), torch.randn(4, 64), schedule="1f1b", microbatches=2, budget=10**9
        )


def test_last_stage_needs_its_loss_and_target():
    with pytest.raises(ValueError, match="loss_fn"):
        remat.plan_pipeline_stage(
            _stage(),
            torch.randn(4, 64),
            stage_index=1,
            num_stages=2,
            schedule="1f1b",
            microbatches=2,
            budget=10**9,
        )


@pytest.mark.parametrize(
    "options, error, match",
    [
        # a share has nothing to be a share of: the budget is absolute bytes
        (dict(budget="50%"), ValueError, "absolute bytes"),
        # torch's 1F1B refuses fewer microbatches than stages
        (dict(microbatches=1), ValueError, "at least"),
        (dict(schedule="interleaved1f1b"), ValueError, "schedule must be"),
    ],
)
def test_options_are_checked_before_any_step(options, error, match):
    module = _stage()
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    kwargs = dict(stage_index=0, num_stages=2, schedule="1f1b", microbatches=4, budget=10**9)
    with pytest.raises(error, match=match):
        remat.plan_pipeline_stage(module, torch.randn(4, 64), **{**kwargs, **options})
    assert not calls


def test_a_stage_plans_spans_are_stored_as_spans_and_written_by_name():
    from remat.modules.spans import span_of
    from remat.planner.types import Decision, Span

    ds = {"0": Decision.RECOMPUTE, "1": Decision.RECOMPUTE, "2": Decision.KEEP}
    sp = StagePlan(0, 2, "1f1b", 4, 2, ds, [Span(0, 1)], 10, 9, "B1", 12, 0.1)
    assert sp.spans == [["0", "1"]]
    data = json.loads(sp.to_json())
    assert data["spans"] == [["0", "1"]] and "block_spans" not in data
    again = StagePlan.from_json(sp.to_json())
    assert again == sp and again.block_spans == [Span(0, 1)]
    with pytest.raises(remat.PlanError, match=r"spans name blocks \['9'\]"):
        StagePlan.from_json(json.dumps({**data, "spans": [["0", "9"]]}))
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    sp.apply(model)
    assert span_of(model[0]) is not None and span_of(model[2]) is None


def _plan_shapes(budget: int, **kw):
    stage = _stage()
    x = torch.randn(2, 32, 64)  # 2 sequences of 32 tokens a microbatch: dims=1 varies
    plans = remat.plan_pipeline_stage(
        stage, x, stage_index=0, num_stages=2, schedule="1f1b", microbatches=4,
        budget=budget, timer="flops", shapes=remat.Shapes(dims=1, sizes=(8, 16)), **kw,
    )  # fmt: skip
    return stage, plans


def test_a_stage_is_planned_at_each_microbatch_size_for_one_budget():
    _, loose = _plan_shapes(10**12)
    top = loose.plans[32]
    budget = (top.unchecked_peak_bytes + loose.plans[8].unchecked_peak_bytes) // 2
    stage, plans = _plan_shapes(budget)
    assert plans.sizes == [8, 16, 32]
    assert all(p.predicted_peak_bytes <= budget for p in plans.plans.values())
    # each size's plan is that size's own (one profile each): the short one keeps every block
    assert all(d is remat.planner.types.Decision.KEEP for d in plans.plans[8].decisions.values())
    assert plans.plans[32].decisions != plans.plans[8].decisions
    assert plans.size_for(9) == 16 and plans.size_for(16) == 16 and plans.size_for(1) == 8
    with pytest.raises(remat.PlanError, match="size 33 .* larger than the largest size this stage"):
        plans.plan_for(33)


def _checkpointed(stage: torch.nn.Module) -> list[bool]:
    from remat.modules.wrap import is_wrapped

    return [is_wrapped(b) for b in stage]


def test_stage_shape_plans_switch_the_plan_by_each_forwards_microbatch_size():
    _, loose = _plan_shapes(10**12)
    budget = (loose.plans[32].unchecked_peak_bytes + loose.plans[8].unchecked_peak_bytes) // 2
    stage, plans = _plan_shapes(budget)
    plans.apply(stage)
    assert plans.applied == 32
    for n in (8, 20, 32):
        stage(torch.randn(2, n, 64)).sum().backward()
        assert plans.applied == plans.size_for(n)
        ds = plans.plan_for(n).decisions.values()
        assert _checkpointed(stage) == [d is not remat.planner.types.Decision.KEEP for d in ds]
    with torch.no_grad():  # no gradients: no switch
        stage(torch.randn(2, 8, 64))
    assert plans.applied == 32
    plans.remove()
    stage(torch.randn(2, 8, 64)).sum().backward()
    assert plans.applied == 32


def test_plan_pipeline_stage_shapes_must_be_a_shapes():
    with pytest.raises(TypeError, match="shapes must be a remat.Shapes, got tuple"):
        remat.plan_pipeline_stage(
            _stage(), torch.randn(2, 32, 64), stage_index=0, num_stages=2, schedule="1f1b",
            microbatches=4, budget=10**9, timer="flops", shapes=(8, 16),
        )  # fmt: skip


def test_a_data_parallel_stage_module_is_refused_with_the_reason(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for wrap, what in (
            (lambda m: fully_shard(m), "sharded"),
            (lambda m: DDP(m), "wrapped in DistributedDataParallel"),
        ):
            stage = wrap(_stage())
            with pytest.raises(ValueError, match=f"module is {what}.*not planned yet"):
                remat.plan_pipeline_stage(
                    stage, torch.randn(16, 64), stage_index=0, num_stages=2,
                    schedule="1f1b", microbatches=4, budget=10**9, timer="flops",
                )  # fmt: skip
    finally:
        dist.destroy_process_group()
