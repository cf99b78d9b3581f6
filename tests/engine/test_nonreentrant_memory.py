"""Memory, in bytes: what a checkpointed region keeps, and when recomputed tensors die.

What autograd keeps is counted with an outer ``saved_tensors_hooks``: remat's
own hooks hide the region's saves from it, and the region's inputs are kept
through autograd ``SavedTensor`` objects made under the outer hooks, so the
outer hook sees exactly the inputs. Recomputed tensors are followed with
storage weak references (``StorageWeakRef``), which expire when the storage
is freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import remat
from tests.support.tensors import data


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def saved_bytes(run: Callable[[], Any]) -> tuple[int, list[torch.Size]]:
    """Bytes and shapes of what autograd saves while ``run()`` builds its graph."""
    shapes: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(s.numel() * 4 for s in shapes), shapes


W = data(16, 16, seed=7)  # a parameter used through a closure: not an input


def mlp(x: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = (x @ W).tanh().exp()
    return x


def two_inputs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mlp(x) * y.sin()


def structured(batch: dict[str, Any], *, scale: torch.Tensor) -> torch.Tensor:
    return mlp(batch["x"]) * batch["ys"][0].cos() * scale


X = data(8, 16)
Y = data(8, 16, seed=2)
FROZEN = data(8, 16, seed=3, grad=False)
SCALE = data(16, seed=4)


@pytest.mark.parametrize(
    "call, inputs",
    [
        (lambda: remat.checkpoint(mlp, X), [X]),  # one input
        (lambda: remat.checkpoint(two_inputs, X, Y), [X, Y]),  # two inputs
        (lambda: remat.checkpoint(two_inputs, X, FROZEN), [X, FROZEN]),  # a frozen input
        (
            lambda: remat.checkpoint(structured, {"x": X, "ys": [Y]}, scale=SCALE),
            [X, Y, SCALE],
        ),  # nested containers and kwargs
        (
            lambda: remat.checkpoint(lambda t: remat.checkpoint(mlp, t.sin()).cos(), X),
            [X],
        ),  # a nested region: only the outermost inputs
        (
            lambda: remat.checkpoint(mlp, X, early_stop=False, determinism_check="values"),
            [X],
        ),  # options do not keep more
        (lambda: remat.checkpoint(mlp, X, use_reentrant=True), [X]),  # reentrant variant
    ],
)
def test_a_checkpointed_region_keeps_only_its_inputs(call, inputs):
    got, shapes = saved_bytes(call)
    assert got == sum(nbytes(t) for t in inputs)
    assert shapes == [t.shape for t in inputs]
    plain, _ = saved_bytes(lambda: mlp(X))
    assert plain == 4 * (nbytes(X) + nbytes(W)) + 8 * nbytes(X)  # what checkpointing avoids


def test_a_chain_of_regions_keeps_one_input_per_region():
    def chain():
        h = X
        for _ in range(3):
            h = remat.checkpoint(mlp, h)
        return h

    got, _ = saved_bytes(chain)
    assert got == 3 * nbytes(X)


# ----------------------------------------------------------- recomputed tensors


class Probe(torch.autograd.Function):
    """Identity (a copy) whose backward reports which recomputed storages are alive."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[list[str]], refs: dict[str, Any]) -> Any:
        ctx.log, ctx.refs = log, refs
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.log.append(sorted(k for k, r in ctx.refs.items() if not r.expired()))
        return g, None, None


def probed(log: list[list[str]], refs: dict[str, Any]) -> Callable[[torch.Tensor], Any]:
    def f(x: torch.Tensor) -> torch.Tensor:
        recomputing = remat.is_recomputing()
        a = x.exp()  # exp saves its output a
        if recomputing:
            refs.clear()
            refs["a"] = StorageWeakRef(a.untyped_storage())
        b = a.sin()  # sin saves a
        p = Probe.apply(b, log, refs)
        if recomputing:
            refs["p"] = StorageWeakRef(p.untyped_storage())
        return p.cos()  # cos saves p, the last saved tensor (early stop ends here)

    return f


@pytest.mark.parametrize("early_stop", [True, False])
def test_recomputed_tensors_are_freed_as_soon_as_backward_used_them(early_stop):
    log: list[list[str]] = []
    refs: dict[str, Any] = {}
    x = data(32)
    loss = remat.checkpoint(probed(log, refs), x, early_stop=early_stop).sum()
    for i in range(2):  # the first backward retains the graph, the second does not
        log.clear()
        loss.backward(retain_graph=i == 0)
        # In Probe's backward, cos has used p (freed); a waits for sin and exp
        assert log == [["a"]]
        assert all(r.expired() for r in refs.values())  # nothing recomputed outlives backward
    assert torch.equal(x.grad, 2 * torch.autograd.grad(probed([], {})(x).sum(), x)[0])


def test_tensors_a_partial_backward_does_not_use_are_freed_when_it_ends():
    refs: list[Any] = []

    def f(x):
        a = x.exp()  # saves a
        b = a.sin()  # saves a again: only a backward through b uses it
        if remat.is_recomputing():
            refs.append(StorageWeakRef(a.untyped_storage()))
        return a.sum(), b

    x = data(32)
    total, b = remat.checkpoint(f, x, early_stop=False)
    for _ in range(3):
        (g,) = torch.autograd.grad(total, x, retain_graph=True)  # never reaches sin
        assert torch.equal(g, x.detach().exp())
    assert len(refs) == 3 and all(r.expired() for r in refs)


def test_reading_a_saved_tensor_outside_backward_keeps_nothing_else():
    refs: list[Any] = []

    def f(x):
        a = x.exp()
        if remat.is_recomputing():
            refs.append(StorageWeakRef(a.untyped_storage()))
        return a.sin().cos()

    x = data(32)
    out = remat.checkpoint(f, x)
    saved = out.grad_fn._saved_self  # cos saved sin's output: recomputed for this read
    assert torch.equal(saved, x.exp().sin())
    assert len(refs) == 1 and refs[0].expired()  # a (needed only by exp, sin) is gone
    out.sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad(f(x).sum(), x)[0])


def test_a_failed_recompute_leaves_nothing_behind():
    refs: list[Any] = []
    flag = {"fail": False}

    def f(x):
        a = x.exp()
        if remat.is_recomputing():
            refs.append(StorageWeakRef(a.untyped_storage()))
        b = a.sin()
        if flag["fail"]:
            raise KeyError("late failure")
        return b.cos()

    x = data(32)
    out = remat.checkpoint(f, x, early_stop=False).sum()
    flag["fail"] = True
    with pytest.raises(KeyError):
        out.backward(retain_graph=True)
    assert len(refs) == 1 and refs[0].expired()
    flag["fail"] = False
    out.backward()  # the graph is intact: a later backward works
    assert torch.equal(x.grad, torch.autograd.grad(f(x).sum(), x)[0])


def test_a_region_input_is_freed_once_backward_has_passed_the_region():
    log: list[list[str]] = []
    refs: dict[str, Any] = {}
    x = data(32)
    # region 1: Probe first, so its backward runs after every other node of region 1
    h1 = remat.checkpoint(lambda t: Probe.apply(t, log, refs).sin().exp(), x)
    refs["h1"] = StorageWeakRef(h1.untyped_storage())  # kept only as region 2's input
    h2 = remat.checkpoint(lambda t: t.cos().exp(), h1)
    del h1
    h2.sum().backward()
    assert log == [[]]  # region 2 is done: its input is gone before region 1 finishes
