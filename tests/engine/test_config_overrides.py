"""remat.engine.config's internal API: the overrides read by the engine, and the region depths
raised by entering_region / recomputing_region, put back on every exit path."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.engine import config


def data(n: int = 5) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).requires_grad_()


def flags() -> tuple[bool, bool]:
    return remat.is_checkpointing(), remat.is_recomputing()


@pytest.mark.parametrize(
    "manager, read, value",
    [
        (remat.set_checkpoint_early_stop, config.early_stop_override, False),
        (remat.set_checkpoint_debug_enabled, config.debug_override, True),
        (lambda _: remat.disable_checkpointing(), config.checkpointing_disabled, True),
    ],
    ids=["early-stop", "debug", "disabled"],
)
def test_each_override_reads_what_its_public_setting_set(manager, read, value):
    before = read()
    assert before in (None, False)
    with manager(value):
        assert read() is value
    assert read() is before


def test_region_depths_nest_and_are_put_back():
    assert flags() == (False, False)
    with config.entering_region():
        assert flags() == (True, False)
        with config.recomputing_region():
            assert flags() == (True, True)
            with config.entering_region():  # a region nested in a recompute
                assert flags() == (True, True)
            assert flags() == (True, True)
        assert flags() == (True, False)
    assert flags() == (False, False)


@pytest.mark.parametrize("region", [config.entering_region, config.recomputing_region])
def test_region_depths_are_put_back_when_the_code_inside_raises(region):
    with pytest.raises(ValueError, match="inside"):
        with region():
            raise ValueError("inside")
    assert flags() == (False, False)


@pytest.mark.parametrize(
    "run",
    [
        lambda x: remat.checkpoint(torch.sin, x, use_reentrant=False),
        lambda x: remat.checkpoint_wrapper(torch.nn.Tanh())(x),
    ],
    ids=["checkpoint", "wrapper"],
)
def test_a_refused_hook_push_leaves_no_region_behind(run):
    # before: the depth was raised before the hooks were pushed, outside the try, so a
    # push refused by autograd left is_checkpointing() True for the rest of the thread
    torch._C._autograd._saved_tensors_hooks_disable("saved tensors hooks are off here")
    try:
        with pytest.raises(RuntimeError, match="hooks are off here"):
            run(data())
    finally:
        torch._C._autograd._saved_tensors_hooks_enable()
    assert flags() == (False, False)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_failed_recompute_leaves_no_region_behind():
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("in recompute")
        return x.sin().exp()

    y = remat.checkpoint(fn, data(), use_reentrant=False)
    with pytest.raises(KeyError, match="in recompute"):
        y.sum().backward()
    assert flags() == (False, False)


def test_one_backward_recomputes_once_for_every_saved_tensor_and_a_group_once_more():
    # The unpacks after the first of a backward skip the group lookup: a group entered
    # for later backward calls still gets its own recompute, shared by them.
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin().exp() * x.cos().tanh(), x.cos().exp()  # several saved tensors

    x = data()
    a, b = remat.checkpoint(fn, x, use_reentrant=False)
    calls.clear()
    ga = torch.autograd.grad(a.sum(), x, retain_graph=True)[0]
    assert len(calls) == 1
    with remat.GraphExecGroup():
        ga2 = torch.autograd.grad(a.sum(), x)[0]
        gb = torch.autograd.grad(b.sum(), x)[0]
    assert len(calls) == 2
    x2 = x.detach().requires_grad_()
    a2, b2 = fn(x2)
    assert torch.equal(ga, torch.autograd.grad(a2.sum(), x2, retain_graph=True)[0])
    assert torch.equal(ga2, ga)
    assert torch.equal(gb, torch.autograd.grad(b2.sum(), x2)[0])
