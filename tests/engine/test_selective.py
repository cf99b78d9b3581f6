"""Selective checkpointing: save / recompute / offload per operator, compared with plain runs and torch."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import CheckpointPolicy as P

MM = torch.ops.aten.mm.default
ADDMM = torch.ops.aten.addmm.default


class CountOps(TorchDispatchMode):
    """Counts dispatched ATen ops by overload."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(16, 16, generator=g).requires_grad_()
    w2 = torch.randn(16, 16, generator=g).requires_grad_()
    x = torch.randn(8, 16, generator=g).requires_grad_()
    return x, w1, w2


def block(x, w1, w2):
    h = torch.mm(x, w1)
    h = F.dropout(h.tanh(), 0.25, training=True)
    return torch.mm(h, w2).sigmoid()


def grads_of(run, seed=7):
    x, w1, w2 = make_params()
    torch.manual_seed(seed)
    out = run(x, w1, w2)
    out.square().sum().backward()
    return out.detach(), x.grad, w1.grad, w2.grad


def save_mm_policy(ctx, op, *args, **kwargs):
    return P.MUST_SAVE if op == MM else P.PREFER_RECOMPUTE


@pytest.mark.parametrize(
    "policy",
    [
        [MM],  # op list: save mm, recompute the rest
        save_mm_policy,  # policy function
        lambda ctx, op, *a, **k: op == MM,  # bools are accepted as in torch
        remat.policies.save_matmuls(),  # ready-made policy
        remat.policies.offload_matmuls(),  # offload: kept on host, never recomputed
    ],
)
def test_selective_grads_equal_uncheckpointed_bitwise(policy):
    ref = grads_of(block)
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, policy)
    got = grads_of(lambda *a: remat.checkpoint(block, *a, context_fn=ctx_fn))
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_selective_grads_equal_torch_selective_checkpoint():
    torch_fn = functools.partial(tuc.create_selective_checkpoint_contexts, [MM])
    ours_fn = functools.partial(remat.create_selective_checkpoint_contexts, [MM])
    ref = grads_of(lambda *a: tuc.checkpoint(block, *a, use_reentrant=False, context_fn=torch_fn))
    got = grads_of(lambda *a: remat.checkpoint(block, *a, context_fn=ours_fn))
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def backward_mm_count(run):
    x, w1, w2 = make_params()
    torch.manual_seed(0)
    out = run(x, w1, w2)
    with CountOps() as c:
        out.sum().backward()
    return c.counts.get(MM, 0)


@pytest.mark.parametrize(
    "policy, extra_mm",
    [
        ([MM], 0),  # saved ops are never run again in recompute
        (remat.policies.offload_matmuls(), 0),  # offloaded ops neither
        ([], 2),  # nothing saved: both mms run again
        (lambda ctx, op, *a, **k: ctx.index == 0 if op == MM else False, 1),  # save the first mm
    ],
)
def test_saved_and_offloaded_ops_are_not_recomputed(policy, extra_mm):
    plain = backward_mm_count(block)
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, policy)
    ours = backward_mm_count(lambda *a: remat.checkpoint(block, *a, context_fn=ctx_fn))
    assert ours == plain + extra_mm


def test_selective_region_keeps_exactly_the_saved_outputs():
    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.outs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.outs.append((func, StorageWeakRef(out.untyped_storage()), out.nbytes))
            return out

    x, w1, w2 = make_params()
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, [MM])
    rec = Record()

    def region(x, w1, w2):
        with rec:
            return block(x, w1, w2)

    out = remat.checkpoint(region, x, w1, w2, context_fn=ctx_fn)
    out_storage = StorageWeakRef(out.untyped_storage())
    alive = [
        (f, n) for f, ref, n in rec.outs if not ref.expired() and ref.cdata != out_storage.cdata
    ]
    assert [f for f, _ in alive] == [MM, MM]
    assert sum(n for _, n in alive) == 2 * 8 * 16 * 4
    out.sum().backward()


def test_mutating_a_saved_output_raises_unless_allowed():
    def f(x, w):
        h = torch.mm(x, w)
        h.mul_(2)  # changes the saved mm output in place
        return h.sin()

    x, w, _ = make_params()
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, [MM])
    y = remat.checkpoint(f, x, w, context_fn=ctx_fn)
    with pytest.raises(remat.CheckpointError, match="modified in place"):
        y.sum().backward()

    allow = functools.partial(
        remat.create_selective_checkpoint_contexts, [MM], allow_cache_entry_mutation=True
    )
    y = remat.checkpoint(f, x, w, context_fn=allow)
    y.sum().backward()  # no error


def test_policy_is_called_in_recompute_with_is_recompute_true():
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((ctx.is_recompute, op, ctx.index))
        return P.MUST_SAVE if op == MM else P.PREFER_RECOMPUTE

    x, w1, w2 = make_params()
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, policy)
    out = remat.checkpoint(block, x, w1, w2, context_fn=ctx_fn)
    assert all(not r for r, _, _ in seen)
    out.sum().backward()
    fwd = [(op, i) for r, op, i in seen if not r]
    rec = [(op, i) for r, op, i in seen if r]
    assert rec == fwd  # the same calls, same indices: consistent answers are possible


def test_policy_answering_differently_in_recompute_raises():
    counter = {"n": 0}

    def drifting(ctx, op, *args, **kwargs):  # the anti-pattern the docstring warns about
        if op != MM:
            return P.PREFER_RECOMPUTE
        counter["n"] += 1
        return P.MUST_SAVE if counter["n"] == 1 else P.PREFER_RECOMPUTE

    x, w1, w2 = make_params()
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, drifting)
    out = remat.checkpoint(block, x, w1, w2, context_fn=ctx_fn)
    with pytest.raises(remat.CheckpointError, match="must answer the same"):
        out.sum().backward()


@pytest.mark.parametrize(
    "ck, contexts",
    [
        (remat.checkpoint, remat.create_selective_checkpoint_contexts),
        (
            functools.partial(tuc.checkpoint, use_reentrant=False),
            tuc.create_selective_checkpoint_contexts,
        ),
    ],
    ids=["remat", "torch"],
)
def test_second_backward_over_selective_region_raises_after_retain_graph(ck, contexts):
    # torch's own test_can_only_trigger_recompute_once: what the policy saved serves one
    # backward; retain_graph=True keeps the graph, not the saved outputs (torch alike)
    x, w1, w2 = make_params()
    out = ck(block, x, w1, w2, context_fn=functools.partial(contexts, [MM])).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        out.backward()


def test_backward_that_builds_a_graph_keeps_saved_outputs_for_the_next_one():
    # create_graph=True: the gradients' graph reaches back into the region, so the next
    # backward recomputes it again and is served the saved outputs (torch raises here)
    x, w1, w2 = make_params()
    torch.manual_seed(1)
    (ref,) = torch.autograd.grad(block(x, w1, w2).sum(), w1, create_graph=True)
    ref.square().sum().backward()
    ref_grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    torch.manual_seed(1)
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, [MM])
    out = remat.checkpoint(block, x, w1, w2, context_fn=ctx_fn).sum()
    (gw,) = torch.autograd.grad(out, w1, create_graph=True)
    gw.square().sum().backward()
    for t, r in zip((x, w1, w2), ref_grads):
        assert torch.equal(t.grad, r)


def test_saved_random_op_keeps_later_random_ops_in_step():
    # rand_like is saved (not re-run); dropout after it is recomputed and must draw
    # the same mask, so the RNG is advanced past the saved op in recompute.
    def f(a):
        r = torch.rand_like(a)
        return (a * r).exp() * F.dropout(a, 0.5, training=True)

    x = torch.randn(6, 5, requires_grad=True)
    torch.manual_seed(3)
    f(x).sum().backward()
    ref, ref_rng = x.grad.clone(), torch.get_rng_state()
    x.grad = None
    torch.manual_seed(3)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, [torch.ops.aten.rand_like.default]
    )
    remat.checkpoint(f, x, context_fn=ctx_fn).sum().backward()
    assert torch.equal(x.grad, ref)
    assert torch.equal(torch.get_rng_state(), ref_rng)


def test_views_and_inplace_ops_in_region_match_uncheckpointed():
    def f(x, w):
        h = torch.mm(x, w)
        v = h.view(-1)[:32].view(4, 8)  # views of a saved output
        g = h.t().contiguous()
        g.add_(1.0)  # in-place on a recomputed tensor
        return v.sum() + g.relu().sum()

    x, w, _ = make_params()
    f(x, w).backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, [MM])
    remat.checkpoint(f, x, w, context_fn=ctx_fn).backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])


@pytest.mark.parametrize(
    "bad, match",
    [
        ([torch.ops.aten.mm], r"OpOverloadPacket.*aten\.mm\.default"),  # packet, not overload
        (["mm"], "torch.ops.aten.mm.default"),  # a string
    ],
)
def test_bad_op_list_is_rejected_with_torchs_phrase_and_a_hint(bad, match):
    with pytest.raises(ValueError, match="Expected op in `op_list` to be an OpOverload"):
        tuc.create_selective_checkpoint_contexts(bad)
    with pytest.raises(ValueError, match="Expected op in `op_list` to be an OpOverload") as info:
        remat.create_selective_checkpoint_contexts(bad)
    assert re.search(match, str(info.value))


def test_non_callable_policy_is_rejected_with_torchs_phrase():
    phrase = "policy_fn_or_list must be either a function or a list of ops"
    with pytest.raises(TypeError, match=phrase):
        tuc.create_selective_checkpoint_contexts(42)
    with pytest.raises(TypeError, match=phrase) as info:
        remat.create_selective_checkpoint_contexts(42)
    assert "42" in str(info.value) and "aten.mm.default" in str(info.value)


def test_policy_returning_garbage_names_the_op():
    ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, lambda *a, **k: "save")
    x, w1, w2 = make_params()
    with pytest.raises(TypeError, match="CheckpointPolicy"):
        remat.checkpoint(block, x, w1, w2, context_fn=ctx_fn)


def test_save_matmuls_covers_linear_and_sdpa_on_cpu():
    lin = torch.nn.Linear(16, 16)
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    with CountOps() as c:
        lin(torch.randn(3, 16))
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    ops = remat.policies.matmul_ops()
    hit = {f for f in c.counts if f in ops}
    assert ADDMM in hit
    assert any("scaled_dot_product" in str(f) for f in hit)


def test_checkpoint_policy_is_torchs_enum():
    assert remat.CheckpointPolicy is tuc.CheckpointPolicy
    assert [p.name for p in remat.CheckpointPolicy] == [
        "MUST_SAVE",
        "PREFER_SAVE",
        "MUST_RECOMPUTE",
        "PREFER_RECOMPUTE",
        "MUST_CPU_OFFLOAD",
        "PREFER_CPU_OFFLOAD",
    ]
