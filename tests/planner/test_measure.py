"""remat.profile and remat.measure_peak (remat.planner.measure): planning leaves the model,
the optimizer, the gradients, the buffers and the RNG exactly as found; what a profile
records; bad arguments named.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.bench.models import build, example_input
from remat.planner.auto import step_peaks
from tests.support.models import SMALL_GPT
from tests.support.plans import make_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- planning leaves state as found


def _both(t: Any) -> tuple[Any, Any]:
    """The object and a copy of its value."""
    if isinstance(t, torch.Tensor):
        return t, t.detach().clone()
    return t, copy.deepcopy(t)


def _state(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, Any]:
    """Everything a step could change: the objects and a copy of their values."""
    return {
        "params": {n: _both(p) for n, p in model.named_parameters()},
        "grads": {n: _both(p.grad) for n, p in model.named_parameters()},
        "input_grad": _both(x.grad),
        "buffers": {n: _both(b) for n, b in model.named_buffers()},
        "opt_state_obj": opt.state,
        "opt_state": {id(p): {k: _both(v) for k, v in s.items()} for p, s in opt.state.items()},
        "groups": [
            (
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                [id(p) for p in g["params"]],
            )
            for g in opt.param_groups
        ],
        "rng": torch.get_rng_state(),
        "training": [m.training for m in model.modules()],
        "repr": repr(model),
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    def same(a: tuple[Any, Any], b: tuple[Any, Any], what: str) -> None:
        assert b[0] is a[0], f"{what}: another object"
        if isinstance(a[1], torch.Tensor):
            assert torch.equal(a[1], b[1]), f"{what}: values changed"
        else:
            assert a[1] == b[1], what

    for key in ("params", "grads", "buffers"):
        assert before[key].keys() == after[key].keys()
        for n in before[key]:
            same(before[key][n], after[key][n], f"{key} {n}")
    same(before["input_grad"], after["input_grad"], "input grad")
    assert after["opt_state_obj"] is before["opt_state_obj"]
    assert before["opt_state"].keys() == after["opt_state"].keys()
    for pid, entry in before["opt_state"].items():
        assert entry.keys() == after["opt_state"][pid].keys()
        for k in entry:
            same(entry[k], after["opt_state"][pid][k], f"optimizer state {k}")
    assert after["groups"] == before["groups"]
    assert torch.equal(after["rng"], before["rng"])
    assert after["training"] == before["training"]
    assert after["repr"] == before["repr"]


def _trained() -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    """The MLP (BatchNorm, dropout) after one AdamW step, with gradients from a second backward,
    one parameter's gradient None, an input that has a gradient, and a wrapped block."""
    model, x = make_model("mlp")
    x = x.clone().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(5)
    model(x).sum().backward()
    opt.step()
    model(x).pow(2).sum().backward()  # grads unlike anything a profile step computes
    model.head.bias.grad = None
    remat.checkpoint_wrapper(model.blocks[1])  # the user's own wrapping stays
    torch.manual_seed(123)
    return model, x, opt


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none-grads", "kept-grads"])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, x, o, s: remat.profile(m, x, optimizer=o, set_to_none=s, timer="flops"),
        lambda m, x, o, s: remat.profile(m, x, optimizer=o, set_to_none=s, repeats=1),
        lambda m, x, o, s: remat.measure_peak(m, x, optimizer=o, set_to_none=s),
        lambda m, x, o, s: step_peaks(m, x, optimizer=o, set_to_none=s, steps=3),
    ],
    ids=["profile-flops", "profile-time", "measure_peak", "step_peaks"],
)
def test_profiling_and_measuring_leave_model_optimizer_grads_buffers_and_rng_as_found(
    call, set_to_none
):
    model, x, opt = _trained()
    before = _state(model, opt, x)
    assert before["opt_state"] and before["grads"]["head.bias"][0] is None
    assert int(before["buffers"]["stem.1.num_batches_tracked"][1]) == 2
    call(model, x, opt, set_to_none)
    _assert_same(before, _state(model, opt, x))
    # and training goes on as it would have: the next optimizer step is the same as
    # that of a twin that was never profiled
    twin, twin_x, twin_opt = _trained()
    opt.step()
    twin_opt.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n


def test_profile_of_a_loss_that_raises_leaves_everything_as_found():
    model, x, opt = _trained()
    before = _state(model, opt, x)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the loss")

    with pytest.raises(RuntimeError, match="boom in the loss"):
        remat.profile(model, x, optimizer=opt, loss_fn=loss_fn, timer="flops")
    _assert_same(before, _state(model, opt, x))


def test_profile_leaves_the_model_as_it_was():
    model = build(SMALL_GPT)
    remat.checkpoint_wrapper(model.blocks[1])
    before = repr(model)
    remat.profile(model, example_input(SMALL_GPT), timer="flops", set_to_none=False)
    assert repr(model) == before


def test_profile_leaves_input_gradients_as_they_were():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    fresh = torch.randn(4, 8, requires_grad=True)
    x.grad = torch.full((4, 8), 7.0)
    mine = x.grad
    remat.profile(model, x, timer="flops", set_to_none=False)
    remat.profile(model, fresh, timer="flops", set_to_none=False)
    assert x.grad is mine and torch.equal(mine, torch.full((4, 8), 7.0))
    assert fresh.grad is None


def test_profile_with_flops_measures_decisions_without_recompute():
    # step_cost read each block's "recompute" cost: KeyError when it was not measured
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    prof = remat.profile(model, torch.randn(4, 8), decisions=["keep", "selective"], timer="flops")
    assert prof.step_cost == 3 * 3 * 2 * 4 * 8 * 8  # three forwards' FLOPs of three matmuls


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda m, x: remat.profile("not a module", x),
            r"remat\.profile: model must be .*'not a module'",
        ),
        (
            lambda m, x: remat.profile(m, x, optimizer="adam"),
            r"remat\.profile: optimizer must be .*str",
        ),
        (
            lambda m, x: remat.profile(m, x, set_to_none="no"),
            r"remat\.profile: set_to_none must be.*'no'",
        ),
        (lambda m, x: remat.measure_peak("not a module", x), r"remat\.measure_peak: model must be"),
        (lambda m, x: remat.measure_peak(m, x, optimizer="adam"), r"optimizer must be .*str"),
        (lambda m, x: remat.measure_peak(m, x, set_to_none="no"), r"set_to_none must be.*'no'"),
        (
            lambda m, x: remat.auto_checkpoint(m, x, budget="50%", optimizer="adam"),
            r"optimizer must be .*str",
        ),
    ],
    ids=[
        "profile-model",
        "profile-optimizer",
        "profile-set_to_none",
        "measure_peak-model",
        "measure_peak-optimizer",
        "measure_peak-set_to_none",
        "auto_checkpoint-optimizer",
    ],
)
def test_bad_arguments_raise_type_errors_naming_them(call, match):
    model, x = make_model("mlp")
    before = repr(model)
    with pytest.raises(TypeError, match=match):
        call(model, x)
    assert repr(model) == before


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"timer": "wall"}, ValueError, "timer must be"),
        ({"repeats": 0}, ValueError, "repeats must be"),
        ({"decisions": ["recompute"]}, ValueError, "must include 'keep'"),
        ({"decisions": ["keep", "offload"]}, ValueError, "needs a device"),
        ({"check_fn": lambda n, m: False}, ValueError, "no candidate blocks"),
    ],
)
def test_profile_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        remat.profile(build(SMALL_GPT), example_input(SMALL_GPT), **kwargs, set_to_none=False)
