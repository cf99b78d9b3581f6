"""Boundary diagnostics: each rule fires on the case it is about, and not on its neighbour."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import remat
import tests.support.explain_models as em

pytestmark = pytest.mark.usefixtures("one_thread")


def kinds(report) -> list[tuple[str, str]]:
    return [(d.kind.value, d.module) for d in report.diagnostics]


def mlp_chain(layers: int = 2) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[em.MLPBlock(32, 128) for _ in range(layers)])
    return model, torch.randn(4, 8, 32, requires_grad=True)


# -- a checkpoint that frees (almost) nothing ---------------------------------------------


def test_wrapping_every_child_of_a_block_frees_almost_nothing():
    model, x = mlp_chain()
    # the usual mistake: each layer inside the block wrapped instead of the block
    remat.apply_activation_checkpointing(
        model, check_fn=lambda name, m: name.count(".") == 1 and not isinstance(m, nn.GELU)
    )
    report = remat.explain(model, x)
    found = {m for k, m in kinds(report) if k == "frees almost nothing"}
    # a linear layer saves only its input; a norm its input and two per-row statistics
    # (block 0's norm reads the step's input, which exists anyway: dropping its statistics
    # is all it does, and that is a gain)
    assert found == {"0.up", "0.down", "1.norm", "1.up", "1.down"}
    text = next(str(d) for d in report.diagnostics if d.module == "1.up")
    assert "Checkpoint the block that contains it" in text
    assert "its own input" in text


def test_wrapping_the_blocks_frees_their_activations():
    model, x = mlp_chain()
    remat.apply_activation_checkpointing(model)
    report = remat.explain(model, x)
    assert kinds(report) == []
    assert all(r.dropped_bytes > r.input_bytes for r in report.regions)


def test_a_checkpoint_whose_kept_input_is_as_large_as_what_it_drops_frees_almost_nothing():
    class Mix(nn.Module):
        def forward(self, x):
            h = x * 2  # allocated inside: dropped
            return h.tanh()  # tanh saves its output: dropped

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Mix(), nn.Linear(16, 16))
    remat.checkpoint_wrapper(model[1])
    x = torch.randn(64, 16, requires_grad=True)
    report = remat.explain(model, x)
    # tanh's output is dropped, but the next Linear saves it anyway, and the region keeps
    # its input, the first Linear's output, which nothing else would keep: it frees
    # nothing, and the step keeps one tensor more than without the checkpoint
    assert kinds(report) == [("frees almost nothing", "1"), ("raises the peak", "1")]
    assert "as large as what it drops" in str(report.diagnostics[0])


# -- checkpointing that raises the peak ---------------------------------------------------


def test_a_recompute_next_to_every_gradient_raises_the_peak():
    model, x = em.scratch_first(wrap_scratch=True)
    report = remat.explain(model, x)
    assert kinds(report) == [("raises the peak", "0")]
    assert report.peak.bytes > report.peak.plain_bytes
    text = str(report.diagnostics[0])
    assert "while this region is recomputed" in text and "Do not checkpoint it" in text


def test_the_same_model_unwrapped_raises_nothing():
    model, x = em.scratch_first(wrap_scratch=False)
    report = remat.explain(model, x)
    assert kinds(report) == []
    assert report.peak.bytes == report.peak.plain_bytes


# -- checkpoints nested twice -------------------------------------------------------------


def test_a_wrapped_child_of_a_wrapped_block_is_checkpointed_twice():
    model, x = mlp_chain()
    remat.apply_activation_checkpointing(model)
    remat.checkpoint_wrapper(model[1].up)
    report = remat.explain(model, x)
    assert kinds(report) == [("nested checkpoints", "1.up")]
    assert "inside the checkpoint of 1" in str(report.diagnostics[0])


def test_torchs_checkpoint_inside_remats_is_checkpointing_twice():
    torch.manual_seed(0)
    model = nn.Sequential(*[em.TorchCheckpointed(32) for _ in range(2)])
    remat.apply_activation_checkpointing(model)
    report = remat.explain(model, torch.randn(4, 8, 32, requires_grad=True))
    assert kinds(report) == [("nested checkpoints", "0"), ("nested checkpoints", "1")]
    assert "torch.utils.checkpoint runs inside remat's checkpoint" in str(report.diagnostics[0])


def test_remat_inside_torchs_reentrant_checkpoint_is_checkpointing_twice():
    torch.manual_seed(0)
    model = nn.Sequential(*[em.ReentrantOuter(32) for _ in range(2)])
    report = remat.explain(model, torch.randn(4, 8, 32, requires_grad=True))
    assert kinds(report) == [("nested checkpoints", "0.mlp"), ("nested checkpoints", "1.mlp")]


def test_a_torch_reentrant_checkpoint_inside_remats_is_found_by_counting_calls():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = em.MLPBlock(32, 128)

        def forward(self, x):
            return tuc.checkpoint(self.mlp, x, use_reentrant=True)

    torch.manual_seed(0)
    model = nn.Sequential(Inner(), Inner())
    remat.apply_activation_checkpointing(model)
    report = remat.explain(model, torch.randn(4, 8, 32, requires_grad=True))
    assert kinds(report) == [("nested checkpoints", "0.mlp"), ("nested checkpoints", "1.mlp")]
    assert "runs 3 times a step (1 in forward, 2 recomputed" in str(report.diagnostics[0])


def test_hugging_face_checkpointing_under_remats_wrapper_says_how_to_turn_it_off():
    pytest.importorskip("transformers")
    model, inputs = em.llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias users still call
        model.gradient_checkpointing_enable()
    remat.apply_activation_checkpointing(model)
    report = remat.explain(model, **inputs)
    assert kinds(report) == [
        ("nested checkpoints", "model.layers.0"),
        ("nested checkpoints", "model.layers.1"),
    ]
    assert "model.activation_checkpointing_disable()" in str(report.diagnostics[0])


@pytest.mark.parametrize("which", ["remat", "hugging face"])
def test_one_checkpoint_per_layer_is_not_nested(which):
    pytest.importorskip("transformers")
    model, inputs = em.llama()
    if which == "remat":
        remat.apply_activation_checkpointing(model)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    report = remat.explain(model, **inputs)
    assert not [k for k, _ in kinds(report) if k == "nested checkpoints"]


# -- a loss head that dominates the peak ---------------------------------------------------


def test_a_wide_vocabulary_head_dominates_the_peak():
    model, tokens = em.tiny_lm(vocab=4096)
    report = remat.explain(model, tokens)
    assert [k for k, _ in kinds(report)] == ["loss head dominates"]
    text = str(report.diagnostics[0])
    assert "Compute the loss in chunks" in text
    assert "128x4096 float32" in text  # the logits-sized tensor, named


def test_a_small_head_does_not():
    model, tokens = em.tiny_lm(vocab=64, d=64, hidden=256, layers=4)
    report = remat.explain(model, tokens)
    assert kinds(report) == []


# -- verify prints them too --------------------------------------------------------------


def test_verify_reports_the_diagnostics_of_its_checkpointed_step():
    model, x = mlp_chain()
    remat.apply_activation_checkpointing(model)
    remat.checkpoint_wrapper(model[1].up)
    report = remat.verify(model, x)
    assert report.ok  # gradients are right: memory is the problem
    assert [(d.kind.value, d.module) for d in report.diagnostics] == [
        ("nested checkpoints", "1.up")
    ]
    assert "warning: 1.up: nested checkpoints" in str(report)


def test_verify_of_a_sound_model_has_no_diagnostics():
    model, x = mlp_chain()
    remat.apply_activation_checkpointing(model)
    report = remat.verify(model, x)
    assert report.ok and report.diagnostics == []
    assert "warning" not in str(report)


def test_verify_says_when_checkpointing_raises_the_peak():
    model, x = em.scratch_first(wrap_scratch=True)
    report = remat.verify(model, x)
    assert [(d.kind.value, d.module) for d in report.diagnostics] == [("raises the peak", "0")]


@pytest.mark.parametrize("inner", ["recompute", "keep", "selective", "split"])
def test_a_span_over_blocks_is_not_reported_nested(inner):
    from remat.modules.spans import apply_span

    model, x = mlp_chain(layers=3)
    policy = [torch.ops.aten.addmm.default] if inner == "selective" else None
    apply_span(model, ["0", "1", "2"], inner=inner, policy=policy)
    report = remat.explain(model, x)
    assert kinds(report) == []
    spans = [r for r in report.regions if r.kind == "span"]
    assert len(spans) == 1 and spans[0].calls == 1
    assert sum(t.bytes for t in report.tensors) == report.total_bytes


def test_a_split_block_is_not_reported_nested():
    from remat.modules.split import split_block

    model, x = mlp_chain()
    remat.apply_activation_checkpointing(model)
    split_block(model, "1")  # its children checkpointed inside it: on purpose
    report = remat.explain(model, x)
    assert kinds(report) == []
    assert {r.label for r in report.regions} >= {"1", "1.up", "1.down"}
