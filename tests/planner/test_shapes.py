"""Plans for every batch size up to the largest (``auto_checkpoint(shapes=...)``): within the
budget at each size (measured, exact bytes), gradients bitwise those of the unchecked model,
the same plan for the same size, a clear error past the largest."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import remat
from remat.modules.wrap import is_wrapped
from remat.planner.shapes import ShapePlans
from tests.support.models import GPT
from tests.support.steps import step_grads
from tests.support.vision_models import ResNet

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (8, 20, 33, 44, 52, 64)


@pytest.fixture(scope="module")
def planned():
    model = GPT(n=4, d=16)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters())
    g = torch.Generator().manual_seed(0)
    longest = torch.randn(2, 64, 16, generator=g)
    plans = remat.auto_checkpoint(model, longest, budget="50%", optimizer=opt, timer="flops",
                                  shapes=remat.Shapes(dims=1, multiple=4))  # fmt: skip
    yield model, reference, opt, plans
    plans.remove()


def test_returns_shape_plans_for_the_largest_batch(planned):
    _, _, _, plans = planned
    assert isinstance(plans, ShapePlans)
    assert plans.largest == 64 and plans.largest_shapes == [[2, 64, 16]]
    assert plans.fit.sizes == [16, 32, 64]


@pytest.mark.parametrize("n", LENGTHS)
def test_measured_peak_within_budget_at_every_length(planned, n):
    model, _, opt, plans = planned
    x = torch.randn(2, n, 16)
    peak = remat.measure_peak(model, x, optimizer=opt)
    chosen = plans.plan_for(n)
    assert peak + chosen.scratch_bytes <= plans.budget_bytes
    assert chosen.predicted_peak_bytes + chosen.scratch_bytes <= plans.budget_bytes


def test_unchecked_step_of_the_longest_batch_is_over_the_budget(planned):
    _, reference, _, plans = planned
    opt = torch.optim.AdamW(reference.parameters())
    assert remat.measure_peak(reference, torch.randn(2, 64, 16), optimizer=opt) > plans.budget_bytes


@pytest.mark.parametrize("n", LENGTHS)
def test_gradients_bitwise_equal_unchecked_at_every_length(planned, n):
    model, reference, _, _ = planned
    x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n))
    for a, b in zip(step_grads(model, (x,), {}, seed=n), step_grads(reference, (x,), {}, seed=n)):
        assert torch.equal(a, b)


def test_short_batches_checkpoint_fewer_blocks_than_the_longest(planned):
    _, _, _, plans = planned
    kept = [sum(d == "keep" for d in plans.plan_for(n).decisions.values()) for n in (16, 64)]
    assert kept[0] > kept[1]


def test_same_size_same_plan_cached_per_bucket(planned):
    model, _, _, plans = planned
    assert plans.plan_for(41) is plans.plan_for(44)  # one bucket of multiple=4
    model(torch.randn(2, 41, 16)).backward()
    first = {n: is_wrapped(m) for n, m in model.named_modules() if n.startswith("layers.")}
    model(torch.randn(2, 64, 16)).backward()
    model(torch.randn(2, 43, 16)).backward()
    assert first == {n: is_wrapped(m) for n, m in model.named_modules() if n.startswith("layers.")}
    assert 44 in plans.plans


def test_batch_larger_than_planned_raises_naming_the_largest(planned):
    model, _, _, _ = planned
    with pytest.raises(remat.PlanError, match=r"larger than the largest planned size 64 \(inputs "
                       r"of shapes \[\[2, 64, 16\]\]\)"):  # fmt: skip
        model(torch.randn(2, 65, 16))


def test_no_switching_without_gradients(planned):
    model, _, _, _ = planned
    with torch.no_grad():
        assert model(torch.randn(2, 80, 16)).shape == ()


def test_larger_batch_opt_in_runs_smallest_peak_plan_with_warning():
    model = GPT(n=3, d=16)
    reference = copy.deepcopy(model)
    plans = remat.auto_checkpoint(model, torch.randn(2, 32, 16), budget="60%", timer="flops",
                                  shapes=remat.Shapes(larger="smallest"))  # fmt: skip
    x = torch.randn(2, 40, 16)
    with pytest.warns(UserWarning, match="larger than the largest planned size 32"):
        got = step_grads(model, (x,), {})
    for a, b in zip(got, step_grads(reference, (x,), {})):
        assert torch.equal(a, b)
    top = plans.fit.profiles[32]
    assert plans.plan_for.__self__ is plans
    with pytest.warns(UserWarning):
        assert plans.plan_for(40).predicted_peak_bytes == top.floor_bytes
    plans.remove()


def test_remove_puts_the_model_back():
    model = GPT(n=3, d=16)
    plans = remat.auto_checkpoint(model, torch.randn(2, 32, 16), budget="40%", timer="flops",
                                  shapes=remat.Shapes())  # fmt: skip
    model(torch.randn(2, 32, 16)).backward()
    assert any(is_wrapped(m) for m in model.layers)
    plans.remove()
    assert not any(is_wrapped(m) for m in model.layers)
    model(torch.randn(2, 80, 16)).backward()  # no hook: any size runs


@pytest.mark.slow  # 7 s
def test_sizes_where_the_fit_misses_are_profiled_when_they_come(caplog):
    torch.manual_seed(0)
    model = ResNet()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters())
    shapes = remat.Shapes(dims=(2, 3), multiple=32, checks=1)
    with caplog.at_level(logging.WARNING, logger="remat"):
        plans = remat.auto_checkpoint(model, torch.randn(2, 3, 128, 128), budget="90%",
                                      optimizer=opt, timer="flops", shapes=shapes)  # fmt: skip
    assert "the shape fit missed" in caplog.text
    assert plans.fit.knots == [32, 64, 96, 128]
    x = torch.randn(2, 3, 50, 50)  # bucket 64: measured; its own peak within the budget
    assert remat.measure_peak(model, x, optimizer=opt) <= plans.budget_bytes
    for a, b in zip(step_grads(model, (x,), {}), step_grads(reference, (x,), {})):
        assert torch.equal(a, b)
    plans.remove()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dims": -1}, "dims must be a dimension"),
        ({"sizes": (0,)}, "sizes must be ints >= 1"),
        ({"multiple": 0}, "multiple must be an int >= 1, got 0"),
        ({"larger": "grow"}, "larger must be one of"),
        ({"checks": -1}, "checks must be an int >= 0"),
    ],
)
def test_shapes_rejects_bad_arguments_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        remat.Shapes(**kwargs)


def test_size_of_names_the_dimension_when_no_input_has_it():
    with pytest.raises(ValueError, match="no tensor input has dimension 3"):
        remat.Shapes(dims=3).size_of((torch.randn(2, 4),))
    with pytest.raises(ValueError, match="differ"):
        remat.Shapes(dims=(2, 3)).size_of((torch.randn(1, 3, 4, 5),))
