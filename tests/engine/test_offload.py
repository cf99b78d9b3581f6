"""remat.offload and the offload engine (remat.engine.offload): what is kept on the host, and gradients unchanged."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.engine.offload import HostStash, is_parameter_like

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mlp(seed=0, d=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, d))


def test_offload_grads_equal_plain_run():
    model = mlp()
    x = torch.randn(16, 32, requires_grad=True)
    model(x).square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    with remat.offload(min_bytes=0):
        y = model(x)
    y.square().sum().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_offload_skips_parameters_and_small_tensors_and_counts_bytes():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)  # 8192 bytes
    small = torch.randn(4, requires_grad=True)  # 16 bytes
    with remat.offload(min_bytes=1024) as stats:
        y = lin(x).relu()  # saves x, weight.t() (param view), relu output
        z = (small * 3).exp()  # saves exp output (16 bytes)
    assert stats.offloaded_tensors == 2
    assert stats.offloaded_bytes == 2 * 32 * 64 * 4
    assert stats.current_bytes == 2 * 32 * 64 * 4
    assert stats.skipped_parameters == 1
    assert stats.skipped_small == 1
    (y.sum() + z.sum()).backward()
    del y, z
    assert stats.current_bytes == 0
    assert stats.peak_bytes == 2 * 32 * 64 * 4


def test_offload_around_checkpoint_moves_only_the_region_inputs():
    model = mlp(d=64)
    x = torch.randn(32, 64, requires_grad=True)
    h = x * 1.0  # a non-leaf input of the region
    with remat.offload(min_bytes=0) as stats:
        y = remat.checkpoint(model, h)
    assert stats.offloaded_tensors == 1
    assert stats.offloaded_bytes == h.nbytes
    y.sum().backward()
    ref_model = mlp(d=64)
    x2 = x.detach().clone().requires_grad_()
    ref_model(x2 * 1.0).sum().backward()
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1k"])
def test_offload_rejects_bad_min_bytes(bad):
    with pytest.raises(ValueError, match="min_bytes"):
        with remat.offload(min_bytes=bad):
            pass


def test_parameter_views_are_recognised():
    p = torch.nn.Parameter(torch.randn(3, 3))
    assert is_parameter_like(p)
    assert is_parameter_like(p.t())
    assert not is_parameter_like(torch.randn(3))


def test_cpu_offload_policy_keeps_output_as_is_on_cpu():
    stash = HostStash(pin_memory=False)
    t = torch.randn(10)
    ticket = stash.put(t)
    assert ticket is t  # CPU: no copy at all
    assert stash.get(ticket) is t
    assert stash.current_bytes == 40
    stash.release(ticket)
    assert stash.current_bytes == 0


def test_offload_restores_previous_hooks_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with remat.offload():
            raise RuntimeError("boom")
    x = torch.randn(300, requires_grad=True)
    y = x.exp()  # no hooks left behind: saved normally
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


# ---------------------------------------------------------------- GPU (skipped without CUDA)


@needs_cuda
@pytest.mark.gpu
def test_offloaded_tensors_live_in_pinned_host_memory_and_device_memory_drops():
    torch.cuda.synchronize()
    lin = torch.nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    base = torch.cuda.memory_allocated()
    # sin saves the linear output and cos saves sin's: two intermediates nobody else holds
    y_plain = lin(x).sin().cos()
    plain = torch.cuda.memory_allocated() - base
    del y_plain
    captured = []
    orig_put = HostStash.put

    def spy(self, t, *args, **kwargs):
        tk = orig_put(self, t, *args, **kwargs)
        captured.append(tk)
        return tk

    HostStash.put = spy
    try:
        with remat.offload():
            y = lin(x).sin().cos()
    finally:
        HostStash.put = orig_put
    torch.cuda.synchronize()
    off = torch.cuda.memory_allocated() - base
    assert len(captured) == 3  # x, the linear output, the sin output (the weight is skipped)
    assert all(tk.host.is_pinned() for tk in captured)
    # the two intermediates (4096x1024 fp32 each) left the device; y itself stays
    assert plain - off >= 2 * 4096 * 1024 * 4
    y.sum().backward()


@needs_cuda
@pytest.mark.gpu
def test_offload_stress_random_sizes_bitwise_equal():
    g = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(64, 1024, (12,), generator=g)]
    layers = torch.nn.ModuleList(
        torch.nn.Linear(a, b, device="cuda") for a, b in zip(sizes[:-1], sizes[1:])
    )
    x = torch.randn(512, sizes[0], device="cuda")

    def step(offloaded):
        for p in layers.parameters():
            p.grad = None
        ctx = (
            remat.offload(min_bytes=0)
            if offloaded
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:
            h = x
            for lin in layers:
                h = F.gelu(lin(h))
        h.square().mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    ref = step(False)
    for _ in range(5):
        got = step(True)
        for r, o in zip(ref, got):
            assert torch.equal(r, o)


@needs_cuda
@pytest.mark.gpu
def test_offload_policy_on_cuda_gives_bitwise_grads():
    lin1 = torch.nn.Linear(256, 256, device="cuda")
    lin2 = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)

    def f(t):
        return lin2(F.gelu(lin1(t)))

    f(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    remat.checkpoint(f, x, context_fn=ctx_fn).sum().backward()
    assert torch.equal(x.grad, ref)


def test_offload_policy_regions_share_one_stash_per_thread():
    from remat.engine.offload import shared_stash

    stores = []
    orig = remat.engine.selective._Store.__init__

    def spy(self):
        orig(self)
        stores.append(self)

    remat.engine.selective._Store.__init__ = spy
    try:
        ctx_fn = functools.partial(
            remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
        )
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
        h = remat.checkpoint(lambda t: lin(t).tanh(), x, context_fn=ctx_fn)
        h = remat.checkpoint(lambda t: lin(t).tanh(), h, context_fn=ctx_fn)
        h.sum().backward()
    finally:
        remat.engine.selective._Store.__init__ = orig
    assert len(stores) == 2
    assert stores[0].stash is stores[1].stash is shared_stash()


@needs_cuda
@pytest.mark.gpu
def test_backward_prefetches_the_previous_regions_offloaded_outputs():
    from tests.support.simdevice import stash_events

    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    lin = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    with stash_events() as events:
        h = remat.checkpoint(lambda t: lin(t).tanh(), x, context_fn=ctx_fn)
        h = remat.checkpoint(lambda t: lin(t).tanh(), h, context_fn=ctx_fn)
        h.sum().backward()
    # region 2's recompute fetches its output and prefetches region 1's, which is then ready
    assert events[:3] == [("get", 1), ("back", 1), ("back", 0)]
    assert events.count(("back", 0)) == 1
