"""Where shapes alone cannot profile a model, auto_checkpoint fits its profile from real
profiles at two smaller batches (remat.planner.shaped.batch_pairs: the largest halvings
whose unchecked steps are predicted within the budget) instead of running its unchecked
step (#31 item 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.inputs import Inputs
from remat.planner.loop import Loop
from remat.planner.progress import Progress
from remat.planner.shaped import ProfileSource, batch_knots, batch_pairs
from remat.planner.shapefit import terms

pytestmark = pytest.mark.usefixtures("one_thread")


class Routed(nn.Module):
    """A block whose work depends on its input's values (a mixture of experts' routing, in
    small): shapes alone cannot profile it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pick = int((x.sum() > 0).item())
        return self.c(torch.relu((self.a if pick else self.b)(x))) + x


def _routed() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*[Routed() for _ in range(4)]), torch.randn(64, 16, requires_grad=True)


def _byte_terms(prof: remat.Profile) -> dict[str, int | float]:
    return {k: v for k, v in terms(prof).items() if "scratch" not in k}


def _fitted(model: nn.Module, x: torch.Tensor, loop: Loop, why: str) -> remat.Profile:
    source = ProfileSource(
        model, loop, agree=False, device=None, say=Progress("test", True), within=True
    )
    source.why = why  # as a model that shapes alone do not profile
    return source(Inputs(x))


@pytest.mark.parametrize("which", ["routed", "gpt"])
def test_a_profile_fitted_from_a_quarter_and_a_half_of_the_batch_equals_the_real_one(which):
    if which == "routed":
        model, x = _routed()
    else:
        cfg = ModelConfig(layers=3, d_model=64, seq=64, batch=16, heads=4, vocab=128)
        model, x = build(cfg), example_input(cfg)
    opt = torch.optim.AdamW(model.parameters())
    loop = Loop(opt, timer="flops")
    fitted = _fitted(model, x, loop, "a test")
    real = remat.profile(model, x, optimizer=opt, timer="flops")
    assert _byte_terms(fitted) == _byte_terms(real)
    assert fitted.input_shapes == real.input_shapes
    # the scratch is measured under the plan, as for a profile from shapes
    assert fitted.from_shapes and fitted.scratch.bytes == 0


def test_auto_checkpoint_of_a_routed_model_runs_no_step_at_the_whole_batch_unchecked(capsys):
    model, x = _routed()
    opt = torch.optim.AdamW(model.parameters())
    unchecked = remat.measure_peak(model, x, optimizer=opt)
    with remat.memory.track() as t:  # every tensor any step inside allocates
        p = remat.auto_checkpoint(model, x, budget="80%", optimizer=opt, timer="flops")
    err = capsys.readouterr().err
    assert "profiling real steps in pair steps at batches 2, 4 and fitting batch 64" in err
    assert "at batches 16, 32 too" in err  # within 80 %: the largest pair
    assert "Tensor.item() cannot be called on meta tensors" in err
    assert p.budget_bytes < unchecked
    static = sum(q.nbytes for q in model.parameters()) + x.nbytes
    assert static + t.peak_bytes <= p.budget_bytes + static
    assert remat.measure_peak(model, x, optimizer=opt) == p.predicted_peak_bytes


def test_a_low_budget_profiles_smaller_batches_and_no_step_holds_more_than_it(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(*[Routed() for _ in range(16)])
    x = torch.randn(1024, 16, requires_grad=True)
    half = remat.measure_peak(model, x[:512].detach().requires_grad_())
    with remat.memory.track() as t:  # every tensor any step inside allocates
        p = remat.auto_checkpoint(model, x, budget="35%", timer="flops")
    err = capsys.readouterr().err
    static = sum(q.nbytes for q in model.parameters()) + x.nbytes
    assert half > p.budget_bytes  # the quarter-and-half pair's unchecked step: over it
    assert "at batches 256, 512" not in err and "at batches 128, 256 too" in err
    assert static + t.peak_bytes <= p.budget_bytes  # every step inside: within the budget
    assert remat.measure_peak(model, x) <= p.budget_bytes


def test_a_batch_of_four_to_seven_is_fitted_from_batches_of_two_and_three(capsys):
    model, x = _routed()
    remat.auto_checkpoint(model, x[:6].detach().clone(), budget="100%", timer="flops")
    err = capsys.readouterr().err
    assert "profiling real steps in pair steps at batches 2, 3 and fitting batch 6" in err


def test_a_batch_too_small_to_cut_is_profiled_from_pair_steps_and_says_so(capsys):
    # at the whole batch, never its unchecked step (tests/planner/test_paired.py)
    model, x = _routed()
    remat.auto_checkpoint(model, x[:3].detach(), budget="100%", timer="flops")
    err = capsys.readouterr().err
    assert "profiling real steps, one or two blocks kept at a time (never the unchecked step)" in err
    assert "the unchecked step among them" not in err


@pytest.mark.parametrize("batch", [4, 5, 7])
def test_a_gpt_profile_fitted_from_batches_of_two_and_three_equals_the_real_one(batch):
    cfg = ModelConfig(layers=2, d_model=32, seq=32, batch=batch, heads=4, vocab=64)
    model, x = build(cfg), example_input(cfg)
    opt = torch.optim.AdamW(model.parameters())
    fitted = _fitted(model, x, Loop(opt, timer="flops"), "a test")
    real = remat.profile(model, x, optimizer=opt, timer="flops")
    assert _byte_terms(fitted) == _byte_terms(real)


def test_batch_pairs_are_consecutive_halvings_of_at_least_two():
    assert batch_pairs((torch.zeros(64, 3),)) == [(2, 4), (4, 8), (8, 16), (16, 32)]
    assert batch_pairs((torch.zeros(9, 3), torch.zeros(9))) == [(2, 4)]
    assert batch_pairs((torch.zeros(7, 3),)) == [(2, 3)]
    assert batch_pairs((torch.zeros(4, 3),)) == [(2, 3)]
    assert batch_pairs((torch.zeros(3, 3),)) == []
    assert batch_pairs((3, "no tensors")) == []
    assert batch_knots((torch.zeros(64, 3),)) == [16, 32]
    assert batch_knots((torch.zeros(3, 3),)) is None
