"""Fixtures of the planner's tests."""

from __future__ import annotations

import pytest
import torch

import remat
from tests.support.plans import make_model


@pytest.fixture(scope="module")
def adamw_profile():
    """The step-model tests' residual MLP profiled with AdamW (gradients None), FLOPs as cost."""
    model, x = make_model("mlp")
    return remat.profile(model, x, optimizer=torch.optim.AdamW(model.parameters()), timer="flops")
