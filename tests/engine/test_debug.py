"""determinism_check and debug (remat.engine.debug): recompute that does not reproduce the forward is caught.

A module-level flag toggled between forward and backward stands for global
state that changed (a config switch, a counter, a cache).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from tests.support.tensors import data

STATE = {"changed": False}


@pytest.fixture(autouse=True)
def _reset_state():
    STATE["changed"] = False
    yield
    STATE["changed"] = False


def shape_drift(x: torch.Tensor) -> torch.Tensor:
    h = x.exp()
    if STATE["changed"]:
        h = h[:, :2]  # a different shape in recompute
    return h.sin().sum(dim=1)


def value_drift(x: torch.Tensor) -> torch.Tensor:
    h = x * (3.0 if STATE["changed"] else 2.0)  # same shape, other values
    return h.sin().exp()


def count_drift(x: torch.Tensor) -> torch.Tensor:
    h = x.sin()
    if STATE["changed"]:
        h = h.cos()  # one more saved tensor in recompute
    return h.exp()


def dtype_drift(x: torch.Tensor) -> torch.Tensor:
    h = x.double() if STATE["changed"] else x
    return h.sin().float()


class ScaleBySum(torch.autograd.Function):
    """``x * aux.sum()``; saves ``aux`` but its backward only uses the sum."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.save_for_backward(aux)
        return x * aux.sum()

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g * aux.sum(), None


def harmless_shape_drift(x: torch.Tensor) -> torch.Tensor:
    aux = torch.eye(4 if STATE["changed"] else 3)[0]  # another shape, the same sum (1.0)
    return ScaleBySum.apply(x.sin(), aux)


def forward_then_change(fn, x, **kwargs):
    out = remat.checkpoint(fn, x, **kwargs)
    STATE["changed"] = True
    return out.sum()


@pytest.mark.parametrize(
    "fn, check, match",
    [
        (shape_drift, "default", "shape=\\(4, 3\\).*shape=\\(4, 2\\)"),  # shape
        (dtype_drift, "default", "torch.float32.*torch.float64"),  # dtype
        (shape_drift, "values", "shape"),  # "values" checks metadata too
        (value_drift, "values", "checksum"),  # only "values" sees this one
        (count_drift, "default", "forward: 2, recompute: 3|more tensors"),  # number of saves
        (count_drift, "none", "forward: 2, recompute: 3|more tensors"),  # ... always checked
        (harmless_shape_drift, "default", "shape=\\(3,\\).*shape=\\(4,\\)"),  # even if harmless
    ],
)
def test_mismatch_in_recompute_raises_checkpoint_error(fn, check, match):
    loss = forward_then_change(fn, data(4, 3), determinism_check=check, early_stop=False)
    with pytest.raises(remat.CheckpointError, match=match) as info:
        loss.backward()
    # torch-compatible: catchable as torch's CheckpointError and as remat's base error
    assert isinstance(info.value, tuc.CheckpointError)
    assert isinstance(info.value, remat.RematError)
    assert "debug=True" in str(info.value)  # says how to learn more
    assert not remat.is_checkpointing() and not remat.is_recomputing()


def test_torch_catches_the_shape_change_too():
    out = tuc.checkpoint(shape_drift, data(4, 3), use_reentrant=False)
    STATE["changed"] = True
    with pytest.raises(tuc.CheckpointError):
        out.sum().backward()


def test_values_catches_what_shapes_cannot_and_torch_gives_a_wrong_gradient():
    x = data(4, 3)
    ref = torch.autograd.grad(value_drift(x).sum(), x)[0]
    # "default" and torch: silently wrong gradient
    for out in (
        remat.checkpoint(value_drift, x),
        tuc.checkpoint(value_drift, x, use_reentrant=False),
    ):
        STATE["changed"] = True
        (g,) = torch.autograd.grad(out.sum(), x)
        assert not torch.equal(g, ref)
        STATE["changed"] = False
    loss = forward_then_change(value_drift, x, determinism_check="values")
    with pytest.raises(remat.CheckpointError, match="values"):
        loss.backward()


@pytest.mark.parametrize("fn", [shape_drift, dtype_drift, value_drift, harmless_shape_drift])
def test_determinism_check_none_skips_the_comparison(fn):
    x = data(4, 3)
    loss = forward_then_change(fn, x, determinism_check="none")
    if fn is shape_drift:
        # autograd itself notices the shape when it uses the tensor; not remat's check
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        assert not isinstance(info.value, remat.CheckpointError)
    else:
        loss.backward()
    if fn is harmless_shape_drift:  # "default" refuses it; "none" gives the plain gradient
        STATE["changed"] = False
        assert torch.equal(x.grad, torch.autograd.grad(fn(x).sum(), x)[0])


@pytest.mark.parametrize("check", ["default", "values", "none"])
def test_determinism_check_passes_when_recompute_matches(check):
    x = data(4, 3)
    ref = torch.autograd.grad(value_drift(x).sum(), x)[0]
    (g,) = torch.autograd.grad(remat.checkpoint(value_drift, x, determinism_check=check).sum(), x)
    assert torch.equal(g, ref)


@pytest.mark.parametrize(
    "value",
    [
        "Default",  # case matters, as in torch
        "shapes",  # not a mode
        None,  # not a string
    ],
)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_invalid_determinism_check_raises_value_error(value, use_reentrant):
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        remat.checkpoint(torch.sin, data(2), determinism_check=value, use_reentrant=use_reentrant)


# -------------------------------------------------------------------------- debug


def debug_message(fn, **kwargs) -> str:
    loss = forward_then_change(fn, data(4, 3), early_stop=False, **kwargs)
    with pytest.raises(remat.CheckpointError) as info:
        loss.backward()
    return str(info.value)


def test_debug_lists_forward_and_recompute_ops_with_first_divergence_and_source_line():
    text = debug_message(count_drift, debug=True)
    lines = text.splitlines()
    assert any("forward" in line and "recompute" in line for line in lines)
    marked = [line for line in lines if line.startswith(">>")]
    assert len(marked) == 1
    # forward: sin, exp; recompute: sin, cos, exp -> first divergence at #1
    assert "exp (" in marked[0] and "cos (" in marked[0]
    assert "test_debug.py:" in marked[0]
    assert "in count_drift" in marked[0]
    assert "First divergence at operator #1" in text


def test_debug_with_same_ops_says_the_values_differ():
    text = debug_message(value_drift, debug=True, determinism_check="values")
    assert "checksum" in text and ">>" not in text
    assert "The operator sequences are the same" in text


@pytest.mark.parametrize(
    "setting, call_debug, listed",
    [
        (True, False, True),  # the setting turns debug on
        (False, True, False),  # ... and off
        (None, True, True),  # None leaves it to the call
        (None, False, False),
    ],
)
def test_set_checkpoint_debug_enabled_overrides_the_call(setting, call_debug, listed):
    with remat.set_checkpoint_debug_enabled(setting):
        loss = forward_then_change(count_drift, data(4, 3), debug=call_debug, early_stop=False)
    with pytest.raises(remat.CheckpointError) as info:
        loss.backward()
    assert ("Operators run in forward and in recompute" in str(info.value)) is listed
    assert (">>" in str(info.value)) is listed


def test_debug_costs_no_correctness():
    x = data(4, 3)
    ref = torch.autograd.grad(count_drift(x).sum(), x)[0]
    (g,) = torch.autograd.grad(remat.checkpoint(count_drift, x, debug=True).sum(), x)
    assert torch.equal(g, ref)
