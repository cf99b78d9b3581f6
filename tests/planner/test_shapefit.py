"""The step model fitted in a varying size: exact (to the byte) at sizes never profiled, on a
GPT (sequence length) and a CNN (image side); misses named, and never trusted."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import remat
from remat.engine.errors import PlanError
from remat.planner.shapefit import ShapeFit, interpolate, terms
from tests.support.models import GPT
from tests.support.vision_models import ConvChain, ResNet

pytestmark = pytest.mark.usefixtures("one_thread")


def _bytes(prof: remat.Profile) -> dict[str, int | float]:
    """The byte terms a fit gives exactly (scratch inside operators is bounded instead)."""
    return {
        k: v for k, v in terms(prof).items() if not isinstance(v, float) and "scratch" not in k
    }


def _scratch(prof: remat.Profile) -> dict[str, int | float]:
    return {k: v for k, v in terms(prof).items() if "scratch" in k}


def _bounds(fitted: remat.Profile, measured: remat.Profile) -> bool:
    """Every scratch term of the fit at least the measured one (the larger knot's value)."""
    got = _scratch(measured)
    return all(v >= got[k] for k, v in _scratch(fitted).items())


def _measure(model, x, cut):
    opt = torch.optim.AdamW(model.parameters())

    def measure(n: int) -> remat.Profile:
        return remat.profile(model, cut(x, n), optimizer=opt, timer="flops")

    return measure


def _seq(x, n):
    return x[:, :n].clone()


def _side(x, n):
    return x[:, :, :n, :n].clone()


@pytest.fixture(scope="module")
def gpt_fit():
    measure = _measure(GPT(n=3, d=16), torch.randn(2, 64, 16), _seq)
    fit = ShapeFit({n: measure(n) for n in (32, 48, 64)})
    fit.refine(measure, multiple=4, limit=2)
    return fit, measure


def test_interpolate_is_exact_on_rationals():
    assert interpolate([(0, 3), (1, 5), (2, 9)], 4) == Fraction(4**2 + 4 + 3)  # n**2 + n + 3
    assert interpolate([(2, 7), (4, 7)], 9) == 7


def test_gpt_fit_is_exact_at_lengths_never_profiled(gpt_fit):
    fit, measure = gpt_fit
    checked = [n for n in (36, 44, 52) if fit.trusted(n)]
    assert checked == [36, 44, 52]
    for n in checked:
        assert n not in fit.knots
        measured = measure(n)
        assert _bytes(fit.at(n)) == _bytes(measured)
        assert _bounds(fit.at(n), measured)
        assert fit.at(n).input_shapes == [[2, n, 16]]


def test_fitted_profile_plans_like_the_measured_one(gpt_fit):
    fit, measure = gpt_fit
    fitted, measured = fit.at(44), measure(44)
    budget = (measured.unchecked_peak_bytes + measured.floor_bytes) // 2 + measured.scratch.bytes
    assert remat.plan(fitted, budget).decisions == remat.plan(measured, budget).decisions
    assert fitted.unchecked_peak_bytes == measured.unchecked_peak_bytes


def test_cnn_fit_is_exact_at_image_sides_never_profiled():
    measure = _measure(ConvChain(), torch.randn(2, 3, 32, 32), _side)
    fit = ShapeFit({n: measure(n) for n in (8, 16, 32)})
    assert fit.refine(measure, multiple=4, limit=2) == []
    assert fit.exact
    for n in (12, 20, 28):
        assert fit.trusted(n) and n not in fit.knots
        measured = measure(n)
        assert _bytes(fit.at(n)) == _bytes(measured)
        assert _bounds(fit.at(n), measured)


def test_misses_are_named_and_those_sizes_not_trusted():
    torch.manual_seed(0)
    measure = _measure(ResNet(), torch.randn(2, 3, 128, 128), _side)
    fit = ShapeFit({n: measure(n) for n in (32, 64, 128)})
    missed = fit.refine(measure, multiple=16, limit=1)
    assert missed and all(" at 96: fitted " in m for m in missed)
    assert not fit.exact and fit.misfits[96]
    assert not fit.trusted(80)  # a size between knots where no four knots agree
    assert fit.trusted(96)  # measured


def test_profiles_of_different_blocks_refuse_to_fit():
    x = torch.randn(4, 8)
    a = remat.profile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), x,
                      timer="flops")  # fmt: skip
    b = remat.profile(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]), x[:2],
                      timer="flops")  # fmt: skip
    with pytest.raises(PlanError, match="other blocks or decisions"):
        ShapeFit({4: a, 2: b})
    with pytest.raises(PlanError, match="two or more sizes"):
        ShapeFit({4: a})


def test_sizes_checked_with_flops_fit_profiles_timed_in_seconds():
    # the checks count FLOPs (the cheapest steps); the knots are timed: bytes are the same
    model, x = GPT(n=2, d=16), torch.randn(2, 32, 16)
    fit = ShapeFit({n: remat.profile(model, x[:, :n].clone(), repeats=1) for n in (8, 16, 32)})
    fit.refine(lambda n: remat.profile(model, x[:, :n].clone(), timer="flops"), limit=1)
    assert fit.knots == [8, 16, 24, 32]
    assert fit.at(20).cost_unit == "s"
