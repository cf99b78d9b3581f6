"""Putting a plan on a model (remat.planner.apply): its table, and a model without its blocks refused."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.bench.models import build, example_input
from tests.support.models import SMALL_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_table_and_apply_to_wrong_model():
    model = build(SMALL_GPT)
    p = remat.plan(
        remat.profile(model, example_input(SMALL_GPT), timer="flops", set_to_none=False), "60%"
    )
    text = str(p)
    assert "blocks.0" in text and "predicted step peak" in text
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(remat.PlanError, match="no submodule named"):
        p.apply(other)
