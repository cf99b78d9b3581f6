"""RNG, autocast and default-device replay in recompute (remat.engine.state); the global RNG state after backward.

Reference: the same code without checkpointing, from the same seed; results
bitwise equal. GPU variants carry the ``gpu`` marker and skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import remat
from tests.support.tensors import assert_all_equal, data

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VARIANTS = [
    False,  # non-reentrant
    True,  # reentrant
]


def weight(device: str = "cpu") -> torch.Tensor:
    return data(8, 8, seed=2, device=device)


def noisy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.dropout((x @ w).tanh(), p=0.5, training=True)
    return (h + 0.1 * torch.randn_like(h)) @ w  # a second random op


def step(call, x, w, seed):
    torch.manual_seed(seed)
    if x.is_cuda:
        torch.cuda.manual_seed(seed)
    x.grad = w.grad = None
    loss = call(noisy, x, w).square().sum()
    loss.backward()
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state() if x.is_cuda else None)
    return [loss.detach(), x.grad, w.grad], rng


def _plain(f, *a):
    return f(*a)


def run_rng_case(use_reentrant, device):
    x, w = data(4, 8, device=device), weight(device)
    ref, ref_rng = step(_plain, x, w, seed=123)
    got, rng = step(
        lambda f, *a: remat.checkpoint(f, *a, use_reentrant=use_reentrant), x, w, seed=123
    )
    tor, _ = step(lambda f, *a: tuc.checkpoint(f, *a, use_reentrant=use_reentrant), x, w, seed=123)
    assert_all_equal(ref, got)
    assert_all_equal(tor, got)
    assert torch.equal(rng[0], ref_rng[0])  # CPU generator: as if never checkpointed
    if device == "cuda":
        assert torch.equal(rng[1], ref_rng[1])


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_dropout_replayed_in_recompute_and_global_rng_matches_plain(use_reentrant):
    run_rng_case(use_reentrant, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_cuda_dropout_replayed_and_global_cuda_rng_matches_plain(use_reentrant):
    run_rng_case(use_reentrant, "cuda")


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_preserve_rng_state_false_draws_fresh_randomness_in_recompute(use_reentrant):
    x, w = data(4, 8), weight()
    ref, ref_rng = step(_plain, x, w, seed=5)
    got, rng = step(
        lambda f, *a: remat.checkpoint(
            f, *a, use_reentrant=use_reentrant, preserve_rng_state=False
        ),
        x,
        w,
        seed=5,
    )
    assert torch.equal(ref[0], got[0])  # the forward is the same
    assert not torch.equal(ref[2], got[2])  # the recompute drew another mask
    assert not torch.equal(rng[0], ref_rng[0])  # and advanced the global generator


def test_rng_state_restored_for_each_region_of_a_chain():
    x, w = data(4, 8), weight()

    def chain(f, x, w):
        h = x
        for _ in range(3):
            h = remat.checkpoint(f, h, w)
        return h

    def chain_plain(f, x, w):
        h = x
        for _ in range(3):
            h = f(h, w)
        return h

    ref, ref_rng = step(chain_plain, x, w, seed=9)
    got, rng = step(chain, x, w, seed=9)
    assert_all_equal(ref, got)
    assert torch.equal(rng[0], ref_rng[0])


# ----------------------------------------------------------------------- autocast


def mixed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (x @ w).relu()  # matmul runs in bf16 under autocast
    return (h @ w).float().tanh()


def autocast_step(call, backward_ctx):
    x, w = data(4, 8), weight()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(mixed, x, w)
    loss = out.square().sum()
    with backward_ctx():
        loss.backward()
    return [loss.detach(), x.grad, w.grad]


BACKWARD_CONTEXTS = [
    torch.enable_grad,  # backward outside any autocast region
    lambda: torch.autocast("cpu", dtype=torch.bfloat16),  # inside the same autocast
    lambda: torch.autocast("cpu", dtype=torch.float16),  # inside another autocast dtype
    lambda: torch.autocast("cpu", enabled=False),  # inside a disabled autocast
]


@pytest.mark.parametrize("backward_ctx", BACKWARD_CONTEXTS)
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_recompute_runs_under_the_forward_autocast_state(backward_ctx, use_reentrant):
    # backward kernels themselves run under the caller's autocast (CPU backward runs in
    # the calling thread), so the reference calls backward in the same context
    ref = autocast_step(lambda f, *a: f(*a), backward_ctx)
    got = autocast_step(
        lambda f, *a: (
            remat.checkpoint(f, *a, use_reentrant=use_reentrant, determinism_check="values")
            if not use_reentrant
            else remat.checkpoint(f, *a, use_reentrant=True)
        ),
        backward_ctx,
    )
    assert ref[1].dtype == torch.float32
    assert_all_equal(ref, got)


@pytest.mark.parametrize("backward_ctx", BACKWARD_CONTEXTS[1:])
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_fp32_forward_is_recomputed_in_fp32_inside_a_backward_autocast(backward_ctx, use_reentrant):
    x, w = data(4, 8), weight()
    y = mixed(x, w).sum()
    with backward_ctx():
        (ref,) = torch.autograd.grad(y, [w])
    out = remat.checkpoint(mixed, x, w, use_reentrant=use_reentrant)
    with backward_ctx():
        out.sum().backward()
    assert torch.equal(w.grad, ref)
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_state_inside_recompute_is_the_forward_one():
    seen = []

    def f(t):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return t.sin()

    x = data(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = remat.checkpoint(f, x)
    with torch.autocast("cpu", dtype=torch.float16):
        out.sum().backward()
    assert seen == [(True, torch.bfloat16), (True, torch.bfloat16)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_cuda_autocast_replayed_in_recompute(use_reentrant):
    x, w = data(4, 8, device="cuda"), weight("cuda")

    def run(call):
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = call(mixed, x, w)
        out.square().sum().backward()
        return [x.grad, w.grad]

    ref = run(lambda f, *a: f(*a))
    got = run(lambda f, *a: remat.checkpoint(f, *a, use_reentrant=use_reentrant))
    assert_all_equal(ref, got)


# ------------------------------------------------------------------ default device


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_recompute_replays_the_forward_default_device_context(use_reentrant):
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    def device_modes():
        modes = _get_current_function_mode_stack()
        return [m.device for m in modes if isinstance(m, DeviceContext)]

    seen = []

    def f(t):
        seen.append(device_modes())
        return t.sin() * torch.ones(3)

    x = data(3)
    with torch.device("cpu"):
        out = remat.checkpoint(f, x, use_reentrant=use_reentrant)
    out.sum().backward()  # outside the `with`: the recompute must see the forward's device
    assert seen == [[torch.device("cpu")], [torch.device("cpu")]]
    assert device_modes() == []  # and the context does not leak out of backward
    assert torch.equal(x.grad, x.detach().cos())
