"""Blocks split in parts (remat.modules.split): the children with parameters as their own regions.

Compared bitwise (torch.equal) with the model run without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.modules.spans import apply_span, spans_in
from remat.modules.split import can_split, is_split, split_block, split_children, unsplit_block
from tests.support.models import GPT, gpt_step
from tests.support.steps import param_grads
from tests.support.tensors import assert_all_equal


def test_split_block_grads_equal_and_unsplit_restores():
    model = GPT()
    assert split_block(model, "layers.2") == ["layers.2.ln1", "layers.2.attn", "layers.2.ln2", "layers.2.mlp"]  # the children with parameters
    assert split_block(model, "layers.3", children=["ln1", "attn"]) == [
        "layers.3.ln1",
        "layers.3.attn",
    ]
    remat.checkpoint_wrapper(model.layers[4])  # a checkpointed block split inside
    split_block(model, "layers.4")
    ref, rng = gpt_step(GPT())
    got, rng2 = gpt_step(model)
    assert_all_equal(ref, got)
    assert torch.equal(rng, rng2)
    assert unsplit_block(model, "layers.2") == ["layers.2.ln1", "layers.2.attn", "layers.2.ln2", "layers.2.mlp"]
    assert not remat.modules.wrap.is_wrapped(model.layers[2].attn)
    assert unsplit_block(model, "layers.2") == []


def test_split_block_rejects_too_few_children_unknown_and_repeated_splits():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
    with pytest.raises(remat.PlanError, match=r"'0' has 1 children with parameters \(\['0'\]"):
        split_block(model, "0")
    with pytest.raises(remat.PlanError, match="has no child 'mlp'"):
        split_block(model, "0", children=["mlp"])
    gpt = GPT()
    split_block(gpt, "layers.0")
    with pytest.raises(remat.PlanError, match="already split"):
        split_block(gpt, "layers.0")
    remat.checkpoint_wrapper(gpt.layers[1].mlp)
    with pytest.raises(remat.PlanError, match="already checkpointed; unwrap it first"):
        split_block(gpt, "layers.1")
    assert not remat.modules.wrap.is_wrapped(gpt.layers[1].attn)  # nothing half done
    with pytest.raises(remat.PlanError, match="splitting needs two or more"):
        apply_span(model, ["0", "1"], inner="split")
    assert spans_in(model) == []


def test_functional_between_children_stays_in_the_block():
    # a block whose forward applies functional code between its children: split keeps it
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
            self.b = nn.Sequential(nn.Linear(8, 8))

        def forward(self, x):
            return x + self.b(F.silu(self.a(x)))

    def make():
        torch.manual_seed(0)
        return nn.Sequential(Block(), Block(), Block())

    def step(m):
        torch.manual_seed(3)
        x = torch.randn(4, 8, requires_grad=True)
        m(x).square().sum().backward()
        return param_grads(m, x)

    model = make()
    apply_span(model, ["0", "1", "2"], inner="split")
    assert_all_equal(step(make()), step(model))


def test_split_children_are_the_children_with_parameters_frozen_ones_included():
    block = nn.Sequential(nn.LayerNorm(4), nn.ReLU(), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 4))
    block[0].requires_grad_(False)  # frozen: still a child with parameters
    assert split_children(block) == ["0", "3"] and can_split(block)
    assert not can_split(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))  # one region is no split
    model = nn.Sequential(block)
    assert split_block(model, "0") == ["0.0", "0.3"] and is_split(block)
    assert [remat.modules.wrap.is_wrapped(c) for c in block] == [True, False, False, True]


@pytest.mark.parametrize(
    "name, children, match",
    [
        ("nope", None, r"the model has no submodule 'nope'\. Pass names from"),
        ("", None, "block names must be non-empty strings"),
        ("0", "0", r"children must be a non-empty list of child names, got '0'"),
        ("0", [], "children must be a non-empty list"),
    ],
    ids=["missing-block", "empty-name", "children-a-string", "no-children"],
)
def test_split_block_names_a_missing_block_and_bad_children(name, children, match):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(remat.PlanError, match=match):
        split_block(model, name, children=children)
    assert not is_split(model[0])
