"""remat.checkpoint(use_reentrant=True): torch's reentrant semantics and errors, one fix.

Gradients are compared bitwise with the plain call and with
``torch.utils.checkpoint.checkpoint(use_reentrant=True)``; the errors torch
raises are raised with the same type. The fix: parameters inside the region get
gradients even when no input requires grad (torch leaves them ``None``).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from tests.support.tensors import assert_all_equal, data


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))


def run_and_grads(model, x, call, *extra):
    model.zero_grad(set_to_none=True)
    x.grad = None
    loss = call(model, x, *extra).square().sum()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]


def scaled(model, x, s):
    return model(x) * s


@pytest.mark.parametrize(
    "fn, extra",
    [
        (lambda m, x: m(x), ()),  # a module on one tensor
        (scaled, (0.5,)),  # a non-tensor positional argument
        (lambda m, x, y: m(x) + y.exp(), (data(3, 6, seed=4),)),  # two tensor inputs
    ],
)
def test_reentrant_grads_equal_plain_and_torch_reentrant(fn, extra):
    model = mlp()
    x = data(3, 6)

    def ours(m, t, *e):
        return remat.checkpoint(lambda *a: fn(m, *a), t, *e, use_reentrant=True)

    def theirs(m, t, *e):
        return tuc.checkpoint(lambda *a: fn(m, *a), t, *e, use_reentrant=True)

    ref = run_and_grads(model, x, fn, *extra)
    got = run_and_grads(model, x, ours, *extra)
    tor = run_and_grads(model, x, theirs, *extra)
    assert_all_equal(ref, got)
    assert_all_equal(tor, got)


def test_reentrant_recomputes_once_per_backward():
    calls = []
    model = mlp()

    def f(t):
        calls.append(remat.is_recomputing())
        return model(t)

    x = data(3, 6)
    loss = remat.checkpoint(f, x, use_reentrant=True).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert calls == [False, True, True]


def test_reentrant_parameters_get_grads_when_no_input_requires_grad():
    model = mlp()
    x = data(3, 6, grad=False)  # frozen input, as with a frozen embedding or LoRA
    ref = run_and_grads(model, x, lambda m, t: m(t))
    # torch: outputs do not require grad, parameters silently get no gradient
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = tuc.checkpoint(model, x, use_reentrant=True)
    assert not out.requires_grad
    got = run_and_grads(model, x, lambda m, t: remat.checkpoint(m, t, use_reentrant=True))
    assert all(g is not None for g in got[2:])
    assert_all_equal(ref, got)


def test_reentrant_with_nothing_requiring_grad_backward_is_harmless():
    x = data(4, grad=False)
    out = remat.checkpoint(torch.sin, x, use_reentrant=True)
    assert torch.equal(out, x.sin())
    out.sum().backward()  # the hidden anchor takes the gradient; nothing else happens
    assert x.grad is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": 2.0}, "Unexpected keyword arguments: scale"),  # a kwarg of the function
        ({"context_fn": lambda: (None, None)}, "use_reentrant=False"),  # non-reentrant only
        ({"debug": True}, "use_reentrant=False"),  # non-reentrant only
    ],
)
def test_reentrant_rejects_what_torch_rejects_with_value_error(kwargs, match):
    x = data(3)
    with pytest.raises(ValueError):
        tuc.checkpoint(torch.sin, x, use_reentrant=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        remat.checkpoint(torch.sin, x, use_reentrant=True, **kwargs)


@pytest.mark.parametrize(
    "backward",
    [
        lambda y, x: torch.autograd.grad(y, x),  # .grad()
        lambda y, x: y.backward(inputs=[x]),  # backward(inputs=...)
    ],
)
def test_reentrant_rejects_autograd_grad_and_backward_inputs_with_clear_message(backward):
    x = data(3)
    with pytest.raises(RuntimeError, match="incompatible with .grad()"):
        backward(tuc.checkpoint(torch.sin, x, use_reentrant=True).sum(), x)
    with pytest.raises(RuntimeError, match=r"use_reentrant=False.*backward\(\)"):
        backward(remat.checkpoint(torch.sin, x, use_reentrant=True).sum(), x)
    assert not remat.is_checkpointing() and not remat.is_recomputing()


def test_reentrant_dropout_rng_replayed_and_global_rng_matches_plain():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5))
    x = data(3, 6)
    torch.manual_seed(11)
    ref = run_and_grads(model, x, lambda m, t: m(t))
    ref_rng = torch.get_rng_state()
    torch.manual_seed(11)
    got = run_and_grads(model, x, lambda m, t: remat.checkpoint(m, t, use_reentrant=True))
    assert torch.equal(torch.get_rng_state(), ref_rng)
    assert_all_equal(ref, got)


def test_reentrant_exception_in_recompute_restores_state():
    flag = {"fail": False}

    def f(t):
        torch.rand(2)
        if flag["fail"]:
            raise KeyError("recompute")
        return t.exp()

    x = data(3)
    out = remat.checkpoint(f, x, use_reentrant=True)
    flag["fail"] = True
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    with pytest.raises(KeyError):
        out.sum().backward()
    assert torch.equal(torch.get_rng_state(), rng)
    assert not remat.is_checkpointing() and not remat.is_recomputing()
    assert torch.is_grad_enabled()


def test_reentrant_under_no_grad_just_calls_the_function():
    seen = []

    def f(t):
        seen.append(remat.is_checkpointing())
        return t.sin()

    x = data(3)
    with torch.no_grad():
        out = remat.checkpoint(f, x, use_reentrant=True)
    assert seen == [False] and out.grad_fn is None


def test_reentrant_accepts_torch_noop_context_fn_passed_explicitly():
    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(torch.sin, x, use_reentrant=True, context_fn=tuc.noop_context_fn)
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
