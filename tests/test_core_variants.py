"""Reentrant variant, checkpoint_sequential, settings across threads, memory in bytes, properties."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from hypothesis import given, settings
from hypothesis import strategies as st

import remat

# ----------------------------------------------------------------------------- reentrant


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def test_reentrant_grads_equal_torch_reentrant_and_plain():
    model = mlp()
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for run in (
        lambda: model(x),
        lambda: tuc.checkpoint(model, x, use_reentrant=True),
        lambda: remat.checkpoint(model, x, use_reentrant=True),
    ):
        model.zero_grad()
        x.grad = None
        run().square().sum().backward()
        results.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for ref, got in zip(results[0], results[2]):
        assert torch.equal(ref, got)
    for ref, got in zip(results[1], results[2]):
        assert torch.equal(ref, got)


def test_reentrant_parameters_get_grads_when_no_input_requires_grad():
    model = mlp()
    x = torch.randn(4, 8)  # frozen input: torch's reentrant leaves the params without grad
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning):
        out = tuc.checkpoint(model, x, use_reentrant=True)
    assert not out.requires_grad  # torch: nothing to backward through
    out = remat.checkpoint(model, x, use_reentrant=True)
    out.sum().backward()
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(p.grad, r)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"context_fn": lambda: (None, None)}, "use_reentrant=False"),  # non-reentrant only
        ({"debug": True}, "use_reentrant=False"),
        ({"scale": 2}, "Unexpected keyword arguments: scale"),  # function kwargs
    ],
)
def test_reentrant_rejects_what_torch_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        remat.checkpoint(
            torch.sin, torch.randn(2, requires_grad=True), use_reentrant=True, **kwargs
        )


def test_reentrant_autograd_grad_is_rejected_with_clear_message():
    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(torch.sin, x, use_reentrant=True).sum()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        torch.autograd.grad(y, x)


def test_reentrant_dropout_rng_replayed():
    x = torch.randn(16, 8, requires_grad=True)

    def f(t):
        return F.dropout(t, 0.5, training=True).exp()

    torch.manual_seed(2)
    f(x).sum().backward()
    ref, ref_rng = x.grad.clone(), torch.get_rng_state()
    x.grad = None
    torch.manual_seed(2)
    remat.checkpoint(f, x, use_reentrant=True).sum().backward()
    assert torch.equal(x.grad, ref)
    assert torch.equal(torch.get_rng_state(), ref_rng)


def test_reentrant_recompute_sets_is_recomputing():
    seen = []

    def f(t):
        seen.append(remat.is_recomputing())
        return t.sin()

    remat.checkpoint(f, torch.randn(2, requires_grad=True), use_reentrant=True).sum().backward()
    assert seen == [False, True]
    assert not remat.is_recomputing()


# --------------------------------------------------------------------- checkpoint_sequential


def chain(n=6, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(n):
        layers += [torch.nn.Linear(8, 8), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("segments", [1, 2, 3, 5, 12])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_sequential_grads_equal_plain_and_torch(segments, use_reentrant):
    model = chain()
    x = torch.randn(4, 8, requires_grad=True)
    outs = []
    for run in (
        lambda: model(x),
        lambda: tuc.checkpoint_sequential(model, segments, x, use_reentrant=use_reentrant),
        lambda: remat.checkpoint_sequential(model, segments, x, use_reentrant=use_reentrant),
    ):
        model.zero_grad()
        x.grad = None
        run().sum().backward()
        outs.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for a, b, c in zip(*outs):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_checkpoint_sequential_accepts_a_list_of_callables():
    fns = [torch.sin, torch.cos, torch.exp]
    x = torch.randn(3, requires_grad=True)
    remat.checkpoint_sequential(fns, 2, x).sum().backward()
    ref = x.detach().requires_grad_()
    torch.exp(torch.cos(torch.sin(ref))).sum().backward()
    assert torch.equal(x.grad, ref.grad)


@pytest.mark.parametrize(
    "segments, error, match",
    [
        (0, ValueError, "between 1 and len"),  # torch: range() arg 3 must not be zero
        (13, ValueError, "between 1 and len"),  # more segments than functions
        (-1, ValueError, "between 1 and len"),
        (True, TypeError, "must be an int"),
        (2.0, TypeError, "must be an int"),
    ],
)
def test_checkpoint_sequential_validates_segments(segments, error, match):
    with pytest.raises(error, match=match):
        remat.checkpoint_sequential(chain(), segments, torch.randn(2, 8))


def test_checkpoint_sequential_rejects_unknown_options():
    with pytest.raises(ValueError, match="Unexpected keyword arguments: bogus"):
        remat.checkpoint_sequential(chain(), 2, torch.randn(2, 8), bogus=1)


def test_checkpoint_sequential_rejects_non_sequence():
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        remat.checkpoint_sequential(torch.nn.Linear(2, 2), 1, torch.randn(2, 2))


# -------------------------------------------------------------------- settings and threads


def test_settings_are_context_managers_that_restore():
    from remat import _config

    with remat.set_checkpoint_early_stop(False):
        assert _config._early_stop.get() is False
        with remat.set_checkpoint_early_stop(True):
            assert _config._early_stop.get() is True
        assert _config._early_stop.get() is False
    assert _config._early_stop.get() is None
    with pytest.raises(RuntimeError):
        with remat.set_checkpoint_debug_enabled(True):
            raise RuntimeError
    assert _config._debug.get() is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: remat.set_checkpoint_early_stop("yes"), "must be a bool"),
        (lambda: remat.set_checkpoint_debug_enabled(1), "True, False or None"),
    ],
)
def test_settings_reject_bad_values(call, match):
    with pytest.raises(TypeError, match=match):
        with call():
            pass


def test_two_threads_checkpointing_at_once_do_not_interfere():
    barrier = threading.Barrier(2)
    results: dict = {}

    def worker(name, early_stop):
        runs = []

        def f(x):
            y = x.sin()  # the only saved tensor; early stop ends the recompute here
            runs.append(remat.is_recomputing())
            if not remat.is_recomputing():
                barrier.wait(timeout=10)  # both threads inside a forward region at once
            return y * 2

        x = torch.randn(8, requires_grad=True)
        with remat.set_checkpoint_early_stop(early_stop):
            y = remat.checkpoint(f, x)
            barrier.wait(timeout=10)  # the other thread has its own, different setting
            y.sum().backward()
        results[name] = (torch.equal(x.grad, 2 * x.detach().cos()), remat.is_checkpointing(), runs)

    threads = [
        threading.Thread(target=worker, args=("stop", True)),
        threading.Thread(target=worker, args=("full", False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["stop"] == (True, False, [False])  # recompute stopped before `runs`
    assert results["full"] == (True, False, [False, True])  # recompute ran to the end


def test_settings_are_task_local_in_asyncio():
    async def task(flag, out):
        with remat.set_checkpoint_early_stop(flag):
            await asyncio.sleep(0.01)
            from remat import _config

            out.append((flag, _config._early_stop.get()))

    async def main():
        out: list = []
        await asyncio.gather(task(True, out), task(False, out))
        return out

    assert sorted(asyncio.run(main())) == [(False, False), (True, True)]


# -------------------------------------------------------------------------- memory in bytes


def saved_bytes_outside(run):
    """Bytes of distinct storages autograd saves, as seen by an outer hook."""
    storages: dict = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def test_checkpointed_region_keeps_only_its_inputs_in_bytes():
    model = chain(4)
    x = torch.randn(32, 8, requires_grad=True)
    h = x * 1.0  # a non-leaf input: 32*8*4 = 1024 bytes
    _, plain = saved_bytes_outside(lambda: model(h))
    out, ckpt = saved_bytes_outside(lambda: remat.checkpoint(model, h))
    # plain: each Linear saves its input (1024) and weight (256), each GELU its input (1024)
    assert plain == 4 * (1024 + 256 + 1024)
    assert ckpt == h.nbytes == 1024
    out.sum().backward()


def test_nested_region_keeps_only_the_outer_inputs():
    model = chain(4)
    x = torch.randn(32, 8, requires_grad=True)

    def outer(t):
        return remat.checkpoint(model, t * 2)  # inner input is an activation of outer

    out, kept = saved_bytes_outside(lambda: remat.checkpoint(outer, x))
    assert kept == x.nbytes
    out.sum().backward()


# ------------------------------------------------------------------------------ properties


LAYERS = ["linear", "tanh", "gelu", "dropout", "layernorm", "relu"]


def build(kinds, d, seed):
    torch.manual_seed(seed)
    mods = []
    for k in kinds:
        mods.append(
            {
                "linear": lambda: torch.nn.Linear(d, d),
                "tanh": torch.nn.Tanh,
                "gelu": torch.nn.GELU,
                "dropout": lambda: torch.nn.Dropout(0.3),
                "layernorm": lambda: torch.nn.LayerNorm(d),
                "relu": torch.nn.ReLU,
            }[k]()
        )
    return torch.nn.Sequential(*mods)


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=8),
    cuts=st.lists(st.booleans(), min_size=8, max_size=8),
    reentrant=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_sequential_random_segments_grads_equal(kinds, cuts, reentrant, seed):
    d = 6
    model = build(kinds, d, seed)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(seed), requires_grad=True)

    def run(ckpt):
        model.zero_grad()
        x.grad = None
        torch.manual_seed(seed)
        h = x
        start = 0
        for i in range(1, len(kinds) + 1):  # cut into segments where cuts[i-1] says so
            if i == len(kinds) or cuts[i - 1]:
                seg = model[start:i]
                h = remat.checkpoint(seg, h, use_reentrant=reentrant) if ckpt else seg(h)
                start = i
        h.square().sum().backward()
        return [x.grad.clone()] + [
            p.grad.clone() if p.grad is not None else None for p in model.parameters()
        ]

    for a, b in zip(run(False), run(True)):
        assert (a is None and b is None) or torch.equal(a, b)
