"""remat.Inputs: a model whose forward takes a keyword named like a planner option."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat

pytestmark = pytest.mark.usefixtures("one_thread")


class Keywords(nn.Module):
    """Blocks whose forward takes keywords named like the planner's options."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)
        )

    def forward(self, x, timer=1.0, optimizer=None, budget=None):
        for layer in self.layers:
            x = layer(x) * timer
        if optimizer is not None:  # an input named "optimizer" that changes the output
            x = x + optimizer
        return x if budget is None else x * budget


def _data():
    torch.manual_seed(0)
    return torch.randn(512, 16), torch.full((16,), 0.5)


def test_inputs_reach_the_model_and_options_reach_the_planner():
    torch.manual_seed(0)
    model = Keywords()
    opt = torch.optim.AdamW(model.parameters())
    x, shift = _data()
    inputs = remat.Inputs(x, timer=2.0, optimizer=shift, budget=3.0)
    plain = remat.measure_peak(model, inputs, optimizer=opt)
    plan = remat.auto_checkpoint(model, inputs, budget="50%", optimizer=opt, timer="flops")
    assert any(d != "keep" for d in plan.decisions.values())
    assert remat.measure_peak(model, inputs, optimizer=opt) <= plan.budget_bytes < plain
    # the checkpointed model, called with those inputs, gives the plain model's gradients
    ref = Keywords()
    ref.load_state_dict(model.state_dict())
    grads = []
    for m in (model, ref):
        m(x, timer=2.0, optimizer=shift, budget=3.0).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_profile_of_inputs_equals_the_profile_of_the_same_keywords():
    torch.manual_seed(0)
    model = Keywords()
    x, shift = _data()
    a = remat.profile(model, remat.Inputs(x, budget=3.0), timer="flops")
    b = remat.profile(model, x, budget=3.0, timer="flops")  # no clash: passed directly
    a_json, b_json = a.to_json(), b.to_json()
    assert a_json == b_json


def test_inputs_beside_other_inputs_is_refused_with_what_to_do():
    model = Keywords()
    x, _ = _data()
    hint = r"Inputs must hold all of the model's inputs.*remat\.Inputs\(\*args, \*\*kwargs\) alone"
    with pytest.raises(TypeError, match=hint):
        remat.measure_peak(model, remat.Inputs(x), timer=2.0)
    with pytest.raises(TypeError, match="Inputs must hold all"):
        remat.profile(model, remat.Inputs(x), x)
