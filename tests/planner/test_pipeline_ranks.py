"""Pipeline stages planned for their schedule (``remat.plan_pipeline_stage``): one rank per
stage, gloo on CPU (:mod:`tests.support.ranks`).

Each scenario runs a GPT split into stages under ``ScheduleGPipe`` or ``Schedule1F1B`` with
the plan of each rank's stage for that rank's budget, measures every rank's peak over three
steps (the first creates the optimizer's state) with :mod:`remat.memory`, and runs the same
pipeline without checkpointing for its gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remat.bench.models import ModelConfig
from remat.bench.pipeline import run_rank
from tests.support import ranks

pytestmark = pytest.mark.slow

TIMEOUT_S = 300

CFG = ModelConfig(layers=4, d_model=64, seq=32, batch=8, heads=2, vocab=128)

#: (schedule, stages, microbatches, layers, step(return_outputs=)), each rank's budget: its unchecked peak less
#: this share of what the smallest plan saves (every rank must plan something; the first
#: stages, holding more microbatches, more).
CASES = {
    "gpipe2": ("gpipe", 2, 4, 4, True),
    "1f1b2": ("1f1b", 2, 4, 4, True),
    "1f1b4": ("1f1b", 4, 4, 8, True),
    "gpipe2_no_outputs": ("gpipe", 2, 4, 4, False),
}
SHARE = 0.5


def _scenario(name: str, rank: int) -> dict:
    schedule, stages, n, layers, outputs = CASES[name]
    cfg = ModelConfig(**{**CFG.__dict__, "layers": layers})
    common = dict(
        rank=rank,
        stages=stages,
        schedule=schedule,
        microbatches=n,
        timer="flops",
        return_outputs=outputs,
    )
    keep = run_rank(cfg, strategy="none", steps=3, grads=True, **common)
    every = run_rank(cfg, strategy="every_layer", steps=2, **common)
    budget = keep.peak_bytes - int(SHARE * (keep.peak_bytes - every.peak_bytes))
    planned = run_rank(cfg, strategy="remat", budget=budget, steps=3, grads=True, **common)
    return {
        "planned": dataclasses.asdict(planned),
        "grads_ref": keep.grads,
        "keep": keep.peak_bytes,
        "budget": budget,
    }


SCENARIOS = {name: (lambda rank, name=name: _scenario(name, rank)) for name in CASES}


@pytest.mark.parametrize(
    "name",
    [
        "gpipe2",  # 2 stages, GPipe: each stage holds all 4 microbatches
        "1f1b2",  # 2 stages, 1F1B: stage 0 holds 2, stage 1 one
        "1f1b4",  # 4 stages, 1F1B: 4, 3, 2, 1 in flight
        "gpipe2_no_outputs",  # step(return_outputs=False): the last stage keeps no outputs
    ],
)
def test_each_stage_planned_exactly_within_its_budget(tmp_path, name):
    stages = CASES[name][1]
    results = ranks.run_ranks(tmp_path, __name__, name, world=stages, timeout_s=TIMEOUT_S)
    for r, res in enumerate(results):
        p = res["planned"]
        assert p["rank"] == r
        assert p["peak_bytes"] <= res["budget"], (r, p["peak_bytes"], res["budget"])
        assert p["peak_bytes"] == p["predicted_bytes"], (r, p["peak_bytes"], p["predicted_bytes"])
        # checkpointing leaves every gradient bit for bit as it was
        assert p["grads"].keys() == res["grads_ref"].keys()
        for n, g in p["grads"].items():
            assert torch.equal(g, res["grads_ref"][n]), (r, n)
        # each budget is below the stage's unchecked peak: its plan checkpoints some block
        assert res["keep"] > res["budget"]
        assert any(d != "keep" for d in p["decisions"].values()), (r, p["decisions"])
    # one plan per stage, for its own blocks
    assert len({res["planned"]["plan"] for res in results}) == stages


#: Microbatches of two lengths (16 and 32 tokens, a bucket's worth between them) on two
#: 1F1B stages: each rank's stage planned at both lengths for one budget.
SHAPES_SEQS = (32, 16, 24)


def _shapes_scenario(rank: int) -> dict:
    from remat import Shapes
    from remat.bench.pipeline import run_rank_shapes

    common = dict(rank=rank, stages=2, schedule="1f1b", microbatches=4, timer="flops")
    keep = run_rank(CFG, strategy="none", steps=2, **common)
    every = run_rank(CFG, strategy="every_layer", steps=2, **common)
    budget = keep.peak_bytes - int(SHARE * (keep.peak_bytes - every.peak_bytes))
    shapes = Shapes(dims=1, sizes=(16,))
    planned = run_rank_shapes(
        CFG, seqs=SHAPES_SEQS, shapes=shapes, budget=budget, grads=True, **common
    )
    plain = run_rank_shapes(CFG, seqs=SHAPES_SEQS, shapes=None, grads=True, **common)
    return {
        "planned": {n: dataclasses.asdict(r) for n, r in planned.items()},
        "grads_ref": {n: r.grads for n, r in plain.items()},
        "budget": budget,
    }


SCENARIOS["shapes"] = _shapes_scenario


def test_a_stage_planned_for_microbatches_of_two_lengths_switches_plans_within_its_budget(
    tmp_path,
):
    results = ranks.run_ranks(tmp_path, __name__, "shapes", world=2, timeout_s=TIMEOUT_S)
    for r, res in enumerate(results):
        by_len = res["planned"]
        for n, p in by_len.items():
            assert p["peak_bytes"] <= res["budget"], (r, n, p["peak_bytes"], res["budget"])
            if n in (16, 32):  # a planned length: its prediction to the byte
                assert p["peak_bytes"] == p["predicted_bytes"], (r, n, p["peak_bytes"])
            else:  # 24 tokens run the plan of 32, whose peak bounds theirs
                assert p["plan"] == by_len[32]["plan"]
                assert p["peak_bytes"] <= p["predicted_bytes"], (r, n)
            assert p["grads"].keys() == res["grads_ref"][n].keys()
            for k, g in p["grads"].items():
                assert torch.equal(g, res["grads_ref"][n][k]), (r, n, k)
    # the first stage (two microbatches in flight) checkpoints less at 16 tokens than at 32
    first = results[0]["planned"]
    assert first[16]["decisions"] != first[32]["decisions"], first
