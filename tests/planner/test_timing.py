"""Timing a step's blocks (remat.planner.timing): wall time per block, or the FLOPs a
decision recomputes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.bench.models import build, example_input
from tests.support.models import SMALL_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


def test_time_profile_has_positive_costs_and_step_cost():
    model = build(SMALL_GPT)
    prof = remat.profile(model, example_input(SMALL_GPT), repeats=1, set_to_none=False)
    assert prof.cost_unit == "s" and prof.step_cost > 0
    assert all(b.cost["keep"] == 0.0 and b.cost["recompute"] >= 0.0 for b in prof.blocks)
    assert all(
        b.retained["recompute"] < b.retained["selective"] < b.retained["keep"] for b in prof.blocks
    )


def test_profile_at_current_threads_uses_wall_time():
    prof = remat.profile(build(SMALL_GPT), example_input(SMALL_GPT), repeats=1, threads=None, set_to_none=False)
    assert prof.step_cost > 0 and all(b.cost["recompute"] >= 0 for b in prof.blocks)


class _GRUChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.GRU(16, 16, batch_first=True) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return x


def test_flops_cost_of_selective_counts_the_matmuls_the_policy_recomputes():
    # nn.GRU's hidden-state addmm outputs are changed in place (unsafe_split chunks), so the
    # planner's PREFER_SAVE policy recomputes them: one of the two addmm a step, half the
    # block's FLOPs. The FLOPs cost of "selective" counted no matmul at all (0)
    prof = remat.profile(_GRUChain(), torch.randn(4, 8, 16), timer="flops")
    for b in prof.blocks:
        assert b.cost["recompute"] == 8 * 2 * (2 * 4 * 16 * 48)  # 8 steps, 2 addmm each
        assert b.cost["selective"] == b.cost["recompute"] / 2
