"""A selective region nested in another hands its saved outputs to the enclosing region.

Inside a span (``inner="selective"``) or an outer non-reentrant checkpoint, what the
policy saves is packed by the enclosing region's hooks: dropped in forward, brought
back by the enclosing recompute and served from there to the inner recompute. Before,
the inner cache stayed alive from forward to backward beside everything the enclosing
region recomputes (a selective span peaked above the same blocks without a span).
Referees: the unchecked model (gradients, bitwise, dropout on) and exact bytes from
``remat.memory.track``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import remat
from remat import CheckpointError, CheckpointPolicy
from remat.modules.spans import apply_span
from tests.support.models import GPT
from tests.support.steps import param_grads
from tests.support.tensors import assert_all_equal

CALLS = {"n": 0}


@torch.library.custom_op("remat_test::counted_mm", mutates_args=())
def counted_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``, counting how often it runs."""
    CALLS["n"] += 1
    return a @ b


@counted_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


def _counted_backward(ctx, g):
    a, b = ctx.saved_tensors
    return g @ b.T, a.T @ g


def _counted_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


counted_mm.register_autograd(_counted_backward, setup_context=_counted_setup)
COUNTED = [torch.ops.remat_test.counted_mm.default]


class CountedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + counted_mm(x, self.w).sin()


class Chain(nn.Module):
    def __init__(self, n: int = 4, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(CountedBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _span(model: nn.Module, names: list[str], inner: str) -> nn.Module:
    policy = COUNTED if inner == "selective" else None
    apply_span(model, names, inner=inner, policy=policy)
    return model


def _bytes_after_forward(model: nn.Module, x0: torch.Tensor) -> tuple[int, int]:
    with remat.memory.track() as t:
        x = x0.clone().requires_grad_()
        y = model(x)
        after = t.current_bytes
        y.sum().backward()
        del y
    return after, t.peak_bytes


def test_selective_span_keeps_only_its_input_after_forward():
    x = torch.randn(64, 16)
    names = [f"layers.{i}" for i in range(4)]
    sel, _ = _bytes_after_forward(_span(Chain(), names, "selective"), x)
    rec, _ = _bytes_after_forward(_span(Chain(), names, "recompute"), x)
    per_block = Chain()
    for i in range(4):
        per_block.layers[i] = remat.checkpoint_wrapper(per_block.layers[i], policy=COUNTED)
    alone, _ = _bytes_after_forward(per_block, x)
    assert sel == rec  # the span's input and its output: the cache went to the span
    assert alone - sel == (4 + 3) * 64 * 16 * 4  # 4 caches and 3 block inputs less


@pytest.mark.parametrize("inner, runs", [("selective", 4 + 4), ("recompute", 4 + 3 + 4)])
def test_saved_outputs_come_back_from_the_span_recompute_not_a_third_run(inner, runs):
    # forward runs each matmul once, the span's recompute once more; the inner selective
    # recompute is served what the span's recompute brought back. Inner recompute: the span's
    # recompute stops at the last block's input (3 blocks), each block's recompute runs again
    model = _span(Chain(), [f"layers.{i}" for i in range(4)], inner)
    x = torch.randn(64, 16, requires_grad=True)
    CALLS["n"] = 0
    model(x).sum().backward()
    assert CALLS["n"] == runs


def test_selective_span_grads_equal_the_unchecked_model_bitwise():
    ref, model = Chain(), _span(Chain(), ["layers.0", "layers.1", "layers.2"], "selective")
    x = torch.randn(64, 16)
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        m(xi).square().sum().backward()
        m.xgrad = xi.grad
    assert_all_equal(param_grads(ref) + [ref.xgrad], param_grads(model) + [model.xgrad])


def test_second_backward_over_a_selective_span_raises_as_torch():
    # retain_graph=True keeps the graph, not what the blocks' policy saved (torch alike)
    model = _span(Chain(), ["layers.0", "layers.1", "layers.2"], "selective")
    y = model(torch.randn(64, 16, requires_grad=True)).square().sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        y.backward()


def test_gpt_selective_span_grads_and_peak():
    # dropout on: the span's recompute replays the RNG; its backward peak is at most the one
    # of the same blocks checkpointed one by one with the same policy
    policy = remat.policies.save_matmuls()

    def run(model):
        torch.manual_seed(1)
        x0 = torch.randn(2, 32, 32)
        with remat.memory.track() as t:
            x = x0.clone().requires_grad_()
            model(x).backward()
        return t.peak_bytes, param_grads(model, x)

    ref_peak, ref = run(GPT(n=4, d=32, heads=4))
    per_block = GPT(n=4, d=32, heads=4)
    for i in range(4):
        per_block.layers[i] = remat.checkpoint_wrapper(per_block.layers[i], policy=policy)
    block_peak, block_grads = run(per_block)
    spans = GPT(n=4, d=32, heads=4)
    for a in (0, 2):
        apply_span(spans, [f"layers.{a}", f"layers.{a + 1}"], inner="selective", policy=policy)
    span_peak, span_grads = run(spans)
    assert_all_equal(ref, span_grads)
    assert_all_equal(ref, block_grads)
    assert span_peak < block_peak < ref_peak


def test_selective_nested_in_a_checkpoint_is_recomputed_by_the_outer_one():
    w = torch.randn(16, 16, requires_grad=True)
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, COUNTED)

    def inner(h):
        return counted_mm(h, w).sin()

    def outer(h):
        return remat.checkpoint(inner, h, use_reentrant=False, context_fn=ctx_fn).cos()

    def nested_recompute(h):
        return remat.checkpoint(inner, h, use_reentrant=False).cos()

    x0 = torch.randn(64, 16)
    results = []
    for fn in (outer, nested_recompute):
        w.grad = None
        x = x0.clone().requires_grad_()
        with remat.memory.track() as t:
            y = remat.checkpoint(fn, x, use_reentrant=False)
            after = t.current_bytes
        CALLS["n"] = 0
        y.sum().backward()
        results.append((after, CALLS["n"], w.grad.clone(), x.grad))
    x = x0.clone().requires_grad_()
    w.grad = None
    (counted_mm(x, w).sin().cos()).sum().backward()
    (sel_after, sel_runs, sel_w, sel_x), (rec_after, rec_runs, *_) = results
    assert sel_after == rec_after  # only the outer region's input (and the output) stay
    assert (sel_runs, rec_runs) == (1, 2)  # served from the outer recompute
    assert torch.equal(sel_w, w.grad) and torch.equal(sel_x, x.grad)


def _mutating(policy_answer):
    def policy(ctx, op, *args, **kwargs):
        return policy_answer if op in COUNTED else CheckpointPolicy.PREFER_RECOMPUTE

    class Mut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16) / 4)

        def forward(self, x):
            h = counted_mm(x, self.w)
            h.relu_()  # the saved output changed in place inside the region
            return x + h.sin()

    torch.manual_seed(0)
    model = nn.Sequential(Mut(), Mut(), Mut())
    return model, policy


def test_saved_output_changed_in_place_in_a_span_is_recomputed_under_prefer_save():
    model, policy = _mutating(CheckpointPolicy.PREFER_SAVE)
    ref, _ = _mutating(CheckpointPolicy.PREFER_SAVE)
    apply_span(model, ["0", "1", "2"], inner="selective", policy=policy)
    x = torch.randn(8, 16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa).sum().backward()
    model(xb).sum().backward()
    assert_all_equal(param_grads(ref) + [xa.grad], param_grads(model) + [xb.grad])


def test_saved_output_changed_in_place_in_a_span_raises_under_must_save():
    model, policy = _mutating(CheckpointPolicy.MUST_SAVE)
    apply_span(model, ["0", "1", "2"], inner="selective", policy=policy)
    y = model(torch.randn(8, 16, requires_grad=True)).sum()
    with pytest.raises(CheckpointError, match="has been mutated"):
        y.backward()


def test_saved_output_changed_after_the_span_does_not_reach_the_recompute():
    # the block returns the policy's saved output itself; the caller changes it in place
    # after forward. Served from the span's recompute, the cache holds the forward's values
    # (alone, the selective region would raise: its cache is that very tensor)
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16) / 4)

        def forward(self, x):
            return counted_mm(x.sin(), self.w)

    torch.manual_seed(0)
    model = nn.Sequential(Raw(), Raw())
    torch.manual_seed(0)
    ref = nn.Sequential(Raw(), Raw())
    apply_span(model, ["0", "1"], inner="selective", policy=COUNTED)
    x = torch.randn(8, 16)
    outs = []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        y = m(xi)
        z = y * 2
        with torch.no_grad():
            y.add_(1)  # not part of the graph z depends on
        z.sum().backward()
        outs.append(param_grads(m) + [xi.grad])
    assert_all_equal(*outs)
