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


def test_plan_table_predicts_the_step_peak_measure_peak_measures_and_says_what_it_counts():
    from remat.planner.render import STEP_PEAK
    from tests.support.plans import make_model

    model, x = make_model("mlp")
    plan = remat.auto_checkpoint(model, x, budget="95%", timer="flops", quiet=True)
    assert any(d != "keep" for d in plan.decisions.values())
    assert STEP_PEAK in str(plan).splitlines()
    # the table's figure, measure_peak's and verify's are one number, in one convention
    assert remat.measure_peak(model, x) == plan.predicted_peak_bytes
    assert remat.verify(model, x).step_peak_checkpointed == plan.predicted_peak_bytes
