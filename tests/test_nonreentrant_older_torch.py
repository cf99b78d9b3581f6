"""remat._nonreentrant on a torch without ``_make_saved_tensor`` (older than the one
installed): the region's inputs kept by reference and their versions checked by hand."""

from __future__ import annotations

import pytest
import torch

import remat
from remat import _nonreentrant


@pytest.fixture
def older_torch(monkeypatch):
    """The engine as on a torch whose autograd cannot make a ``SavedTensor`` from Python."""
    monkeypatch.setattr(_nonreentrant, "_make_saved", None)


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
    with pytest.raises(RuntimeError, match=r"input 0 of a checkpointed region \(shape \(4, 4\)\)"):
        y.sum().backward()


def test_saved_inputs_keep_tensors_and_check_versions_on_older_torch(older_torch):
    kept = _nonreentrant.SavedInputs()
    a, b = torch.zeros(2), torch.ones(3)
    assert (kept.add(a), kept.add(b)) == (0, 1)
    values = kept.values()
    assert values[0] is a and values[1] is b
    b.add_(1.0)
    with pytest.raises(RuntimeError, match=r"input 1 of a checkpointed region \(shape \(3,\)\)"):
        kept.values()
