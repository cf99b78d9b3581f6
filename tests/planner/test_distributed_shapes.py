"""Plans for varying shapes under DDP and FSDP2: 2 processes (gloo, CPU), each rank with its
own batch length in a step. The ranks agree on the bucket before each forward, so they run
the same plan (no desynchronised collective: a hang fails the test), and the gradients
equal those of the same wrapper without checkpointing."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.bench.models import build
from tests.support import ranks
from tests.support.models import SMALL_GPT

pytestmark = pytest.mark.slow

TIMEOUT_S = 240

#: Per step, each rank's batch length in tokens (the largest planned: SMALL_GPT.seq + 1).
LENGTHS = [(33, 9), (12, 33), (10, 20), (20, 20)]


def run_ranks(tmp_path, scenario: str, world: int = 2) -> list[dict]:
    """Run ``SCENARIOS[scenario]`` on ``world`` ranks (:func:`tests.support.ranks.run_ranks`)."""
    return ranks.run_ranks(tmp_path, __name__, scenario, world, TIMEOUT_S)


# -- inside the ranks ---------------------------------------------------------------


def _tokens(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, SMALL_GPT.vocab, (SMALL_GPT.batch, n), generator=g)


def _ddp() -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(build(SMALL_GPT))


def _fsdp2() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build(SMALL_GPT)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _varying(rank: int, make) -> dict:
    model, reference = make(), make()
    largest = _tokens(0, -1, SMALL_GPT.seq + 1)  # the same example on every rank
    plans = remat.auto_checkpoint(model, largest, budget="75%", timer="flops", quiet=True,
                                  shapes=remat.Shapes(dims=1, checks=1))  # fmt: skip
    steps = []
    for step, lengths in enumerate(LENGTHS):
        x = _tokens(rank, step, lengths[rank])
        grads = ranks.full_grads(model, x, seed=step)
        assert plans.applied is not None
        steps.append(
            {
                "decisions": {k: str(v) for k, v in plans.applied.decisions.items()},
                "spans": plans.applied.spans,
                "grads": grads,
                "ref": ranks.full_grads(reference, x, seed=step),
            }
        )
    return {"steps": steps, "planned": sorted(plans.plans)}


def scenario_ddp_varying(rank: int) -> dict:
    return _varying(rank, _ddp)


def scenario_fsdp2_varying(rank: int) -> dict:
    return _varying(rank, _fsdp2)


SCENARIOS = {
    name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


# -- the tests ----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["ddp_varying", "fsdp2_varying"])
def test_ranks_with_different_lengths_run_one_plan_with_unchecked_grads(tmp_path, scenario):
    results = run_ranks(tmp_path, scenario)
    assert results[0]["planned"] == results[1]["planned"]
    for step in range(len(LENGTHS)):
        a, b = (r["steps"][step] for r in results)
        assert a["decisions"] == b["decisions"] and a["spans"] == b["spans"]  # one plan
        for res in (a, b):
            assert res["grads"].keys() == res["ref"].keys()
            for n, g in res["grads"].items():
                assert torch.equal(g, res["ref"][n]), (step, n)
    # the step whose longest batch is full length checkpoints; the short steps plan for less
    full = results[0]["steps"][0]["decisions"]
    short = results[0]["steps"][2]["decisions"]
    assert any(d != "keep" for d in full.values())
    assert sum(d == "keep" for d in short.values()) > sum(d == "keep" for d in full.values())
