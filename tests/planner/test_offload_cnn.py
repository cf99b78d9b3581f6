"""The ``offload`` decision on a conv + BatchNorm residual CNN (gpu_check's planner model), on
the simulated device (tests/support/simdevice.py): every per-block plan against
``remat.measure_peak``.

Sizes make one activation (8 KiB here; 8 MiB in gpu_check) dwarf the small terms (BatchNorm's
statistics), so a tensor the step model counts wrong shows as a whole activation. The
blocks' output is ``relu``'s, which autograd saves as a new tensor on the same storage: the
tensor object dies while its storage lives on (what the profile's liveness checks read).

One pair effect remains, by design: an offloaded block's input dies with the block unless
the block before holds it (a kept block's ``relu`` does; a recomputed, split, selective or
offloaded one does not). The step model's terms are one per block and decision, so that
input is counted as held: exact after ``keep``, high by at most one activation per such
pair otherwise, never low.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from tests.support.plans import plan_of
from tests.support.simdevice import simulated_device
from tests.support.vision_models import BasicResBlock

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, CHANNELS, IMAGE = 4, 8, 16  # one activation: 4 * 8 * 16 * 16 * 4 = 32 KiB
ACT = BATCH * CHANNELS * IMAGE * IMAGE * 4


class CNN(nn.Module):
    """A stem, three residual blocks (the planner's candidates), pooling, a linear head."""

    def __init__(self, blocks: int = 3, c: int = CHANNELS) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(BasicResBlock(c, out_relu=True) for _ in range(blocks)))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.stem(x)))
        return self.head(h.mean((2, 3))).square().mean()


def _high_by(
    decisions: Sequence[str] | None = None,
    blocks: int = 3,
    channels: int = CHANNELS,
    batch: int = BATCH,
    image: int = IMAGE,
) -> dict[tuple[str, ...], int]:
    """Predicted minus measured peak of every per-block plan over ``decisions`` (all the
    profile offers by default) of a step with AdamW (negative: predicted low)."""
    torch.manual_seed(0)
    model = CNN(blocks, channels)
    x = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with simulated_device(0):
        prof = remat.profile(model, x, optimizer=opt, timer="flops", decisions=decisions)
        assert "offload" in prof.decisions
        out = {}
        for ds in itertools.product(prof.decisions, repeat=blocks):
            plan = plan_of(prof, ds)
            plan.apply(model)
            out[ds] = plan.predicted_peak_bytes - remat.measure_peak(model, x, optimizer=opt)
    return out


def _pairs(ds: Sequence[str]) -> int:
    """Offloaded blocks after a block that does not hold its output (anything but keep)."""
    return sum(d == "offload" and prev != "keep" for prev, d in zip(ds, ds[1:]))


def _check(high: dict[tuple[str, ...], int]) -> None:
    """Never low; exact but for the pair effect; high by at most an activation a pair."""
    assert {ds: h for ds, h in high.items() if h < 0} == {}
    assert {ds: h for ds, h in high.items() if h and not _pairs(ds)} == {}
    pairs = {ds: h for ds, h in high.items() if _pairs(ds)}
    assert all(h <= _pairs(ds) * ACT for ds, h in pairs.items()), pairs


def test_keep_recompute_offload_plans_of_a_residual_cnn_are_never_low_and_exact_but_for_pairs():
    high = _high_by(["keep", "recompute", "offload"])
    assert len(high) == 27
    _check(high)
    # low by a whole activation before: block 0's input (the stem's relu output, held by
    # the stem's saved output alone) was counted freed when the forward returned
    assert high[("offload", "keep", "keep")] == 0
    assert high[("offload", "recompute", "keep")] == 0
    assert high[("keep", "offload", "keep")] == 0  # high by 0.21 activations before
    # the pair effect: the recomputed block does not hold its output, the offloaded block
    # after it frees it, the step model counts it held
    assert high[("recompute", "offload", "keep")] == ACT


@pytest.mark.slow
def test_every_per_block_plan_of_a_residual_cnn_is_never_low_and_exact_but_for_pairs():
    high = _high_by()
    assert len(high) == 125  # keep, recompute, selective, offload, split
    _check(high)
    assert high[("offload", "split", "keep")] == 0  # low by one activation before
    assert high[("selective", "offload", "keep")] == ACT  # selective saves no relu output


def test_gpu_checks_tiny_cnn_offload_plans_are_never_predicted_low():
    # gpu_check's dry-run sizes (two blocks, batch 2, 4 channels of 8x8): four
    # (offload, x) plans were low by 320-496 B (block 0's input counted freed)
    high = _high_by(blocks=2, channels=4, batch=2, image=8)
    assert len(high) == 25
    assert {ds: h for ds, h in high.items() if h < 0} == {}
    assert {ds: h for ds, h in high.items() if h and not _pairs(ds)} == {}
