"""The plan's boundary warnings (remat.planner.advice): a peak in the loss head, a block the
plan checkpoints that is checkpointed already; printed in the plan's table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import Diagnostic
from remat.measure.diagnose import Kind
from remat.planner.advice import HEAD, nested, on_model
from remat.planner.stepmodel import head_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    """Blocks, then a head of ``vocab`` logits and a cross-entropy: a large vocabulary makes
    the head's logits, their softmax and gradient the largest tensors of the step."""

    def __init__(self, vocab: int, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(depth)))
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.blocks(x)), y)


def _lm(vocab: int) -> tuple[LM, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    return LM(vocab), x, torch.randint(0, vocab, (64,), generator=g)


def test_a_plan_whose_peak_is_in_a_dominant_loss_head_warns_to_chunk_the_loss():
    model, x, y = _lm(vocab=2048)
    prof = remat.profile(model, x, y, timer="flops")
    p = remat.plan(prof, "100%")
    # the head's backward opens the last block's backward window: a tie, named as the block's
    assert p.peak_at == "backward of 'blocks.3'"
    assert [d.kind for d in p.diagnostics] == [Kind.LOSS_HEAD]
    d = p.diagnostics[0]
    assert d.module == HEAD and "Compute the loss in chunks" in d.message
    assert f"warning: {HEAD}: loss head dominates:" in str(p)
    # the same model under remat explain: its probe-based rule agrees that the head dominates
    explained = remat.explain(model, x, y)
    assert Kind.LOSS_HEAD in [e.kind for e in explained.diagnostics]


def test_the_heads_bytes_are_the_logits_their_softmax_and_gradient():
    model, x, y = _lm(vocab=2048)
    prof = remat.profile(model, x, y, timer="flops")
    logits = 64 * 2048 * 4
    # logits, log-softmax output (kept for backward), and the gradient of the logits
    assert 2 * logits <= head_bytes(prof) <= 3 * logits + 64 * 16 * 4


def test_a_small_head_gives_no_loss_head_warning():
    model, x, y = _lm(vocab=8)
    prof = remat.profile(model, x, y, timer="flops")
    for budget in ("100%", "60%"):
        p = remat.plan(prof, budget)
        assert all(d.kind is not Kind.LOSS_HEAD for d in p.diagnostics), budget
        assert "warning: (head" not in str(p)


class Nested(nn.Module):
    """A block whose MLP is a child: its layers are grandchildren, which applying a plan
    leaves as the user wrapped them (it rewraps the block and its children only)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _blocks_with_inner_checkpoints() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(Nested(8) for _ in range(3)))
    remat.checkpoint_wrapper(model[1].mlp[0])
    return model


def test_a_block_the_plan_checkpoints_over_an_inner_checkpoint_is_reported_nested():
    model = _blocks_with_inner_checkpoints()
    recompute = remat.Plan({"0": "recompute", "1": "recompute", "2": "keep"}, 0, 0.0, 0, 0)
    found = nested(model, recompute)
    assert [(d.kind, d.module) for d in found] == [(Kind.NESTED, "1")]
    assert "1.mlp.0 inside it is checkpointed already" in found[0].message
    assert "remat.unwrap" in found[0].message
    # the same block kept, or offloaded (nothing recomputed), is no nesting
    for d in ("keep", "offload"):
        assert nested(model, remat.Plan({"0": "keep", "1": d, "2": "keep"}, 0, 0.0, 0, 0)) == []
    # a child with parameters is the plan's to wrap (applying it rewraps the child): no nesting
    model[2].mlp = remat.checkpoint_wrapper(model[2].mlp)
    assert nested(model, remat.Plan({"0": "keep", "1": "keep", "2": "recompute"}, 0, 0.0, 0, 0)) == []
    # a span over it recomputes it too
    span = remat.Plan({"0": "keep", "1": "keep", "2": "keep"}, 0, 0.0, 0, 0, spans=[["0", "2"]])
    assert [d.module for d in nested(model, span)] == ["1"]


def test_torchs_checkpoint_wrapper_inside_a_planned_block_is_reported_nested():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(Block(8), Block(8))
    model = nn.Sequential(Nested(8), Nested(8))
    model[0].mlp[2] = checkpoint_wrapper(model[0].mlp[2])
    found = nested(model, remat.Plan({"0": "selective", "1": "recompute"}, 0, 0.0, 0, 0))
    assert [d.module for d in found] == ["0"]


def test_hugging_faces_own_checkpointing_under_a_plan_is_reported_with_the_switch_to_turn_off():
    pytest.importorskip("transformers")
    from tests.support.hf_models import llama, stack

    model, batch = llama()
    model.activation_checkpointing_enable()  # transformers 5's name; sets the same flags
    model.train()
    layers = stack("model.layers.")
    plan = remat.Plan(dict.fromkeys(layers, "recompute"), 0, 0.0, 0, 0)
    found = nested(model, plan)
    assert [d.module for d in found] == layers
    assert all("model.activation_checkpointing_disable()" in d.message for d in found)
    model.activation_checkpointing_disable()
    assert nested(model, plan) == []


def test_auto_checkpoint_carries_the_warnings_and_diagnose_adds_the_probed_ones():
    model = _blocks_with_inner_checkpoints()
    x = torch.randn(16, 8)
    p = remat.auto_checkpoint(model, x, budget="100%", timer="flops")
    assert p.diagnostics == []  # every block kept: nothing nested
    # diagnose=True runs remat.explain's rules: the inner wrap of a Linear frees nothing
    p = remat.auto_checkpoint(model, x, budget="100%", timer="flops", diagnose=True)
    assert [(d.kind, d.module) for d in p.diagnostics] == [(Kind.FREES_NOTHING, "1.mlp.0")]
    assert "warning: 1.mlp.0: frees almost nothing" in str(p)


def test_on_model_keeps_one_warning_per_rule_and_module():
    model = _blocks_with_inner_checkpoints()
    d = Diagnostic(Kind.NESTED, "1", "first")
    plan = remat.Plan({"0": "keep", "1": "recompute", "2": "keep"}, 0, 0.0, 0, 0, diagnostics=[d])
    assert on_model(model, plan) == [d]


def test_a_plans_warnings_survive_json():
    d = Diagnostic(Kind.LOSS_HEAD, HEAD, "chunk the loss")
    p = remat.Plan({"a": "keep"}, 1, 0.0, 1, 1, diagnostics=[d])
    back = remat.Plan.from_json(p.to_json())
    assert back.diagnostics == [d] and back == p


def test_a_budget_under_a_loss_head_floor_says_to_chunk_the_loss():
    model, x, y = _lm(vocab=2048)
    prof = remat.profile(model, x, y, timer="flops")
    with pytest.raises(remat.PlanError, match="Compute the loss in chunks"):
        remat.plan(prof, prof.floor_bytes - 1)


def test_diagnose_with_batches_of_varying_shape_is_refused_saying_what_to_do():
    model = _blocks_with_inner_checkpoints()
    with pytest.raises(ValueError, match=r"diagnose=True runs on one batch shape.*remat\.explain"):
        remat.auto_checkpoint(
            model, torch.randn(16, 8), budget="100%", diagnose=True, shapes=remat.Shapes(dims=0)
        )
