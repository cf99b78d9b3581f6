"""Spans and splits really lower memory (exact bytes, remat.memory.track), and span-input offload.

The referee for the backward peak is torch.utils.checkpoint nested by hand on
the same model: a checkpoint over each segment of blocks, each block
checkpointed inside (and, for split, each composite child inside that).
Offload runs on the simulated asynchronous device of tests/support/simdevice.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.modules.spans import apply_span
from remat.modules.split import split_block
from tests.support.models import GPT, MLPChain, gpt_step
from tests.support.simdevice import simulated_device, stash_events
from tests.support.steps import param_grads
from tests.support.tensors import assert_all_equal

ROWS, D = 256, 16
UNIT = ROWS * D * 4  # bytes of one block input of MLPChain


def chain_bytes(model, runner=None) -> tuple[int, int, list[torch.Tensor]]:
    """Bytes alive after forward and the peak of forward + backward, and the gradients."""
    torch.manual_seed(0)
    x0 = torch.randn(ROWS, D)
    with remat.memory.track() as t:
        x = x0.clone().requires_grad_()  # the input is counted
        y = runner(model, x) if runner is not None else model(x)
        after = t.current_bytes
        y.sum().backward()
        del y
    return after, t.peak_bytes, param_grads(model, x)


def torch_nested(k: int):
    """torch's checkpoint over each segment of ``k`` blocks, each block checkpointed inside."""

    def runner(model, x):
        blocks = list(model.layers)
        for i in range(0, len(blocks), k):

            def segment(h, seg=blocks[i : i + k]):
                for b in seg:
                    h = torch_checkpoint(b, h, use_reentrant=False)
                return h

            x = torch_checkpoint(segment, x, use_reentrant=False)
        return x

    return runner


def spans_of(n: int, k: int, model, inner="recompute"):
    for i in range(0, n, k):
        apply_span(model, [f"layers.{j}" for j in range(i, min(i + k, n))], inner=inner)
    return model


@pytest.mark.parametrize("k", [2, 4, 8])
def test_span_keeps_only_its_input_after_forward(k):
    after, _, _ = chain_bytes(spans_of(8, k, MLPChain(n=8, d=D)))
    # one input per span (the first is x) and the output: not every block's input
    assert after == (8 // k + 1) * UNIT
    every, _, _ = chain_bytes(_wrapped(MLPChain(n=8, d=D)))
    assert every == (8 + 1) * UNIT
    plain, _, _ = chain_bytes(MLPChain(n=8, d=D))
    assert plain == (8 * 9 + 1) * UNIT  # per block: x, fc1's output, gelu's output (1 + 4 + 4)


def _wrapped(model):
    for layer in model.layers:
        remat.checkpoint_wrapper(layer)
    return model


@pytest.mark.parametrize("k", [2, 4, 8])
def test_span_backward_peak_equals_torch_checkpoint_nested_by_hand(k):
    ref_after, ref_peak, ref_grads = chain_bytes(MLPChain(n=8, d=D), torch_nested(k))
    after, peak, got = chain_bytes(spans_of(8, k, MLPChain(n=8, d=D)))
    assert (after, peak) == (ref_after, ref_peak)
    assert_all_equal(ref_grads, got)


def test_inner_recompute_peak_is_below_every_block_and_below_one_checkpoint_per_span():
    _, every, _ = chain_bytes(_wrapped(MLPChain(n=8, d=D)))
    _, span2, _ = chain_bytes(spans_of(8, 2, MLPChain(n=8, d=D)))
    _, keep2, _ = chain_bytes(spans_of(8, 2, MLPChain(n=8, d=D), inner="keep"))
    _, keep8, _ = chain_bytes(spans_of(8, 8, MLPChain(n=8, d=D), inner="keep"))
    _, plain, _ = chain_bytes(MLPChain(n=8, d=D))
    assert span2 < every
    # keep recomputes a whole span at once: two blocks' activations (8 units) more at the peak
    # than recompute, which holds one block's; a span over everything is the plain peak
    assert keep2 == span2 + 8 * UNIT
    assert keep8 == plain


def _gpt_by_hand(k: int, split: bool):
    """GPT.forward with torch's checkpoint nested: segments, blocks, and the blocks' children."""

    def forward(model, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = model.inp(x)
        blocks = list(model.layers)
        for i in range(0, len(blocks), k):

            def segment(h, seg=blocks[i : i + k]):
                for b in seg:
                    h = torch_checkpoint(b, h, mask=mask, use_reentrant=False)
                return h

            x = torch_checkpoint(segment, x, use_reentrant=False)
        return model.ln(x).square().mean()

    def build():
        model = GPT(n=4, d=32, heads=4)
        if split:
            for b in model.layers:
                for child in (b.ln1, b.attn, b.ln2, b.mlp):  # those with parameters
                    child.forward = functools.partial(
                        torch_checkpoint, type(child).forward.__get__(child), use_reentrant=False
                    )
        model.forward = functools.partial(forward, model)
        return model

    return build


def gpt_bytes(model) -> tuple[int, int, list[torch.Tensor]]:
    torch.manual_seed(0)
    x0 = torch.randn(2, 64, 32)
    with remat.memory.track() as t:
        x = x0.clone().requires_grad_()
        loss = model(x)
        after = t.current_bytes
        loss.backward()
        del loss
    return after, t.peak_bytes, param_grads(model, x)


@pytest.mark.parametrize("split", [False, True])
def test_gpt_span_and_split_peaks_equal_torch_nested_by_hand(split):
    ref = gpt_bytes(_gpt_by_hand(2, split)())
    model = GPT(n=4, d=32, heads=4)
    spans_of(4, 2, model, inner="split" if split else "recompute")
    got = gpt_bytes(model)
    assert got[:2] == ref[:2]
    assert_all_equal(ref[2], got[2])


def test_split_lowers_the_peak_where_attention_dominates():
    # 64 positions, 4 heads, d 32: one block's score matrices (2*4*64*64 floats each) are
    # far larger than its input (2*64*32): splitting attention and MLP off shrinks the
    # working set of a block's recompute
    _, recompute, _ = gpt_bytes(spans_of(4, 2, GPT(n=4, d=32, heads=4)))
    _, split, _ = gpt_bytes(spans_of(4, 2, GPT(n=4, d=32, heads=4), inner="split"))
    _, every, _ = gpt_bytes(_wrapped(GPT(n=4, d=32, heads=4)))
    assert split < recompute <= every
    model = GPT(n=4, d=32, heads=4)
    for i in range(4):
        split_block(model, f"layers.{i}")
    _, split_only, _ = gpt_bytes(_wrapped(model))  # every block checkpointed and split
    assert split_only < every


# -- region-input offload (simulated device) -------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("inner", ["recompute", "keep"])
def test_span_input_offload_on_a_device_gives_bitwise_grads(seed, inner):
    ref, rng = gpt_step(GPT(), seed=seed)
    with simulated_device(seed) as dev:
        model = GPT()
        for i in range(0, 6, 2):
            apply_span(model, [f"layers.{i}", f"layers.{i + 1}"], inner=inner, offload_inputs=True)
        stash = remat.engine.offload.shared_stash()
        for _ in range(2):
            torch.manual_seed(seed)
            x = torch.randn(2, 8, 16, requires_grad=True)
            model.zero_grad(set_to_none=True)
            loss = model(x)
            # each span's input (2 x 8 x 16 floats) sits in host memory until backward
            assert stash.current_bytes == 3 * x.nbytes
            loss.backward()
            assert_all_equal(ref, [loss.detach(), *param_grads(model, x)])
            assert torch.equal(rng, torch.get_rng_state())
            assert stash.current_bytes == 0
    outs = [n for kind, n in dev.copies if kind == "out"]
    backs = [n for kind, n in dev.copies if kind == "back"]
    assert outs == [x.nbytes] * 6 and sorted(backs) == outs  # three per step, each back once


def test_backward_prefetches_the_previous_span_input():
    with simulated_device(0), stash_events() as events:
        model = GPT(n=8)
        for i in range(0, 8, 2):
            apply_span(model, [f"layers.{i}", f"layers.{i + 1}"], offload_inputs=True)
        gpt_step(model)
    # backward asks for span 3's input first: spans 2 and 1's start coming back at once
    # (prefetch depth 2), span 0's when span 2's is asked for
    assert events == [
        ("get", 3),
        ("back", 3),
        ("back", 2),
        ("back", 1),
        ("get", 2),
        ("back", 0),
        ("get", 1),
        ("get", 0),
    ]


def test_span_input_offload_refused_on_cpu():
    with pytest.raises(remat.PlanError, match="offload_inputs=True.*nothing to do on CPU"):
        apply_span(GPT(), ["layers.0", "layers.1"], offload_inputs=True)


def test_span_input_without_prefetch_comes_back_only_when_its_span_asks():
    with simulated_device(0), stash_events() as events:
        model = GPT(n=8)
        for i in range(0, 8, 2):
            apply_span(
                model, [f"layers.{i}", f"layers.{i + 1}"], offload_inputs=True, prefetch=False
            )
        gpt_step(model)
    assert events == [(kind, n) for n in (3, 2, 1, 0) for kind in ("get", "back")]
