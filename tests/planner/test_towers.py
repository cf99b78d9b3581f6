"""Blocks that are not one chain: two towers whose outputs the model's head combines (the
text tower's last block does not pass its output to the image tower's first block)."""

from __future__ import annotations

import itertools

import pytest
import torch

import remat
from remat.planner.apply import apply_decision
from remat.planner.types import Decision
from tests.support.families import Towers
from tests.support.plans import plan_of

KEEP, RECOMPUTE, SELECTIVE = Decision.KEEP, Decision.RECOMPUTE, Decision.SELECTIVE

pytestmark = pytest.mark.usefixtures("one_thread")


def _towers() -> tuple[Towers, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Towers(), torch.randn(128, 32), torch.randn(128, 32)


def test_a_towers_output_the_head_frees_is_recorded_only_where_a_selective_cache_keeps_it():
    model, a, b = _towers()
    prof = remat.profile(model, a, b, timer="flops")
    last_text = prof.blocks[4]
    assert prof.chained[4] is False
    # under keep and recompute the head's backward frees the text tower's output before the
    # text tower's backward: kept in forward only; a selective cache keeps it into backward
    out = 128 * 32 * 4
    assert last_text.exit_freed[KEEP] == last_text.exit_freed[RECOMPUTE] == out
    assert last_text.exit_freed[SELECTIVE] == 0
    assert all(not blk.exit_freed for i, blk in enumerate(prof.blocks) if i != 4)


def test_two_towers_plans_are_measured_as_predicted():
    # the blocks where the towers meet, under every decision (the others kept or selective),
    # and spans inside each tower (no optimizer: the activations' peak binds)
    model, a, b = _towers()
    prof = remat.profile(model, a, b, timer="flops")
    blocks = [model.get_submodule(blk.name) for blk in prof.blocks]
    choices = ("keep", "recompute", "selective")
    wrong = []
    for rest in ("keep", "selective"):
        for ends in itertools.product(choices, repeat=3):  # text.4, image.0, image.2
            ds = [rest] * 8
            ds[4], ds[5], ds[7] = ends
            for block, d in zip(blocks, ds):
                apply_decision(block, d)
            measured = remat.measure_peak(model, a, b)
            if measured != prof.peak(ds).bytes:
                wrong.append((ds, prof.peak(ds).bytes, measured))
    for block in blocks:
        apply_decision(block, "keep")
    for ds, spans in [
        (["selective"] * 5 + ["keep"] * 3, [(2, 4)]),
        (["recompute"] * 8, [(0, 4), (5, 7)]),
        (["keep"] * 4 + ["selective"] * 4, [(5, 6)]),
    ]:
        predicted = prof.peak(ds, spans).bytes
        plan_of(prof, ds, spans).apply(model)
        measured = remat.measure_peak(model, a, b)
        if measured > predicted:  # spans: never low
            wrong.append((ds, spans, predicted, measured))
    assert not wrong
