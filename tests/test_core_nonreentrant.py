"""remat.checkpoint, non-reentrant: gradients, graph features and recompute behaviour.

Every case compares with the same code run without checkpointing (bitwise on CPU)
and, where torch has the feature, with torch.utils.checkpoint on the same input.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import remat


def params(seed=0, n=3, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, d, generator=g).requires_grad_() for _ in range(n)]


def body(x, ws):
    for w in ws:
        x = torch.tanh(x @ w).exp() * 0.5
    return x


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda f, *a: f(*a),  # plain: the reference itself
        lambda f, *a: remat.checkpoint(f, *a),  # remat default
        lambda f, *a: remat.checkpoint(f, *a, early_stop=False),  # run the whole function
        lambda f, *a: remat.checkpoint(f, *a, use_reentrant=None),  # None means False here
        lambda f, *a: remat.checkpoint(f, *a, determinism_check="values"),
        lambda f, *a: remat.checkpoint(f, *a, determinism_check="none"),
        lambda f, *a: remat.checkpoint(f, *a, debug=True),
    ],
)
def test_checkpointed_grads_equal_uncheckpointed_bitwise(wrap):
    ws = params()
    x = torch.randn(4, 8, requires_grad=True)
    ref = grads(body(x, ws).sum(), [x, *ws])
    got = grads(wrap(body, x, ws).sum(), [x, *ws])
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_grads_equal_torch_non_reentrant_checkpoint():
    ws = params()
    x = torch.randn(4, 8, requires_grad=True)
    ref = grads(tuc.checkpoint(body, x, ws, use_reentrant=False).sum(), [x, *ws])
    got = grads(remat.checkpoint(body, x, ws).sum(), [x, *ws])
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_default_variant_does_not_warn():
    x = torch.randn(3, requires_grad=True)
    remat.checkpoint(torch.sin, x).sum().backward()  # filterwarnings=error would fail a warning


def nested(x, ws, depth):
    if depth == 0:
        return body(x, ws)
    return remat.checkpoint(lambda t: nested(t, ws, depth - 1).cos() + t, x)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_nested_checkpoints_give_uncheckpointed_grads(depth):
    ws = params()
    x = torch.randn(4, 8, requires_grad=True)

    def plain(x, d):
        if d == 0:
            return body(x, ws)
        return plain(x, d - 1).cos() + x

    ref = grads(plain(x, depth).sum(), [x, *ws])
    got = grads(nested(x, ws, depth).sum(), [x, *ws])
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_backward_with_inputs_argument():
    ws = params()
    x = torch.randn(4, 8, requires_grad=True)
    body(x, ws).sum().backward(inputs=[ws[1]])
    ref = ws[1].grad.clone()
    ws[1].grad = None
    remat.checkpoint(body, x, ws).sum().backward(inputs=[ws[1]])
    assert torch.equal(ws[1].grad, ref)
    assert x.grad is None and ws[0].grad is None


def test_retain_graph_second_backward_recomputes_again():
    calls = []

    def f(x, ws):
        calls.append(remat.is_recomputing())
        return body(x, ws)

    ws = params()
    x = torch.randn(4, 8, requires_grad=True)
    ref = grads(body(x, ws).sum(), [x, *ws])
    y = remat.checkpoint(f, x, ws).sum()
    first = torch.autograd.grad(y, [x, *ws], retain_graph=True)
    second = torch.autograd.grad(y, [x, *ws])
    assert calls == [False, True, True]  # forward, then one recompute per backward
    for r, a, b in zip(ref, first, second):
        assert torch.equal(r, a) and torch.equal(r, b)


def test_double_backward_gradient_penalty():
    ws = params()

    def penalty(run):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = run(x).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        loss = out + gx.square().sum()
        return grads(loss, ws)

    ref = penalty(lambda x: body(x, ws))
    got = penalty(lambda x: remat.checkpoint(body, x, ws))
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, rtol=0, atol=0)


@dataclasses.dataclass
class Batch:
    h: torch.Tensor
    scale: float
    extra: dict


def test_tensors_nested_in_lists_dicts_dataclasses_and_kwargs():
    ws = params()
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 8, requires_grad=True)

    def f(pair, batch, *, bias, name):
        assert name == "blk"
        a, b = pair
        return body(a + batch.h * batch.scale + batch.extra["z"], ws) * b + bias["t"]

    def run(wrap):
        bias = {"t": y * 2}
        batch = Batch(h=y.sin(), scale=0.5, extra={"z": x.cos()})
        out = wrap(f, [x, y], batch, bias=bias, name="blk")
        return grads(out.sum(), [x, y, *ws])

    ref = run(lambda f, *a, **k: f(*a, **k))
    got = run(lambda f, *a, **k: remat.checkpoint(f, *a, **k))
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_non_tensor_inputs_and_outputs_and_outputs_without_grad():
    x = torch.randn(5, requires_grad=True)

    def f(t, mode, k):
        return {"y": t.sin() * k, "idx": t.argmax(), "mode": mode, "none": None}

    out = remat.checkpoint(f, x, "train", 3)
    assert out["mode"] == "train" and out["none"] is None
    assert not out["idx"].requires_grad
    out["y"].sum().backward()
    assert torch.equal(x.grad, x.detach().cos() * 3)


def test_frozen_inputs_still_give_parameter_grads():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)  # does not require grad (frozen embedding output)
    lin(x).tanh().sum().backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    remat.checkpoint(lambda t: lin(t).tanh(), x).sum().backward()
    for p, r in zip(lin.parameters(), ref):
        assert torch.equal(p.grad, r)


def test_inplace_change_of_an_input_after_forward_raises_not_wrong_grad():
    x = torch.randn(4, requires_grad=True)
    h = x * 1.0
    y = remat.checkpoint(torch.sin, h)
    h.add_(1.0)  # would silently change the recompute
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_no_grad_and_inference_mode_just_call_the_function():
    calls = []

    def f(t):
        calls.append(remat.is_checkpointing())
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert remat.checkpoint(f, x).grad_fn is None
    with torch.inference_mode():
        assert remat.checkpoint(f, x).grad_fn is None
    assert calls == [False, False]


def test_disable_checkpointing_runs_plain():
    x = torch.randn(3, requires_grad=True)
    with remat.disable_checkpointing():
        y = remat.checkpoint(torch.sin, x)
    assert y.grad_fn.name() == "SinBackward0"


class Counter:
    def __init__(self):
        self.n = 0

    def __call__(self, x):
        self.n += 1
        return x


def test_early_stop_skips_the_rest_of_the_function():
    after = Counter()

    def f(x):
        y = x.sin()  # the only saved tensor: x
        after(y)
        return y * 2  # saves nothing (scalar)

    x = torch.randn(4, requires_grad=True)
    remat.checkpoint(f, x).sum().backward()
    assert after.n == 1  # recompute stopped right after sin saved x
    after.n = 0
    remat.checkpoint(f, x, early_stop=False).sum().backward()
    assert after.n == 2
    after.n = 0
    with remat.set_checkpoint_early_stop(False):
        remat.checkpoint(f, x).sum().backward()
    assert after.n == 2


def test_one_recompute_per_backward_per_region():
    counts = []

    def f(x):
        counts.append(1)
        return x.sin().cos()

    x = torch.randn(4, requires_grad=True)
    h = x
    for _ in range(3):
        h = remat.checkpoint(f, h)
    h.sum().backward()
    assert len(counts) == 6  # 3 forwards, 3 recomputes


def test_recomputed_tensors_are_freed_after_use_even_with_retain_graph():
    kept = []

    def f(x):
        a = x.exp()  # exp saves its output
        kept.append(weakref.ref(a))
        b = a.sin()  # sin saves a
        return b.tanh()  # tanh saves its output

    x = torch.randn(16, requires_grad=True)
    y = remat.checkpoint(f, x).sum()
    y.backward(retain_graph=True)
    gc.collect()
    # kept[0]: forward's `a` (dropped after forward), kept[1]: recompute's `a`
    assert len(kept) == 2
    assert kept[0]() is None and kept[1]() is None
    y.backward()
    gc.collect()
    assert all(r() is None for r in kept)


def test_is_checkpointing_and_is_recomputing_flags():
    seen = []

    def f(x):
        seen.append((remat.is_checkpointing(), remat.is_recomputing()))
        return x.sin()

    x = torch.randn(2, requires_grad=True)
    remat.checkpoint(f, x).sum().backward()
    assert seen == [(True, False), (True, True)]
    assert not remat.is_checkpointing() and not remat.is_recomputing()


def test_exception_in_function_restores_state():
    rng = torch.get_rng_state()

    def bad(x):
        torch.rand(3)
        raise ValueError("inside")

    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="inside"):
        remat.checkpoint(bad, x)
    assert not remat.is_checkpointing()
    # saved-tensor hooks popped: a plain op saves normally again
    y = x.exp()
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())
    assert not torch.equal(rng, torch.get_rng_state())  # the forward's own rand ran, as plain


def test_exception_in_recompute_restores_state():
    flag = {"fail": False}

    def f(x):
        if flag["fail"]:
            raise KeyError("recompute")
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(f, x)
    flag["fail"] = True
    rng = torch.get_rng_state()
    with pytest.raises(KeyError):
        y.sum().backward()
    assert torch.equal(rng, torch.get_rng_state())
    assert not remat.is_recomputing() and not remat.is_checkpointing()
    assert torch.is_grad_enabled()


def test_determinism_check_default_catches_shape_change():
    state = {"n": 4}

    def f(x):
        return x[: state["n"]].sin()

    x = torch.randn(6, requires_grad=True)
    y = remat.checkpoint(f, x)
    state["n"] = 3
    with pytest.raises(remat.CheckpointError, match="shape"):
        y.sum().backward()


def test_determinism_check_values_catches_value_drift_shapes_cannot():
    state = {"k": 1.0}

    def f(x):
        return (x * state["k"]).sin()

    x = torch.randn(6, requires_grad=True)
    y = remat.checkpoint(f, x)
    state["k"] = 2.0
    y.sum().backward()  # default check: same shapes, silently different: torch does the same
    x.grad = None
    state["k"] = 1.0
    y = remat.checkpoint(f, x, determinism_check="values")
    state["k"] = 2.0
    with pytest.raises(remat.CheckpointError, match="checksum"):
        y.sum().backward()


class ScaleBySum(torch.autograd.Function):
    """Saves ``aux`` but only uses its sum: a shape change of aux is harmless."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.save_for_backward(aux)
        return x * aux.sum()

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g * aux.sum(), None


@pytest.mark.parametrize("check, raises", [("default", True), ("none", False)])
def test_determinism_check_none_skips_the_metadata_comparison(check, raises):
    state = {"n": 4}

    def f(x):
        return ScaleBySum.apply(x, torch.ones(state["n"]))

    x = torch.randn(6, requires_grad=True)
    y = remat.checkpoint(f, x, determinism_check=check)
    state["n"] = 3
    if raises:
        with pytest.raises(remat.CheckpointError, match="shape"):
            y.sum().backward()
    else:
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((6,), 3.0))


def test_unknown_determinism_check_is_rejected():
    with pytest.raises(ValueError, match="determinism_check"):
        remat.checkpoint(torch.sin, torch.randn(2, requires_grad=True), determinism_check="exact")


def test_debug_error_lists_ops_side_by_side_with_first_divergence():
    state = {"extra": False}

    def f(x):
        if state["extra"]:
            x = x[:3] * 2  # extra ops, then sin saves a tensor of another shape
        return x.sin().cos()

    x = torch.randn(5, requires_grad=True)
    y = remat.checkpoint(f, x, debug=True)
    state["extra"] = True
    with pytest.raises(remat.CheckpointError) as err:
        y.sum().backward()
    msg = str(err.value)
    assert ">>    0  sin" in msg and "slice" in msg and "mul" in msg
    assert "test_core_nonreentrant.py" in msg  # the user's source line


def test_set_checkpoint_debug_enabled_overrides_call():
    state = {"n": 4}

    def f(x):
        return x[: state["n"]].sin()

    x = torch.randn(6, requires_grad=True)
    with remat.set_checkpoint_debug_enabled(True):
        y = remat.checkpoint(f, x, debug=False)
    state["n"] = 3
    with pytest.raises(remat.CheckpointError, match="Operators run in forward"):
        y.sum().backward()


def test_dropout_rng_is_replayed_and_global_rng_after_backward_matches():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def f(t):
        return F.dropout(lin(t), 0.5, training=True).relu()

    torch.manual_seed(5)
    f(x).sum().backward()
    ref = (x.grad.clone(), torch.get_rng_state())
    x.grad = None
    torch.manual_seed(5)
    remat.checkpoint(f, x).sum().backward()
    assert torch.equal(x.grad, ref[0])
    assert torch.equal(torch.get_rng_state(), ref[1])


def test_preserve_rng_state_false_does_not_replay():
    x = torch.ones(64, requires_grad=True)

    def f(t):
        return F.dropout(t, 0.5, training=True)

    torch.manual_seed(0)
    y = remat.checkpoint(f, x, preserve_rng_state=False, determinism_check="none")
    mask_fwd = y.detach() != 0
    y.sum().backward()
    # Backward re-drew the mask from the current RNG: it differs from the forward's
    # (what torch does too); with the default it would be the same.
    assert not torch.equal(x.grad != 0, mask_fwd)
    x.grad = None
    torch.manual_seed(0)
    y = remat.checkpoint(f, x)
    y.sum().backward()
    assert torch.equal(x.grad != 0, y.detach() != 0)


def test_autocast_state_is_replayed_in_recompute():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def f(t):
        return lin(t).relu()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = f(x)
    ref_out.float().sum().backward()
    ref = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = remat.checkpoint(f, x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()  # backward outside autocast: recompute still runs in bf16
    assert torch.equal(x.grad, ref)


def test_backward_inside_autocast_does_not_change_an_fp32_recompute():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    y = lin(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same backward, unchecked
        y.sum().backward()
    ref = x.grad.clone()
    x.grad = None
    y = remat.checkpoint(lin, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.sum().backward()
    assert torch.equal(x.grad, ref)
    assert x.grad.dtype == torch.float32


def test_unpacking_twice_in_one_backward_raises_clear_error():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            (b,) = ctx.saved_tensors
            return g * 2

    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(lambda t: Twice.apply(t.sin()), x)
    with pytest.raises(remat.CheckpointError, match="unpacked twice"):
        y.sum().backward()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_default_device_context_is_replayed_in_recompute(use_reentrant):
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    seen = []

    def f(x):
        modes = _get_current_function_mode_stack()
        seen.append([m.device for m in modes if isinstance(m, DeviceContext)])
        return x.sin() * torch.ones(3)

    x = torch.randn(3, requires_grad=True)
    with torch.device("cpu"):
        y = remat.checkpoint(f, x, use_reentrant=use_reentrant)
    y.sum().backward()  # outside the `with`: recompute must see the forward's device
    assert seen == [[torch.device("cpu")], [torch.device("cpu")]]
    assert not any(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())
