"""The offload engine's device path, run on a simulated asynchronous device
(tests/support/simdevice.py).

The simulated device defers side-stream copies and flags any read of memory
whose copy has not finished, so these tests check the stream discipline
(events, record_stream, pinned-pool reuse, prefetch) without a GPU. The same
behaviours on real CUDA are in the ``gpu``-marked tests of test_offload.py.
"""

from __future__ import annotations

import contextlib
import functools
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.planner.apply import apply_decision
from tests.support.simdevice import RaceError, simulated_device, stash_events
from tests.support.steps import param_grads

SEEDS = [0, 1, 2, 3, 4, 5]


def _ragged_mlp(seed: int, layers: int = 8) -> tuple[torch.nn.Sequential, int]:
    rnd = random.Random(seed)
    widths = [rnd.choice([16, 24, 40, 64, 100]) for _ in range(layers + 1)]
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*mods), widths[0]


def _zero(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None


def _with_reference(seed: int, layers: int, rows: int) -> tuple[Any, torch.Tensor, list[Any]]:
    """A ragged MLP, an input, and the plain run's gradients of ``model(x).sum()``."""
    model, d = _ragged_mlp(seed, layers=layers)
    x = torch.randn(rows, d, requires_grad=True)
    model(x).sum().backward()
    ref = param_grads(model, x)
    _zero(model, x)
    return model, x, ref


@pytest.mark.parametrize("seed", SEEDS)
def test_offload_on_async_device_gives_bitwise_grads_over_repeated_steps(seed):
    model, d = _ragged_mlp(seed)
    x = torch.randn(33, d, requires_grad=True)
    model(x).pow(2).sum().backward()
    ref = param_grads(model, x)
    with simulated_device(seed) as dev:
        for step in range(3):
            _zero(model, x)
            with remat.offload(min_bytes=0) as stats:
                y = model(x)
            assert stats.offloaded_tensors > 0
            y.pow(2).sum().backward()
            del y
            for r, g in zip(ref, param_grads(model, x)):
                assert torch.equal(r, g), f"step {step}"
            assert stats.current_bytes == 0
    assert ("out", x.nbytes) in dev.copies
    outs = sorted(n for kind, n in dev.copies if kind == "out")
    assert sorted(n for kind, n in dev.copies if kind == "back") == outs  # each back once


def test_pinned_buffers_are_reused_across_steps_within_one_stash():
    stash_steps = []
    model, d = _ragged_mlp(0)
    x = torch.randn(16, d, requires_grad=True)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    with simulated_device(0) as dev:
        for _ in range(3):
            before = dev.host_buffers
            remat.checkpoint(model, x, context_fn=ctx_fn).sum().backward()
            stash_steps.append(dev.host_buffers - before)
    assert stash_steps[0] > 0
    assert stash_steps[1:] == [0, 0]  # every buffer came back to the pool and was reused


@pytest.mark.parametrize("seed", SEEDS)
def test_offload_policies_on_async_device_match_plain_run_and_never_recompute_matmuls(seed):
    model, d = _ragged_mlp(seed, layers=4)
    x = torch.randn(20, d, requires_grad=True)
    model(x).tanh().sum().backward()
    ref = param_grads(model, x)
    _zero(model, x)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    calls = {"addmm": 0}
    orig = torch.nn.functional.linear

    def counting_linear(*a, **k):
        calls["addmm"] += 1
        return orig(*a, **k)

    with simulated_device(seed) as dev:
        h = x
        for i in range(0, len(model), 2):
            h = remat.checkpoint(model[i : i + 2], h, context_fn=ctx_fn)
        torch.nn.functional.linear = counting_linear
        try:
            h.tanh().sum().backward()
        finally:
            torch.nn.functional.linear = orig
    assert calls["addmm"] == 4  # recompute reruns the Linear modules; their matmul is served
    for r, g in zip(ref, param_grads(model, x)):
        assert torch.equal(r, g)
    outs = [n for kind, n in dev.copies if kind == "out"]
    assert len(outs) == 4  # one offloaded matmul output per layer


def test_offload_policy_second_backward_with_retain_graph_copies_back_again():
    model, x, ref = _with_reference(1, layers=2, rows=8)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    with simulated_device(1) as dev:
        y = remat.checkpoint(model, x, context_fn=ctx_fn).sum()
        y.backward(retain_graph=True)
        first = param_grads(model, x)
        _zero(model, x)
        y.backward()
    for r, a, b in zip(ref, first, param_grads(model, x)):
        assert torch.equal(r, a) and torch.equal(r, b)
    backs = sum(1 for kind, _ in dev.copies if kind == "back")
    assert backs == 2 * 2  # two matmul outputs, copied back once per backward


def test_backward_prefetches_previous_regions_outputs_on_async_device():
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with stash_events() as events:
        with simulated_device(0):
            h = remat.checkpoint(lambda t: lin(t).tanh(), x, context_fn=ctx_fn)
            h = remat.checkpoint(lambda t: lin(t).tanh(), h, context_fn=ctx_fn)
            h.sum().backward()
    # region 2's recompute fetches its output and prefetches region 1's, which is then ready
    assert events == [("get", 1), ("back", 1), ("back", 0), ("get", 0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wrapper_offload_to_cpu_and_planner_offload_on_async_device_match_plain_run(seed):
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    x = torch.randn(12, 32, requires_grad=True)
    F.mse_loss(model(x), torch.zeros(12, 32)).backward()
    ref = param_grads(model, x)
    _zero(model, x)
    remat.checkpoint_wrapper(blocks[0], offload_to_cpu=True)
    remat.checkpoint_wrapper(blocks[1], offload_to_cpu=True, policy=remat.policies.save_matmuls())
    apply_decision(blocks[2], "offload")
    remat.checkpoint_wrapper(blocks[3], offload_to_cpu=True, use_reentrant=True)
    with simulated_device(seed) as dev:
        F.mse_loss(model(x), torch.zeros(12, 32)).backward()
    for r, g in zip(ref, param_grads(model, x)):
        assert torch.equal(r, g)
    # each wrapper's input, block 2's saved tensors (its input and GELU's input)
    assert [k for k, _ in dev.copies].count("out") == 5


def test_race_detector_catches_compute_reading_before_the_copy_back_finished():
    model, d = _ragged_mlp(0, layers=3)
    x = torch.randn(16, d, requires_grad=True)
    with simulated_device(0, progress=0.0) as dev:
        dev.skip_compute_wait = True  # an engine that forgot to make compute wait
        with remat.offload(min_bytes=0):
            y = model(x)
        with pytest.raises(RaceError, match="had not finished"):
            y.sum().backward()
        dev.drain()


def test_race_detector_catches_a_copy_of_memory_not_kept_for_its_stream():
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with simulated_device(0, progress=0.0) as dev:
        dev.skip_keep = True  # an engine that forgot record_stream on the source
        with remat.offload(min_bytes=0):
            y = lin(x).relu()
        with pytest.raises(RaceError, match="record_stream"):
            y.sum().backward()


def test_offloaded_device_tensor_is_freed_once_its_copy_out_ran():
    import weakref

    x = torch.randn(64, 64, requires_grad=True)
    for offload in (False, True):
        with simulated_device(0, progress=0.0) as dev:
            ctx = remat.offload(min_bytes=0) if offload else torch.enable_grad()
            with ctx:
                a = x.sin()  # saved by the next sin
                b = a.sin()
            alive = weakref.ref(a)
            del a
            dev.drain()  # the copies out have run
            assert (alive() is None) == offload
            b.sum().backward()
            assert torch.equal(x.grad, (x.sin().cos() * x.cos()).detach())
            x.grad = None


def test_shared_stash_releases_every_byte_after_backward():
    import remat.engine.offload as engine

    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    model, d = _ragged_mlp(3, layers=3)
    x = torch.randn(10, d, requires_grad=True)
    with simulated_device(3):
        remat.checkpoint(model, x, context_fn=ctx_fn).sum().backward()
        stash = engine.shared_stash()
        assert stash.count == 3 and stash.peak_bytes > 0
        assert stash.current_bytes == 0


def test_race_detector_catches_a_copy_out_that_does_not_wait_for_compute():
    model, d = _ragged_mlp(0, layers=2)
    x = torch.randn(16, d, requires_grad=True)
    with simulated_device(0, progress=0.0) as dev:
        dev.skip_ready_wait = True  # an engine that forgot the event on the compute stream
        with pytest.raises(RaceError, match="before the compute stream finished"):
            with remat.offload(min_bytes=0):
                y = model(x)
            y.sum().backward()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_offload_keeps_views_dtypes_and_empty_tensors_exact_on_async_device(seed):
    torch.manual_seed(seed)
    x = torch.randn(12, 20, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 20, (12, 5))

    def f(t):
        v = (t * 1.5).t()  # a non-contiguous view, saved by sin
        a = v.sin().t()
        g = a.gather(1, idx)  # saves an int64 index
        m = torch.where(g > 0, g, g * 0.1)  # saves a bool mask
        e = (t[:0] * 2).exp()  # a zero-size tensor, saved by exp
        s = t.sum().sigmoid()  # a 0-dim tensor, saved by sigmoid
        return m.sum() * s + e.sum()

    f(x).backward()
    ref = x.grad.clone()
    x.grad = None
    with simulated_device(seed):
        with remat.offload(min_bytes=0) as stats:
            y = f(x)
        y.backward()
    assert torch.equal(x.grad, ref)
    assert stats.current_bytes == 0 and stats.offloaded_tensors >= 5


def test_offload_context_backward_twice_with_retain_graph_on_async_device():
    model, x, ref = _with_reference(4, layers=3, rows=9)
    with simulated_device(4) as dev:
        with remat.offload(min_bytes=0) as stats:
            y = model(x).sum()
        y.backward(retain_graph=True)
        held = stats.current_bytes  # the retained graph still needs them
        first = param_grads(model, x)
        _zero(model, x)
        y.backward()
        del y
    for r, a, b in zip(ref, first, param_grads(model, x)):
        assert torch.equal(r, a) and torch.equal(r, b)
    assert held == stats.offloaded_bytes > 0 and stats.current_bytes == 0
    outs = sum(1 for k, _ in dev.copies if k == "out")
    assert sum(1 for k, _ in dev.copies if k == "back") == 2 * outs


def test_offload_around_checkpoint_on_async_device_moves_only_region_inputs():
    model, x, ref = _with_reference(5, layers=4, rows=7)
    with simulated_device(5) as dev:
        with remat.offload(min_bytes=0):
            h = x * 1.0
            y = remat.checkpoint(model, h)
        y.sum().backward()
    for r, g in zip(ref, param_grads(model, x)):
        assert torch.equal(r, g)
    assert [k for k, _ in dev.copies].count("out") == 1  # only the region's input


def test_device_without_streams_gets_blocking_copies_with_same_grads(monkeypatch):
    import remat.engine.offload as engine

    ops = engine._BlockingOps("mps")
    copies = []
    orig_copy = ops.copy
    monkeypatch.setattr(
        ops, "copy", lambda d, s, st: copies.append(s.nbytes) or orig_copy(d, s, st)
    )
    monkeypatch.setattr(engine, "_ops_for", lambda t: ops)
    model, x, ref = _with_reference(6, layers=3, rows=5)
    with remat.offload(min_bytes=0) as stats:
        y = model(x)
    y.sum().backward()
    for r, g in zip(ref, param_grads(model, x)):
        assert torch.equal(r, g)
    assert sum(copies) == 2 * stats.offloaded_bytes  # out and back, each once


def test_meta_tensors_are_kept_as_they_are():
    lin = torch.nn.Linear(8, 8, device="meta")
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    with remat.offload(min_bytes=0) as stats:
        y = lin(x).relu()
    y.sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"
    assert stats.offloaded_tensors == 2


def test_pinned_pool_size_classes_waste_at_most_an_eighth_above_4k():
    from remat.engine.offload import _PinnedPool

    size = _PinnedPool._size_class
    assert [size(n) for n in (0, 1, 3, 100, 4096)] == [2, 2, 4, 128, 4096]
    for n in [4097, 5000, 65535, 10**6, 123_456_789]:
        c = size(n)
        assert n <= c <= n * 1.125 + 1
        assert size(c) == c  # a class serves its own size


def _mm_then_add_(w):
    def f(x):
        t = x @ w  # offloaded by the policy
        t.add_(1)  # changed in place later in the region
        return t.sin()

    return f


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated-device"])
def test_offloaded_output_changed_in_place_later_in_the_region_gives_plain_grads(simulated):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    f = _mm_then_add_(w)
    f(x).sum().backward()
    ref = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )
    with simulated_device(0, progress=0.0) if simulated else contextlib.nullcontext():
        y = remat.checkpoint(f, x, context_fn=ctx_fn).sum()
        y.backward(retain_graph=True)
        first = [x.grad.clone(), w.grad.clone()]
        x.grad = w.grad = None
        y.backward()  # the recompute's add_ must not have changed what is served again
    for r, a, b in zip(ref, first, [x.grad, w.grad]):
        assert torch.equal(r, a) and torch.equal(r, b)


def test_offloaded_output_changed_after_the_region_raises_on_cpu_and_is_a_snapshot_on_device():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.offload_matmuls()
    )

    def region(t):
        m = t @ w  # offloaded; the recompute needs it for m * 3, which sin saved
        return (m * 3).sin(), m

    def step(ck):
        a, m = ck(region, x)
        m.mul_(2)  # the caller changes the region's output (the offloaded mm output)
        (a.sum() + m.sum()).backward()

    step(lambda f, t: f(t))
    ref = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    with pytest.raises(remat.CheckpointError, match="offloaded was modified in place after"):
        step(functools.partial(remat.checkpoint, context_fn=ctx_fn))  # CPU: kept as it is
    x.grad = w.grad = None
    with simulated_device(0, progress=0.0):
        # device: the region's end waited for the copy out, which holds the mm output
        step(functools.partial(remat.checkpoint, context_fn=ctx_fn))
    assert torch.equal(ref[0], x.grad) and torch.equal(ref[1], w.grad)
