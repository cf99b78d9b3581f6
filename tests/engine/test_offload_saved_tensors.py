"""Saved tensors under remat.offload and the offload policies: unusual saved tensors,
graphs that die without backward, in-place changes, nesting, on CPU and on the
simulated asynchronous device (tests/support/simdevice.py). Gradients are compared bitwise
with the run without offload."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
import torch.nn.functional as F

import remat
import remat.engine.offload as engine
from remat import CheckpointPolicy
from tests.support.simdevice import SimOps, simulated_device

MODES = ["cpu", "simulated-device"]


def _device(mode: str, seed: int = 0) -> contextlib.AbstractContextManager:
    return simulated_device(seed) if mode == "simulated-device" else contextlib.nullcontext()


def _grads(leaves):
    return [None if t.grad is None else t.grad.clone() for t in leaves]


def _reference(f, leaves):
    for t in leaves:
        t.grad = None
    f().backward()
    ref = _grads(leaves)
    for t in leaves:
        t.grad = None
    return ref


def _assert_bitwise(ref, leaves):
    for r, t in zip(ref, leaves):
        assert r is not None and t.grad is not None
        assert torch.equal(r, t.grad)


# --------------------------------------------------------------- unusual saved tensors


class _SavesOnCtx(torch.autograd.Function):
    """Saves an input and its output with save_for_backward, and a tensor on ctx directly."""

    @staticmethod
    def forward(ctx, a, b):
        out = a * b
        ctx.save_for_backward(a, out)
        ctx.extra = b * 2  # not a saved tensor: never packed
        return out

    @staticmethod
    def backward(ctx, g):
        a, _ = ctx.saved_tensors
        return g * ctx.extra / 2, g * a


def _double_backward(a):
    (g,) = torch.autograd.grad((a * 1).pow(3).sum(), a, create_graph=True)
    return g.sin().sum()


def _cases():
    torch.manual_seed(0)
    a = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(16, 24, requires_grad=True)
    s = torch.randn(1, requires_grad=True)
    c = torch.randn(12, 12, dtype=torch.complex64, requires_grad=True)
    h16 = torch.randn(20, 20, dtype=torch.float16, requires_grad=True)
    bf = torch.randn(20, 20, dtype=torch.bfloat16, requires_grad=True)
    x4 = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    w4 = torch.randn(4, 3, 3, 3, requires_grad=True)
    bn = torch.nn.BatchNorm1d(16)
    return [
        # a tensor and its transpose, one storage, both saved by mm
        ("x-and-x.t", lambda: (lambda h: (h @ h.t()).sum())(a * 3), [a]),
        # transposed non-leaf operands of mm (saved non-contiguous)
        ("transposed-mm", lambda: ((b * 2).t() @ (a * 1.5).t()).pow(2).sum(), [a, b]),
        # a stride-0 expanded view saved by mul
        ("expand", lambda: (lambda e: (e * a).sum())((s * 2).expand(24, 16)), [s, a]),
        # an overlapping as_strided view saved by sin
        ("as-strided-overlap", lambda: (a * 1).as_strided((10, 10), (1, 1)).sin().sum(), [a]),
        # complex, and a lazily conjugated view
        ("complex", lambda: (c * c.conj()).exp().abs().sum(), [c]),
        ("conj-view", lambda: (lambda h: (h.conj() * h.sin()).real.sum())(c * 2), [c]),
        ("float16", lambda: (h16 @ h16).sigmoid().float().sum(), [h16]),
        ("bfloat16", lambda: (bf @ bf).sigmoid().float().sum(), [bf]),
        # channels-last conv: the saved input and output keep their memory format
        ("channels-last", lambda: F.conv2d(x4 * 1, w4).relu().pow(2).sum(), [x4, w4]),
        ("custom-function", lambda: _SavesOnCtx.apply(a * 1, b.t() * 1).sin().sum(), [a, b]),
        ("double-backward", lambda: _double_backward(a), [a]),
        # batch_norm saves running stats (buffers) and updates them in place
        ("batchnorm-eval", lambda: bn.eval()(a).pow(2).sum(), [a, bn.weight, bn.bias]),
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [c[0] for c in _cases()])
def test_unusual_saved_tensors_give_bitwise_grads(case, mode):
    _, f, leaves = next(c for c in _cases() if c[0] == case)
    ref = _reference(f, leaves)
    with _device(mode, seed=3):
        with remat.offload(min_bytes=0) as stats:
            y = f()
        y.backward()
        del y
    _assert_bitwise(ref, leaves)
    assert stats.offloaded_tensors > 0 and stats.current_bytes == 0


def test_strides_of_dense_tensors_survive_the_device_round_trip():
    # before: the copy back was contiguous, so a channels-last conv's backward ran
    # other kernels and the gradients differed in the last bits
    stash = engine.HostStash(pin_memory=False)
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    t = torch.randn(6, 7).t()[:, 1:]  # a dense transposed slice with a storage offset
    e = torch.randn(3, 1).expand(3, 4)  # overlapping: comes back contiguous
    with simulated_device(0, progress=0.0):
        back = [stash.get(stash.put(v)) for v in (x, t, e)]
    assert back[0].stride() == x.stride() and back[1].stride() == t.stride()
    assert back[2].is_contiguous()
    for v, w in zip((x, t, e), back):
        assert torch.equal(v, w) and w._base is None


def test_offload_policy_keeps_channels_last_outputs_bitwise_on_async_device():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    w1 = torch.randn(4, 3, 3, 3, requires_grad=True)
    w2 = torch.randn(4, 4, 3, 3, requires_grad=True)

    def f(t):
        return F.conv2d(F.conv2d(t, w1).relu(), w2).pow(2)

    leaves = [x, w1, w2]
    ref = _reference(lambda: f(x).sum(), leaves)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts,
        lambda ctx, op, *a, **k: CheckpointPolicy.MUST_CPU_OFFLOAD,
    )
    with simulated_device(0):
        remat.checkpoint(f, x, context_fn=ctx_fn).sum().backward()
    _assert_bitwise(ref, leaves)


def _sparse_step(stats_ctx):
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    # the checks opted into for the whole construction: torch 2.11 warns "Sparse invariant
    # checks are implicitly disabled" even with check_invariants=True (once a process: the
    # test that makes the first sparse tensor in a worker sees it)
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        s = torch.sparse_coo_tensor(i, torch.randn(3), (3, 3))
    s = s.coalesce().requires_grad_()
    d = torch.randn(3, 40, requires_grad=True)
    with stats_ctx as stats:
        y = torch.sparse.mm(s, d).sum()
    y.backward()
    return s, d, stats


@pytest.mark.parametrize("device_ops", [False, True], ids=["cpu", "device-ops"])
def test_sparse_saved_tensors_are_kept_as_they_are(device_ops, monkeypatch):
    # before: pack read t.nbytes, which raises for a sparse tensor
    if device_ops:  # the device path (the race checker itself cannot read sparse tensors)
        monkeypatch.setattr(engine, "_ops_for", lambda t: SimOps(0, progress=0.5))
    torch.manual_seed(0)
    s, d, _ = _sparse_step(contextlib.nullcontext())
    ref = [s.grad.to_dense(), d.grad.clone()]
    torch.manual_seed(0)
    s, d, stats = _sparse_step(remat.offload(min_bytes=0))
    assert torch.equal(ref[0], s.grad.to_dense()) and torch.equal(ref[1], d.grad)
    # s (indices 2*3 int64 + values 3 float32) and d (3*40 float32)
    assert stats.offloaded_bytes == 6 * 8 + 3 * 4 + 120 * 4
    assert stats.current_bytes == 0


def test_sparse_tensor_under_an_offload_policy_is_counted_by_its_parts():
    stash = engine.HostStash(pin_memory=False)
    s = torch.sparse_coo_tensor(
        torch.tensor([[0, 1]]), torch.ones(2), (4,), check_invariants=True
    ).coalesce()
    entry = remat.engine.selective._Offloaded(s, stash)  # before: nbytes raised
    assert stash.current_bytes == 2 * 8 + 2 * 4
    del entry
    assert stash.current_bytes == 0


# --------------------------------------------------------------- lifetime and counters


@pytest.mark.parametrize("mode", MODES)
def test_graph_freed_without_backward_releases_every_byte_without_gc(mode):
    # before (CPU): the pack hook held exp's own output, whose grad_fn held the packed
    # tensor: a reference cycle kept the graph and its bytes until garbage collection
    x = torch.randn(100, requires_grad=True)
    gc.disable()
    try:
        with _device(mode):
            with remat.offload(min_bytes=0) as stats:
                y = (x * 2).exp()
            held = stats.current_bytes
            del y
            assert (held, stats.current_bytes) == (400, 0)
    finally:
        gc.enable()


def test_in_place_change_of_a_saved_tensor_after_forward_raises_on_cpu():
    # before: the tensor kept on the host as it is was read changed: wrong gradients
    x = torch.randn(5, requires_grad=True)
    with remat.offload(min_bytes=0):
        h = x * 2
        z = h.sin()  # saves h
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_in_place_change_after_forward_reads_the_snapshot_on_async_device():
    x = torch.randn(5, requires_grad=True)
    with simulated_device(0):
        with remat.offload(min_bytes=0):
            h = x * 2
            z = h.sin()
        h.mul_(2)  # the host copy holds the value sin saw
        z.sum().backward()
    assert torch.equal(x.grad, (2 * (x * 2).cos()).detach())


@pytest.mark.parametrize("mode", MODES)
def test_in_place_ops_inside_the_block_still_give_bitwise_grads(mode):
    torch.manual_seed(0)
    x = torch.randn(8, 6, requires_grad=True)
    lin = torch.nn.Linear(6, 6)

    def f():
        h = (x * 1).exp_()  # saves its own (in-place) output
        v = (x * 1)[:, :3].tanh_()  # in place on a view
        return (F.relu(lin(x), inplace=True).pow(2) * h).sum() + v.sum()

    leaves = [x, lin.weight, lin.bias]
    ref = _reference(f, leaves)
    with _device(mode, seed=1):
        with remat.offload(min_bytes=0):
            y = f()
        y.backward()
    _assert_bitwise(ref, leaves)


def test_min_bytes_is_inclusive_and_parameters_are_skipped():
    p = torch.nn.Parameter(torch.randn(64))
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=256) as stats:
        a = (x * 1).exp()  # saves 256 bytes: kept
        b = (x[:63] * 1).exp()  # saves 252 bytes: skipped
        c = p * p.t()  # saves p (a parameter) and p.t() (a view of one)
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (1, 256)
    assert stats.skipped_small == 1 and stats.skipped_parameters == 2
    (a.sum() + b.sum() + c.sum()).backward()


# --------------------------------------------------------------- nesting and backward variants


def _model(w):
    return lambda t: ((t @ w).sin() @ w).cos()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "layout",
    [
        "nested-offload",  # an inner offload() inside an outer one
        "offload-in-checkpoint",  # offload() inside a checkpointed function
        "offload-in-reentrant-checkpoint",
        "reentrant-checkpoint-in-offload",
        "user-hooks-inside",  # the user's saved_tensors_hooks win inside offload()
    ],
)
def test_nesting_with_checkpoint_and_hooks_gives_bitwise_grads(layout, mode):
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    f = _model(w)
    ref = _reference(lambda: f(x * 1).sum(), [x, w])

    def in_offload(t):
        with remat.offload(min_bytes=0):
            return f(t)

    with _device(mode, seed=2):
        if layout == "nested-offload":
            with remat.offload(min_bytes=0):
                h = (x * 1 @ w).sin()
                with remat.offload(min_bytes=0):
                    h = h @ w
                y = h.cos()
        elif layout == "offload-in-checkpoint":
            y = remat.checkpoint(in_offload, x * 1, use_reentrant=False)
        elif layout == "offload-in-reentrant-checkpoint":
            y = remat.checkpoint(in_offload, x * 1, use_reentrant=True)
        elif layout == "reentrant-checkpoint-in-offload":
            with remat.offload(min_bytes=0):
                y = remat.checkpoint(f, x * 1, use_reentrant=True)
        else:
            with remat.offload(min_bytes=0):
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    y = f(x * 1)
        y.sum().backward()
    _assert_bitwise(ref, [x, w])


@pytest.mark.parametrize("mode", MODES)
def test_grad_twice_and_backward_inputs_release_every_byte(mode):
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    f = _model(w)
    ref = _reference(lambda: f(x * 1).sum(), [x, w])
    with _device(mode, seed=4):
        with remat.offload(min_bytes=0) as stats:
            y = f(x * 1).sum()
        g1 = torch.autograd.grad(y, [x, w], retain_graph=True)
        y.backward(inputs=[w])
        del y
    assert all(torch.equal(r, g) for r, g in zip(ref, g1))
    assert torch.equal(ref[1], w.grad) and x.grad is None
    assert stats.current_bytes == 0


def test_offload_policy_on_an_op_with_a_sparse_output_gives_plain_grads():
    import functools

    torch.manual_seed(0)
    x = torch.randn(6, 6).relu().requires_grad_()
    w = torch.randn(6, 6, requires_grad=True)

    def f(t):
        return torch.sparse.mm(t.to_sparse(), w).sin()  # to_sparse's output is sparse

    f(x).sum().backward()
    ref = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts,
        lambda ctx, op, *a, **k: remat.CheckpointPolicy.MUST_CPU_OFFLOAD,
    )
    remat.checkpoint(f, x, context_fn=ctx_fn).sum().backward()
    assert torch.equal(ref[0], x.grad) and torch.equal(ref[1], w.grad)


def test_selective_offload_region_is_freed_when_its_output_is_dropped_without_gc():
    import functools
    import gc
    import weakref

    import remat.engine.offload as engine

    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    remat.checkpoint(lambda t: (t @ w).tanh(), x, context_fn=ctx_fn).sum().backward()  # warm
    seen = []

    def f(t):
        m = t @ w  # offloaded (on CPU: kept as it is)
        seen.append(weakref.ref(m))
        return m.tanh()

    gc.collect()
    gc.disable()
    try:
        before = engine.shared_stash().current_bytes
        y = remat.checkpoint(f, x, context_fn=ctx_fn)
        assert engine.shared_stash().current_bytes == before + 8 * 16 * 4
        del y  # no backward: the graph, the region and its kept output go at once
        assert seen[0]() is None
        assert engine.shared_stash().current_bytes == before
    finally:
        gc.enable()
