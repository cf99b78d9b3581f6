"""The names of torch.utils.checkpoint.__all__ that remat adds: torch's behaviour, side by side.

CheckpointFunction (the reentrant autograd.Function), GraphExecGroup (one recompute
for several backward calls) and SAC_IGNORED_OPS (operators selective checkpointing
skips). The name list itself is pinned in test_public_api.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import remat
from remat import CheckpointPolicy as P
from remat.engine.config import _GraphExecGroupFallback


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g).requires_grad_()
    w = torch.randn(6, 6, generator=g).requires_grad_()
    return x, w


def block(x, w):
    return F.dropout(torch.tanh(x @ w), 0.3, training=True).exp()


def grads_of(run, x, w, seed=7):
    x.grad = w.grad = None
    torch.manual_seed(seed)
    run(x, w).sum().backward()
    return x.grad.clone(), w.grad.clone(), torch.get_rng_state()


# -- CheckpointFunction ------------------------------------------------------------------


@pytest.mark.parametrize("preserve", [True, False])
def test_checkpoint_function_apply_matches_torchs_and_the_plain_run(preserve):
    x, w = make()
    ref = grads_of(block, x, w)
    torch_run = grads_of(lambda a, b: tuc.CheckpointFunction.apply(block, preserve, a, b), x, w)
    ours = grads_of(lambda a, b: remat.CheckpointFunction.apply(block, preserve, a, b), x, w)
    for t, o in zip(torch_run, ours):
        assert torch.equal(t, o)
    if preserve:  # dropout replayed: the plain run's gradients
        for r, o in zip(ref, ours):
            assert torch.equal(r, o)


def test_checkpoint_function_warns_like_torch_when_no_argument_requires_grad():
    x = torch.randn(3)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        t_out = tuc.CheckpointFunction.apply(torch.sin, True, x)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        r_out = remat.CheckpointFunction.apply(torch.sin, True, x)
    assert torch.equal(t_out, r_out)
    assert not t_out.requires_grad and not r_out.requires_grad  # torch's semantics, no anchor


def test_checkpoint_function_can_be_subclassed_as_torchs():
    def subclass(base):
        class Counting(base):
            calls = 0

            @staticmethod
            def forward(ctx, run_function, preserve_rng_state, *args):
                Counting.calls += 1
                return base.forward(ctx, run_function, preserve_rng_state, *args)

        return Counting

    x, w = make()
    results = []
    for base in (tuc.CheckpointFunction, remat.CheckpointFunction):
        cls = subclass(base)
        results.append(grads_of(lambda a, b, c=cls: c.apply(block, True, a, b), x, w))
        assert cls.calls == 1
    for t, o in zip(*results):
        assert torch.equal(t, o)


def test_checkpoint_function_sets_torchs_ctx_attributes():
    seen = {}

    class Peek(remat.CheckpointFunction):
        @staticmethod
        def backward(ctx, *grads):
            seen.update(
                run_function=ctx.run_function,
                preserve=ctx.preserve_rng_state,
                inputs=list(ctx.inputs),
                tensor_indices=list(ctx.tensor_indices),
            )
            return remat.CheckpointFunction.backward(ctx, *grads)

    x = torch.randn(3, requires_grad=True)
    Peek.apply(torch.mul, True, x, 2.0).sum().backward()
    assert seen == {
        "run_function": torch.mul,
        "preserve": True,
        "inputs": [None, 2.0],
        "tensor_indices": [0],
    }
    assert torch.equal(x.grad, torch.full((3,), 2.0))


# -- GraphExecGroup ----------------------------------------------------------------------


def two_outputs(counter):
    def fn(x):
        counter.append(1)
        return x.sin().exp(), x.cos().exp()

    return fn


def group_run(ckpt, group_cls):
    """Two backward calls over disjoint parts of one region; returns (recomputes, grads)."""
    calls = []
    x = torch.randn(5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    a, b = ckpt(two_outputs(calls), x, use_reentrant=False)
    calls.clear()
    grads = []
    with group_cls() if group_cls is not None else _null():
        grads.append(torch.autograd.grad(a.sum(), x)[0])
        grads.append(torch.autograd.grad(b.sum(), x)[0])
    plain = [x.sin().exp() * x.cos(), -(x.cos().exp()) * x.sin()]
    for g, p in zip(grads, plain):
        assert torch.allclose(g, p.detach())
    return len(calls), grads


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_graph_exec_group_is_torchs_class():
    assert remat.GraphExecGroup is tuc.GraphExecGroup


@pytest.mark.parametrize(
    "group_cls, recomputes",
    [
        (None, 2),  # each backward recomputes the region
        (tuc.GraphExecGroup, 1),  # one recompute serves both
    ],
    ids=["no-group", "group"],
)
def test_backward_calls_in_one_group_recompute_once_as_in_torch(group_cls, recomputes):
    t_count, t_grads = group_run(tuc.checkpoint, group_cls)
    r_count, r_grads = group_run(remat.checkpoint, group_cls)
    assert t_count == r_count == recomputes
    for t, r in zip(t_grads, r_grads):
        assert torch.equal(t, r)


def test_remats_own_group_class_does_the_same_where_torch_lacks_one():
    count, _ = group_run(remat.checkpoint, _GraphExecGroupFallback)
    assert count == 1
    with _GraphExecGroupFallback():
        with pytest.raises(RuntimeError, match="cannot be nested"):
            _GraphExecGroupFallback().__enter__()


def test_overlapping_backward_calls_in_a_group_raise_torchs_error():
    for ckpt in (tuc.checkpoint, remat.checkpoint):
        x = torch.randn(5, requires_grad=True)
        y = ckpt(lambda t: t.sin().exp(), x, use_reentrant=False)
        with remat.GraphExecGroup():
            torch.autograd.grad(y.sum(), x, retain_graph=True)
            with pytest.raises(
                tuc.CheckpointError, match="Unpack is being triggered for a tensor that was"
            ) as info:
                torch.autograd.grad(y.sum(), x)
        if ckpt is remat.checkpoint:
            assert "GraphExecGroup" in str(info.value)


# -- SAC_IGNORED_OPS ---------------------------------------------------------------------


def test_sac_ignored_ops_is_torchs_set():
    assert remat.SAC_IGNORED_OPS is tuc.SAC_IGNORED_OPS
    assert torch.ops.aten.detach.default in remat.SAC_IGNORED_OPS


def test_an_op_added_to_sac_ignored_ops_is_skipped_by_both():
    sin = torch.ops.aten.sin.default

    def run(ckpt, create):
        asked = []

        def policy(ctx, op, *args, **kwargs):
            asked.append(op)
            return P.MUST_SAVE

        x, w = make()
        ctx_fn = functools.partial(create, policy)
        out = ckpt(lambda a, b: (a @ b).sin().exp(), x, w, use_reentrant=False, context_fn=ctx_fn)
        out.sum().backward()
        return asked, x.grad, w.grad

    remat.SAC_IGNORED_OPS.add(sin)
    try:
        t_asked, *t_grads = run(tuc.checkpoint, tuc.create_selective_checkpoint_contexts)
        r_asked, *r_grads = run(remat.checkpoint, remat.create_selective_checkpoint_contexts)
    finally:
        remat.SAC_IGNORED_OPS.discard(sin)
    assert sin not in t_asked and sin not in r_asked
    assert torch.ops.aten.mm.default in r_asked
    for t, r in zip(t_grads, r_grads):
        assert torch.equal(t, r)
