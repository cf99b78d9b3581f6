"""remat.engine.nonreentrant on a torch without ``_make_saved_tensor`` (torch 2.11; patched away
on a torch that has it): the region's inputs kept by reference and their versions checked
by hand."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.engine import nonreentrant, torch_compat


@pytest.fixture
def older_torch(monkeypatch):
    """The engine as on a torch whose autograd cannot make a ``SavedTensor`` from Python."""
    monkeypatch.setattr(torch_compat, "make_saved_tensor", None)


def data(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def fn(x, w, *, scale=1.0):
    return (x @ w).tanh().sin() * scale


CASES = {
    # flat tensor arguments
    "flat": (lambda x, w: remat.checkpoint(fn, x, w), lambda x, w: fn(x, w)),
    # a keyword argument: the nested path
    "keyword": (
        lambda x, w: remat.checkpoint(fn, x, w, scale=2.0),
        lambda x, w: fn(x, w, scale=2.0),
    ),
    # one tensor passed twice
    "repeated": (
        lambda x, w: remat.checkpoint(lambda a, b: fn(a, b) + fn(b, a), x, x),
        lambda x, w: fn(x, x) + fn(x, x),
    ),
}


def grads(run, x, w):
    run(x, w).sum().backward()
    out = [None if t.grad is None else t.grad.clone() for t in (x, w)]
    x.grad = w.grad = None
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_grads_equal_uncheckpointed_on_older_torch(older_torch, case):
    checkpointed, plain = CASES[case]
    x, w = data(4, 4), data(4, 4, seed=1)
    for got, want in zip(grads(checkpointed, x, w), grads(plain, x, w)):
        assert (got is None and want is None) or torch.equal(got, want)


def test_an_input_changed_in_place_after_forward_raises_on_older_torch(older_torch):
    x, w = data(4, 4), data(4, 4, seed=1)
    a = x * 1.0
    y = remat.checkpoint(fn, a, w)
    with torch.no_grad():
        a.add_(1.0)
    # autograd's words, as where torch makes the SavedTensor (tests/engine/test_nonreentrant.py
    # expects them on every torch), then which input and its versions
    with pytest.raises(
        RuntimeError,
        match=r"modified by an inplace operation: input 0 of a checkpointed region "
        r"\(shape \(4, 4\)\) is at version 1; expected version 0 instead",
    ):
        y.sum().backward()


def test_saved_inputs_keep_tensors_and_check_versions_on_older_torch(older_torch):
    kept = nonreentrant.SavedInputs()
    a, b = torch.zeros(2), torch.ones(3)
    assert (kept.add(a), kept.add(b)) == (0, 1)
    values = kept.values()
    assert values[0] is a and values[1] is b
    b.add_(1.0)
    with pytest.raises(RuntimeError, match=r"input 1 of a checkpointed region \(shape \(3,\)\)"):
        kept.values()


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))


def test_offload_to_cpu_moves_a_regions_input_off_the_device_on_older_torch(older_torch):
    # the first GPU check (torch 2.11) found the wrapper's input kept by reference, never
    # offloaded: the device memory did not drop. The simulated device stands for CUDA.
    import weakref

    from tests.support.simdevice import simulated_device

    block = _block()
    x = data(8, 16)
    block(x * 1.0).sum().backward()
    want = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad(set_to_none=True)
    x.grad = None
    remat.checkpoint_wrapper(block, offload_to_cpu=True)
    with simulated_device(0) as dev:
        h = x * 1.0
        alive = weakref.ref(h)
        y = block(h)
        del h
        assert alive() is None  # only the host copy keeps the region's input
        assert [k for k, _ in dev.copies].count("out") == 1
        y.sum().backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_save_on_cpu_keeps_a_regions_input_through_its_hooks_on_older_torch(older_torch):
    import weakref

    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t.clone()  # a copy, as save_on_cpu's: the original may die

    x, w = data(4, 4), data(4, 4, seed=1)
    want = grads(lambda a, b: fn(a * 1.0, b), x, w)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        a = x * 1.0
        alive = weakref.ref(a)
        y = remat.checkpoint(fn, a, w)
    del a
    assert alive() is None and packed[-2:] == [(4, 4), (4, 4)]  # the region's inputs a, w
    y.sum().backward()
    got = [x.grad, w.grad]
    for g, v in zip(got, want):
        assert torch.equal(g, v)


def test_a_nested_regions_input_is_recomputed_by_the_outer_region_on_older_torch(older_torch):
    import weakref

    x, w = data(4, 4), data(4, 4, seed=1)
    want = grads(lambda a, b: fn(fn(a, b) * 2.0, b), x, w)
    inner_inputs = []

    def outer(a, b):
        h = fn(a, b) * 2.0
        inner_inputs.append(weakref.ref(h))
        return remat.checkpoint(fn, h, b)

    y = remat.checkpoint(outer, x, w)
    assert inner_inputs[0]() is None  # the outer region drops it; backward recomputes it
    y.sum().backward()
    for g, v in zip([x.grad, w.grad], want):
        assert torch.equal(g, v)
