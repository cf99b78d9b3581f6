"""remat.checkpoint_sequential: gradients, segment counts, argument validation."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from tests.support.tensors import assert_all_equal, data


def model(n: int = 5, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(n):
        layers.append(torch.nn.Linear(6, 6))
        layers.append(torch.nn.Tanh() if i % 2 else torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def loss_and_grads(m, x, run):
    m.zero_grad(set_to_none=True)
    x.grad = None
    loss = run(m, x).square().sum()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 10])  # 1: nothing checkpointed; 10: one each
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_sequential_grads_equal_plain_and_torch(segments, use_reentrant):
    m, x = model(), data(3, 6)
    ref = loss_and_grads(m, x, lambda m, x: m(x))
    got = loss_and_grads(
        m, x, lambda m, x: remat.checkpoint_sequential(m, segments, x, use_reentrant=use_reentrant)
    )
    tor = loss_and_grads(
        m, x, lambda m, x: tuc.checkpoint_sequential(m, segments, x, use_reentrant=use_reentrant)
    )
    assert_all_equal(ref, got)
    assert_all_equal(tor, got)


@pytest.mark.parametrize(
    "container",
    [
        list,  # a list of modules
        tuple,  # a tuple of modules
        torch.nn.ModuleList,  # torch indexes it like a list; so does remat
    ],
)
def test_checkpoint_sequential_accepts_lists_and_module_lists(container):
    m, x = model(), data(3, 6)
    ref = loss_and_grads(m, x, lambda m, x: m(x))
    got = loss_and_grads(
        m, x, lambda m, x: remat.checkpoint_sequential(container(m.children()), 3, x)
    )
    assert_all_equal(ref, got)


def test_checkpoint_sequential_accepts_plain_callables():
    x = data(3, 6)
    fns = [torch.sin, torch.cos, torch.exp, lambda t: t * 2]
    y = remat.checkpoint_sequential(fns, 2, x)
    y.sum().backward()
    h = x.detach().requires_grad_()
    (h.sin().cos().exp() * 2).sum().backward()
    assert torch.equal(x.grad, h.grad)


class Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.sin()


@pytest.mark.parametrize(
    "segments, calls",
    [
        (1, [1] * 6),  # one plain chunk
        (2, [2, 2, 2, 1, 1, 1]),  # first half recomputed once, the last chunk is not
        (3, [2, 2, 2, 2, 1, 1]),  # chunks of 2: the last one runs plain
        (6, [2, 2, 2, 2, 2, 1]),  # every function but the last checkpointed
    ],
)
def test_every_chunk_but_the_last_is_recomputed_once(segments, calls):
    fns = [Counting() for _ in range(6)]
    x = data(3, 6)
    remat.checkpoint_sequential(fns, segments, x, early_stop=False).sum().backward()
    assert [f.calls for f in fns] == calls


@pytest.mark.parametrize(
    "check, raises",
    [
        ("values", True),  # the value change in recompute is caught
        ("none", False),  # the option reaches checkpoint: nothing is compared
    ],
)
def test_checkpoint_sequential_passes_options_to_checkpoint(check, raises):
    x = data(3, 6)
    flag = {"scale": False}

    def maybe_scale(t):
        return t * 2 if flag["scale"] else t

    fns = [maybe_scale, torch.exp, torch.sin, torch.cos]
    y = remat.checkpoint_sequential(fns, 2, x, determinism_check=check)
    flag["scale"] = True
    if raises:
        with pytest.raises(remat.CheckpointError, match="checksum"):
            y.sum().backward()
    else:
        y.sum().backward()


@pytest.mark.parametrize(
    "segments, error, match",
    [
        (0, ValueError, "segments must be between 1 and len\\(functions\\) = 4, got 0"),  # zero
        (-1, ValueError, "got -1"),  # negative
        (5, ValueError, "between 1 and len\\(functions\\) = 4, got 5"),  # more than functions
        (True, TypeError, "segments must be an int, got True"),  # bool is not a count
        (2.0, TypeError, "segments must be an int, got 2.0"),  # float
        ("2", TypeError, "segments must be an int, got '2'"),  # string
    ],
)
def test_segments_validated_with_clear_messages(segments, error, match):
    fns = [torch.sin] * 4
    with pytest.raises(error, match=match):
        remat.checkpoint_sequential(fns, segments, data(3, 6))


def test_torch_gives_an_unhelpful_error_for_too_many_segments():
    # the reason remat validates: torch fails deep inside range()
    with pytest.raises(ValueError, match="range\\(\\) arg 3 must not be zero"):
        tuc.checkpoint_sequential([torch.sin] * 4, 5, data(3, 6), use_reentrant=False)


def test_empty_functions_rejected():
    with pytest.raises(ValueError, match="functions is empty"):
        remat.checkpoint_sequential([], 1, data(3, 6))


@pytest.mark.parametrize(
    "functions",
    [
        torch.sin,  # a single callable
        "abc",  # a string is a sequence, not of callables
        {"a": torch.sin},  # a mapping
        torch.nn.Linear(2, 2),  # a module that is not an nn.Sequential
    ],
)
def test_functions_must_be_a_sequence(functions):
    with pytest.raises(TypeError, match="functions must be an nn.Sequential or a list"):
        remat.checkpoint_sequential(functions, 1, data(3, 6))


def test_unknown_keyword_arguments_rejected():
    with pytest.raises(ValueError, match="Unexpected keyword arguments: bogus"):
        remat.checkpoint_sequential([torch.sin] * 2, 1, data(3, 6), bogus=1)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: bogus"):
        tuc.checkpoint_sequential([torch.sin] * 2, 1, data(3, 6), use_reentrant=False, bogus=1)


def test_checkpoint_sequential_does_not_warn_by_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.checkpoint_sequential(model(), 2, data(3, 6)).sum().backward()
