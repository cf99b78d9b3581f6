"""remat.checkpoint, the non-reentrant variant (remat.engine.nonreentrant): gradients, graph features, recompute counts.

Every case runs the same code without checkpointing and compares the loss and
every gradient bitwise (``torch.equal``; CPU kernels are deterministic), and,
where torch has the feature, with ``torch.utils.checkpoint.checkpoint`` on the
same input.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from tests.support.tensors import assert_all_equal, data


def plain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def ours(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return remat.checkpoint(fn, *args, **kwargs)


def theirs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return tuc.checkpoint(fn, *args, use_reentrant=False, **kwargs)


RUNNERS = [plain, ours, theirs]


def weights(n: int = 3, d: int = 6, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(d, d, generator=g) / d**0.5).requires_grad_() for _ in range(n)]


def body(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for w in ws:
        x = torch.tanh(x @ w).exp() * 0.5
    return x


def losses_and_grads(run, fn, args, leaves, **kwargs):
    loss = run(fn, *args, **kwargs).square().sum()
    return [loss.detach(), *torch.autograd.grad(loss, leaves, allow_unused=True)]


# --------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "options",
    [
        {},  # defaults: early stop, "default" check
        {"early_stop": False},  # the whole function runs in recompute
        {"determinism_check": "values"},  # checksums computed and compared
        {"determinism_check": "none"},  # nothing compared
        {"debug": True},  # op logs recorded in forward and recompute
        {"preserve_rng_state": False},  # no random op inside: same result
        {"use_reentrant": None},  # None selects the non-reentrant variant in remat
    ],
)
def test_checkpointed_grads_equal_uncheckpointed(options):
    ws = weights()
    x = data(4, 6)
    ref = losses_and_grads(plain, body, (x, ws), [x, *ws])
    got = losses_and_grads(ours, body, (x, ws), [x, *ws], **options)
    assert_all_equal(ref, got)


def test_checkpointed_grads_equal_torch_checkpoint():
    ws = weights()
    x = data(4, 6)
    ref = losses_and_grads(theirs, body, (x, ws), [x, *ws])
    got = losses_and_grads(ours, body, (x, ws), [x, *ws])
    assert_all_equal(ref, got)


def test_default_variant_does_not_warn():
    # filterwarnings=error turns any warning into a failure; torch warns without use_reentrant
    x = data(3)
    remat.checkpoint(torch.sin, x).sum().backward()
    with pytest.warns(UserWarning, match="use_reentrant"):
        tuc.checkpoint(torch.sin, x)


def test_module_and_output_structure_preserved():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    x = data(2, 6)

    def f(t):
        y = lin(t)
        return {"y": y, "pair": (y.sin(), 3), "name": "out"}

    out = remat.checkpoint(f, x)
    assert set(out) == {"y", "pair", "name"}
    assert out["pair"][1] == 3 and out["name"] == "out"
    assert torch.equal(out["y"], lin(x))


# ----------------------------------------------------------------------- nesting


def nested_fn(
    ck: Callable[..., Any], depth: int, counts: list[int], w: torch.Tensor, level: int = 0
) -> Callable[[torch.Tensor], Any]:
    """A function whose body checkpoints the next level with ``ck``; counts calls per level.

    ``w`` is a parameter every level reads from its closure (not a region input), and
    each level uses its own input again after the inner region.
    """

    def f(x: torch.Tensor) -> torch.Tensor:
        counts[level] += 1
        h = (x * w).sin()
        if level + 1 < depth:
            h = ck(nested_fn(ck, depth, counts, w, level + 1), h)
        return (h.exp() + x).cos()

    return f


@pytest.mark.parametrize("depth", [2, 3])  # checkpoint inside checkpoint (inside checkpoint)
@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoints_give_uncheckpointed_grads_and_torch_recompute_counts(depth, early_stop):
    x, w = data(5), data(5, seed=2)
    results = {}
    for runner in RUNNERS:
        counts = [0] * depth
        kwargs = {} if runner is plain else {"early_stop": early_stop}

        def ck(fn, *a, runner=runner, kwargs=kwargs):
            return runner(fn, *a, **kwargs)

        grads = losses_and_grads(ck, nested_fn(ck, depth, counts, w), (x,), [x, w])
        results[runner.__name__] = (grads, counts)
    assert_all_equal(results["plain"][0], results["ours"][0])
    assert_all_equal(results["theirs"][0], results["ours"][0])
    assert results["plain"][1] == [1] * depth
    # Each level runs once in forward, once in its own recompute and once more in the
    # recompute of every enclosing region (which re-runs its body, inner checkpoint included).
    assert results["ours"][1] == [2 + level for level in range(depth)]
    assert results["ours"][1] == results["theirs"][1]


# --------------------------------------------------------------- recompute counts


class Counted:
    """sin, then (after the last op that saves a tensor) a scalar add; counts both."""

    def __init__(self) -> None:
        self.start = 0
        self.after_last_save = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.start += 1
        y = x.sin()  # saves x: the region's last saved tensor
        self.after_last_save += 1
        return y + 1.0  # add of a scalar saves nothing


@pytest.mark.parametrize(
    "early_stop, after_last_save",
    [
        (True, 1),  # recompute stops at the last saved tensor: only the forward got there
        (False, 2),  # the whole function is re-run
    ],
)
def test_early_stop_skips_ops_after_the_last_saved_tensor(early_stop, after_last_save):
    f = Counted()
    x = data(4)
    remat.checkpoint(f, x, early_stop=early_stop).sum().backward()
    assert (f.start, f.after_last_save) == (2, after_last_save)
    assert torch.equal(x.grad, x.detach().cos())


def test_torch_early_stop_counts_agree():
    for early_stop in (True, False):
        a, b = Counted(), Counted()
        x = data(4)
        remat.checkpoint(a, x, early_stop=early_stop).sum().backward()
        tuc.checkpoint(b, x, use_reentrant=False, early_stop=early_stop).sum().backward()
        assert (a.start, a.after_last_save) == (b.start, b.after_last_save)


def test_recompute_runs_once_per_backward_per_region():
    fs = [Counted() for _ in range(3)]
    x = data(4)
    h = x
    for f in fs:
        h = remat.checkpoint(lambda t, f=f: f(t).exp(), h)  # exp saves its output too
    loss = h.sum()
    assert [f.start for f in fs] == [1, 1, 1]
    loss.backward(retain_graph=True)
    assert [f.start for f in fs] == [2, 2, 2]
    loss.backward()  # a second backward is a new graph task: recomputes once more
    assert [f.start for f in fs] == [3, 3, 3]


# ------------------------------------------------------- autograd entry points


def test_autograd_grad_gives_uncheckpointed_grads_and_leaves_dot_grad_alone():
    ws = weights()
    x = data(4, 6)
    ref = torch.autograd.grad(body(x, ws).sum(), [x, ws[1]])
    got = torch.autograd.grad(remat.checkpoint(body, x, ws).sum(), [x, ws[1]])
    tor = torch.autograd.grad(theirs(body, x, ws).sum(), [x, ws[1]])
    assert_all_equal(list(ref), list(got))
    assert_all_equal(list(tor), list(got))
    assert x.grad is None and all(w.grad is None for w in ws)


def test_backward_with_inputs_fills_only_those_grads():
    ws = weights()
    x = data(4, 6)
    body(x, ws).sum().backward(inputs=[ws[0], x])
    ref = [x.grad, ws[0].grad]
    x.grad = ws[0].grad = None
    remat.checkpoint(body, x, ws).sum().backward(inputs=[ws[0], x])
    assert_all_equal(ref, [x.grad, ws[0].grad])
    assert ws[1].grad is None and ws[2].grad is None


def test_retain_graph_second_backward_recomputes_and_accumulates_like_plain():
    f = Counted()
    ws = weights()
    x = data(4, 6)

    def g(t):
        return body(f(t), ws)

    ref_loss = g(x).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    ref = [x.grad.clone()] + [w.grad.clone() for w in ws]
    for t in [x, *ws]:
        t.grad = None
    f.start = 0
    loss = remat.checkpoint(g, x).sum()
    loss.backward(retain_graph=True)
    assert f.start == 2
    loss.backward()
    assert f.start == 3
    assert_all_equal(ref, [x.grad] + [w.grad for w in ws])


def gradient_penalty(run, fn, x, ws):
    out = run(fn, x, ws)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = gx.square().sum()
    return [penalty.detach(), *torch.autograd.grad(penalty, [x, *ws])]


def test_double_backward_gradient_penalty_equals_plain_and_torch():
    ws = weights()
    x = data(4, 6)
    ref = gradient_penalty(plain, body, x, ws)
    got = gradient_penalty(ours, body, x, ws)
    tor = gradient_penalty(theirs, body, x, ws)
    assert_all_equal(ref, got)
    assert_all_equal(tor, got)


def test_double_backward_through_nested_checkpoints():
    ws = weights()
    x = data(4, 6)

    def outer(t, ws):
        return remat.checkpoint(body, t.sin(), ws).cos()

    def outer_plain(t, ws):
        return body(t.sin(), ws).cos()

    assert_all_equal(
        gradient_penalty(plain, outer_plain, x, ws), gradient_penalty(ours, outer, x, ws)
    )


# --------------------------------------------------------------- argument forms


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float
    extra: list[torch.Tensor]


Pair = collections.namedtuple("Pair", ["a", "b"])


def structured(batch, pairs, *, table, bias=None, flag=True):
    h = batch.x * batch.scale
    for e in batch.extra:
        h = (h @ e).tanh()
    h = h * pairs[0].a.sin() + pairs[1].b
    h = h + table["w"].exp().sum() + table["nested"][0][1].cos().sum()
    if bias is not None:
        h = h + bias
    return h.relu() if flag else h


def structured_args():
    x, e1, e2, a, b, w, n = (data(3, 3, seed=i) for i in range(7))
    frozen = data(3, seed=9, grad=False)
    batch = Batch(x, 0.5, [e1, e2])
    pairs = (Pair(a, frozen), Pair(frozen, b))
    table = {"w": w, "nested": [(frozen, n)]}
    return (batch, pairs), {"table": table, "bias": frozen, "flag": False}, [x, e1, e2, a, b, w, n]


@pytest.mark.parametrize("runner", [ours, theirs])
def test_tensors_nested_in_containers_dataclasses_and_kwargs(runner):
    args, kwargs, leaves = structured_args()
    ref = losses_and_grads(plain, structured, args, leaves, **kwargs)
    got = losses_and_grads(runner, structured, args, leaves, **kwargs)
    assert_all_equal(ref, got)


def test_argument_containers_mutated_after_forward_do_not_change_recompute():
    x, w = data(3), data(3, seed=2)
    args = [x, w]
    out = remat.checkpoint(lambda lst: (lst[0] * lst[1]).sin(), args)
    args[1] = torch.zeros(3)  # the user reuses the list
    out.sum().backward()
    assert torch.equal(x.grad, (x * w).cos().detach() * w.detach())


def test_non_tensor_inputs_and_outputs_pass_through():
    x = data(4)

    def f(t, n, name, scale=None):
        return t.sin() * n, f"{name}-{n}", None, scale

    out = remat.checkpoint(f, x, 3, "a", scale=1.5)
    assert out[1:] == ("a-3", None, 1.5)
    out[0].sum().backward()
    assert torch.equal(x.grad, x.detach().cos() * 3)


def test_outputs_that_do_not_require_grad():
    x = data(4, 3)

    def f(t):
        y = t.exp()
        return y, y.argmax(dim=1), y.detach() * 2

    out = remat.checkpoint(f, x)
    ref = f(x)
    assert out[0].requires_grad and not out[1].requires_grad and not out[2].requires_grad
    assert torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
    out[0].sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_output_without_grad_only_when_nothing_requires_grad():
    x = data(4, grad=False)
    out = remat.checkpoint(torch.sin, x)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, x.sin())


@pytest.mark.parametrize("runner", [ours, theirs])
def test_frozen_inputs_still_give_parameter_grads(runner):
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    x = data(3, 6, grad=False)  # frozen embedding output: no grad
    lin(x).tanh().sum().backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    runner(lambda t: lin(t).tanh(), x).sum().backward()
    assert_all_equal(ref, [p.grad for p in lin.parameters()])
    assert x.grad is None


# ----------------------------------------------------------- in-place after forward


@pytest.mark.parametrize(
    "modify",
    [
        lambda t: t.add_(1.0),  # a non-leaf input changed in place
        lambda t: t.mul_(0.0),  # ... to any value
    ],
)
def test_inplace_modification_of_an_input_after_forward_raises(modify):
    x = data(4)
    h = x * 2  # a non-leaf the user may change
    out = remat.checkpoint(lambda t: t.sin(), h)
    with torch.no_grad():
        modify(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_inplace_modification_of_a_frozen_input_after_forward_raises():
    w = data(4, seed=3)
    frozen = data(4, grad=False)
    out = remat.checkpoint(lambda t, u: (t * u).sin(), frozen, w)
    frozen.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ------------------------------------------------------------ grad mode off


@pytest.mark.parametrize(
    "mode",
    [
        torch.no_grad,  # grad disabled
        torch.inference_mode,  # inference tensors
    ],
)
def test_without_grad_mode_the_function_is_simply_called(mode):
    seen = []

    def f(t):
        seen.append(
            (remat.is_checkpointing(), torch._C._autograd._top_saved_tensors_default_hooks(False))
        )
        return t.sin()

    x = data(4)
    with mode():
        out = remat.checkpoint(f, x, early_stop=False, debug=True)
    assert seen == [(False, None)]  # no region, no hooks installed
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, x.detach().sin())


# --------------------------------------------------------- exceptions restore state


class Boom(Exception):
    pass


def snapshot() -> tuple[Any, ...]:
    return (
        torch.get_rng_state(),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        remat.is_checkpointing(),
        remat.is_recomputing(),
        torch._C._autograd._top_saved_tensors_default_hooks(False),
    )


def assert_state(expected: tuple[Any, ...]) -> None:
    now = snapshot()
    assert torch.equal(now[0], expected[0]), "RNG state changed"
    assert now[1:] == expected[1:]


def test_exception_in_forward_restores_state_and_propagates():
    x = data(4)

    def f(t):
        torch.rand(3)  # the forward's own random op runs, as in the plain call
        t.sin()
        raise Boom("in forward")

    torch.manual_seed(5)
    with pytest.raises(Boom, match="in forward"):
        f(x)
    expected = snapshot()  # the state a plain call leaves behind when it raises
    torch.manual_seed(5)
    with pytest.raises(Boom, match="in forward"):
        remat.checkpoint(f, x, debug=True)
    assert_state(expected)  # RNG advanced as plain, hooks popped, no region left open
    assert expected[3:5] == (False, False)


@pytest.mark.parametrize(
    "where",
    [
        "function",  # the user function raises during recompute
        "mismatch",  # remat raises CheckpointError after recompute
    ],
)
@pytest.mark.parametrize("grad_mode", [True, False])  # backward may be called under no_grad
def test_exception_in_recompute_restores_state(where, grad_mode):
    x = data(4, 4)
    flag = {"on": False}

    def f(t):
        torch.rand(3)  # consumes RNG in recompute too
        if flag["on"]:
            if where == "function":
                raise Boom("in recompute")
            t = t[:2]
        return t.exp().sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = remat.checkpoint(f, x)
    flag["on"] = True
    torch.manual_seed(7)
    with torch.set_grad_enabled(grad_mode):
        before = snapshot()
        error = Boom if where == "function" else remat.CheckpointError
        with pytest.raises(error):
            out.backward()
        assert_state(before)


class SavesInput(torch.autograd.Function):
    """``t * 2`` saving ``t``; its backward first calls the ``on_backward(ctx)`` it was given."""

    @staticmethod
    def forward(ctx, t, on_backward):
        ctx.save_for_backward(t)
        ctx.on_backward = on_backward
        return t * 2

    @staticmethod
    def backward(ctx, g):
        ctx.on_backward(ctx)
        return g * 2, None


def raise_in_backward(ctx):
    (_t,) = ctx.saved_tensors
    raise Boom("in backward")


def unpack_twice(ctx):
    (_a,) = ctx.saved_tensors
    (_b,) = ctx.saved_tensors  # remat hands each recomputed tensor out once per backward


@pytest.mark.parametrize(
    "on_backward, error, match",
    [
        (raise_in_backward, Boom, "in backward"),  # the op's own backward raises
        (unpack_twice, remat.CheckpointError, "already unpacked once"),  # torch's phrase
    ],
    ids=["op-backward-raises", "saved-tensor-unpacked-twice"],
)
def test_error_in_backward_of_a_recomputed_op_propagates_and_restores_state(
    on_backward, error, match
):
    x = data(4)
    out = remat.checkpoint(lambda t: SavesInput.apply(t.sin(), on_backward), x)
    before = snapshot()
    with pytest.raises(error, match=match):
        out.sum().backward()
    assert_state(before)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_function_without_tensor_arguments_gives_parameter_grads(use_reentrant):
    (w,) = weights(n=1)

    def f():
        return (w @ w).tanh().exp()

    ref = torch.autograd.grad(f().sum(), w)[0]
    remat.checkpoint(f, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(w.grad, ref)


def test_output_that_is_an_input_or_a_view_of_it():
    x = data(4, 3)
    same, view, y = remat.checkpoint(lambda t: (t, t[0], t.exp()), x)
    assert same is x
    (same.sum() + view.sum() * 2 + y.sum()).backward()
    expected = torch.ones(4, 3) + x.detach().exp()
    expected[0] += 2
    assert torch.equal(x.grad, expected)
