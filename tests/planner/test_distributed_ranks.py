"""One plan for all ranks: the planner under FSDP2 and DDP, 2 processes, gloo on CPU.

Each test spawns two ranks that run one scenario and write what they found to
a file per rank; the test compares the ranks. A rank that hangs fails the test
on its own (the processes are joined with a timeout and killed).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import remat
from remat.bench.models import build, example_input
from remat.planner.apply import apply_decision
from tests.support import ranks
from tests.support.models import SMALL_GPT
from tests.support.tensors import assert_dicts_equal

pytestmark = pytest.mark.slow

TIMEOUT_S = 120


def run_ranks(tmp_path, scenario: str, world: int = 2) -> list[dict]:
    """Run ``SCENARIOS[scenario]`` on ``world`` ranks (:func:`tests.support.ranks.run_ranks`)."""
    return ranks.run_ranks(tmp_path, __name__, scenario, world, TIMEOUT_S)


# -- helpers run inside the ranks ---------------------------------------------------


def _sharded(reshard_after_forward: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build(SMALL_GPT)
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def _batch(rank: int) -> torch.Tensor:
    return example_input(SMALL_GPT, seed=1 + rank)  # each rank its own batch


def _fsdp_auto(rank: int, raf: bool) -> dict:
    x = _batch(rank)
    model = _sharded(raf)
    opt = torch.optim.AdamW(model.parameters())
    p = remat.auto_checkpoint(model, x, budget="75%", optimizer=opt, quiet=True)
    measured = remat.measure_peak(model, x, optimizer=opt)
    grads = ranks.full_grads(model, x, seed=5)
    ref = ranks.full_grads(_sharded(raf), x, seed=5)
    return {"plan": p.to_json(), "measured": measured, "grads": grads, "ref": ref}


def scenario_fsdp2_auto(rank: int) -> dict:
    return _fsdp_auto(rank, True)


def scenario_fsdp2_no_reshard_auto(rank: int) -> dict:
    return _fsdp_auto(rank, False)


def scenario_fsdp2_predicted_equals_measured(rank: int) -> dict:
    """For a few plans, the agreed profile's predicted peak against each rank's measured one."""
    x = _batch(rank)
    out = {}
    plans = [
        ("keep",) * 4,
        ("recompute",) * 4,
        ("selective", "keep", "recompute", "keep"),
        ("keep", "recompute", "recompute", "selective"),
    ]
    for raf in (True, False):
        model = _sharded(raf)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        prof = remat.profile(
            model, x, optimizer=opt, timer="flops", decisions=["keep", "recompute", "selective"]
        )
        for ds in plans:
            for b, d in zip(model.blocks, ds):
                apply_decision(b, d)
            out[(raf, ds)] = (
                prof.peak(list(ds)).bytes,
                remat.measure_peak(model, x, optimizer=opt),
            )
    return out


def scenario_plan_json_then_shard(rank: int) -> dict:
    """Rank 0 plans and saves; every rank loads the JSON and applies it before fully_shard."""
    from torch.distributed.fsdp import fully_shard

    x = _batch(rank)
    text = [None]
    if rank == 0:
        model = build(SMALL_GPT)
        prof = remat.profile(model, x, timer="flops", distributed=False)
        text[0] = remat.plan(prof, "75%").to_json()
    dist.broadcast_object_list(text, src=0)
    model = build(SMALL_GPT)
    loaded = remat.Plan.from_json(text[0])
    loaded.apply(model)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    grads = ranks.full_grads(model, x, seed=5)
    return {"plan": text[0], "grads": grads, "ref": ranks.full_grads(_sharded(True), x, seed=5)}


def _ddp(kwargs: dict) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(build(SMALL_GPT), **kwargs)


DDP_MODES = {
    "plain": {},
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True},
    "bucket_view": {"gradient_as_bucket_view": True},
}


def scenario_ddp_auto(rank: int) -> dict:
    x = _batch(rank)
    out = {}
    for mode, kwargs in DDP_MODES.items():
        model = _ddp(kwargs)
        p = remat.auto_checkpoint(model, x, budget="75%", quiet=True)
        measured = remat.measure_peak(model, x)
        grads = ranks.full_grads(model, x, seed=5)
        ref_model = _ddp(kwargs)
        if kwargs.get("static_graph"):  # the same number of steps before the compared one
            ranks.full_grads(ref_model, x, seed=5)
            ranks.full_grads(model, x, seed=5)
            grads = ranks.full_grads(model, x, seed=5)
        ref = ranks.full_grads(ref_model, x, seed=5)
        out[mode] = {"plan": p.to_json(), "measured": measured, "grads": grads, "ref": ref}
    return out


def scenario_ddp_amp(rank: int) -> dict:
    # torch's bf16 AMP recipe: planned inside the region (each rank's batch differs)
    x = _batch(rank)
    model = _ddp({})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = remat.auto_checkpoint(model, x, budget="75%", quiet=True)
        measured = remat.measure_peak(model, x)
    return {"plan": p.to_json(), "measured": measured}


def scenario_different_blocks(rank: int) -> dict:
    model = build(SMALL_GPT)
    layers = 4 if rank == 0 else 3
    try:
        remat.profile(
            model,
            _batch(rank),
            timer="flops",
            check_fn=lambda n, m: n in {f"blocks.{i}" for i in range(layers)},
        )
    except remat.PlanError as e:
        return {"raised": str(e)}
    return {"raised": None}


SCENARIOS = {
    name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


# -- the tests ------------------------------------------------------------------------


def _same_plan_within_budget(results: list[dict]) -> remat.Plan:
    plans = [remat.Plan.from_json(r["plan"]) for r in results]
    assert all(p.decisions == plans[0].decisions for p in plans)
    assert all(p.spans == plans[0].spans for p in plans)
    assert all(p.budget_bytes == plans[0].budget_bytes for p in plans)
    for r, p in zip(results, plans):
        assert r["measured"] <= p.budget_bytes
    return plans[0]


@pytest.mark.parametrize("scenario", ["fsdp2_auto", "fsdp2_no_reshard_auto"])
def test_fsdp2_ranks_apply_one_plan_within_budget_with_equal_grads(tmp_path, scenario):
    results = run_ranks(tmp_path, scenario)
    plan = _same_plan_within_budget(results)
    assert "recompute" in plan.decisions.values() or "selective" in plan.decisions.values()
    for res in results:
        assert_dicts_equal(res["ref"], res["grads"])


def test_fsdp2_predicted_peak_matches_each_ranks_measured_peak(tmp_path):
    """Exact in nearly every run; gloo's worker thread drops its references to a
    collective's buffers when it finishes, so under load one such buffer (at most one
    block's gathered parameters) can outlive the next operator: the real peak moves by
    that much between runs (seen: 1 run in about 13, 68608 bytes). Bounded, not exact."""
    results = run_ranks(tmp_path, "fsdp2_predicted_equals_measured")
    block = 4 * sum(p.numel() for p in build(SMALL_GPT).blocks[0].parameters())
    for res in results:
        for key, (predicted, measured) in res.items():
            assert abs(predicted - measured) <= block, key
    exact = sum(p == m for res in results for p, m in res.values())
    assert exact >= len(results) * len(results[0]) - 2  # at most one late free per rank


def test_plan_from_json_applied_before_fully_shard_gives_equal_grads(tmp_path):
    results = run_ranks(tmp_path, "plan_json_then_shard")
    assert results[0]["plan"] == results[1]["plan"]
    assert "recompute" in results[0]["plan"] or "selective" in results[0]["plan"]
    for res in results:
        assert_dicts_equal(res["ref"], res["grads"])


def test_ddp_modes_ranks_apply_one_plan_within_budget_with_equal_grads(tmp_path):
    results = run_ranks(tmp_path, "ddp_auto")
    for mode in DDP_MODES:
        plan = _same_plan_within_budget([r[mode] for r in results])
        assert set(plan.decisions.values()) != {"keep"}, mode
        for r in results:
            assert_dicts_equal(r[mode]["ref"], r[mode]["grads"])


def test_ranks_with_different_blocks_all_raise(tmp_path):
    results = run_ranks(tmp_path, "different_blocks")
    for res in results:
        assert res["raised"] and "disagree" in res["raised"], res


def test_ddp_ranks_plan_the_amp_recipe_alike_within_budget(tmp_path):
    results = run_ranks(tmp_path, "ddp_amp")
    for res in results:
        assert "error" not in res, res.get("error")
    plan = _same_plan_within_budget(results)
    assert set(plan.decisions.values()) != {"keep"}
