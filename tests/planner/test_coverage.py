"""The share of the unchecked step's activations the candidate blocks keep
(remat.planner.stepmodel.block_share, remat.planner.render), the warning that names check_fn, and the blocks' names in ranges."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.planner.render import LOW_SHARE, coverage_note, name_ranges
from remat.planner.stepmodel import block_share
from tests.support.vision_models import UNet

pytestmark = pytest.mark.usefixtures("one_thread")


def test_blocks_of_one_stack_of_five_get_a_warning_naming_check_fn():
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(0)
    every = remat.profile(UNet(), x, timer="flops", decisions=["keep"])
    torch.manual_seed(0)
    # the old default's choice: the first container's blocks only
    first = remat.profile(
        UNet(), x, timer="flops", decisions=["keep"],
        check_fn=lambda name, m: name in ("down.0.0", "down.0.1"),
    )  # fmt: skip
    assert block_share(every) > 0.9 and coverage_note(block_share(every)) is None
    assert block_share(first) < LOW_SHARE
    kept = sum(b.retained["keep"] for b in first.blocks)
    assert block_share(first) == kept / (first.top - first.top_grads)
    note = coverage_note(block_share(first))
    assert note is not None and "check_fn=lambda name, module" in note
    assert f"keep {100 * block_share(first):.0f}%" in note


def test_name_ranges_join_consecutive_indices_of_one_stack():
    names = [f"layer{s}.{i}" for s in range(1, 3) for i in range(2)] + ["head", "x.3", "x.5"]
    assert name_ranges(names) == "layer1.0-1, layer2.0-1, head, x.3, x.5"
    assert name_ranges([]) == ""
