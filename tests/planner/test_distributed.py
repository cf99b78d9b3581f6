"""The agreement helpers of remat.planner.distributed, in one process (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from remat.planner.distributed import (
    active,
    agree_max,
    agree_min,
    agree_profile,
    agree_same,
    profile_numbers,
    set_profile_numbers,
    structure,
)


@pytest.fixture(scope="module")
def prof():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    return remat.profile(model, torch.randn(8, 16), timer="flops")


def test_profile_numbers_round_trip_to_an_equal_profile(prof):
    ints, floats = profile_numbers(prof)
    assert set_profile_numbers(prof, ints, floats) == prof


def test_elementwise_max_of_two_rank_profiles_takes_each_largest_number(prof):
    other = dataclasses.replace(prof, top=prof.top + 7, pre=prof.pre - 3)
    other.blocks = [dataclasses.replace(b) for b in prof.blocks]
    other.blocks[1] = dataclasses.replace(
        prof.blocks[1], cost={**prof.blocks[1].cost, "recompute": 1e12}
    )
    assert structure(other) == structure(prof)  # same blocks and decisions: combinable
    (a_i, a_f), (b_i, b_f) = profile_numbers(prof), profile_numbers(other)
    combined = set_profile_numbers(
        prof, [max(x, y) for x, y in zip(a_i, b_i)], [max(x, y) for x, y in zip(a_f, b_f)]
    )
    assert combined.top == prof.top + 7
    assert combined.pre == prof.pre  # the other rank's smaller number loses
    assert combined.blocks[1].cost["recompute"] == 1e12
    assert combined.blocks[0] == prof.blocks[0]
    assert prof.top == other.top - 7  # the input was not changed


def test_structure_differs_when_blocks_differ(prof):
    fewer = dataclasses.replace(prof, blocks=prof.blocks[:2])
    assert structure(fewer) != structure(prof)


def test_without_a_process_group_agreement_changes_nothing(prof):
    assert not active()
    assert agree_profile(prof) is prof
    assert agree_max([3, 1]) == [3, 1]
    assert agree_min([3, 1]) == [3, 1]
    agree_same({"a": 1}, "anything")  # no raise


def test_distributed_true_without_a_process_group_raises():
    with pytest.raises(RuntimeError, match="init_process_group"):
        active(True)
    assert not active(False)


def test_watched_storages_shrink_before_they_grow():
    a, b = torch.empty(100), torch.empty(0)  # 400 bytes, 0 bytes
    with remat.memory.track() as t:
        t.watch([a.untyped_storage(), b.untyped_storage()])
        a.untyped_storage().resize_(0)  # freed, then another gathered, no operator between
        b.untyped_storage().resize_(400)
        c = torch.ones(10)
    assert t.peak_bytes == 40  # the -400 and +400 net out before the new tensor's 40
    assert t.current_bytes == 40
    del c


def test_a_profile_with_the_autocast_terms_round_trips_and_differs_in_structure():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = remat.profile(model, torch.randn(8, 16, requires_grad=True), timer="flops")
    assert amp.blocks[-1].pre_exit and any(b.exit_freed for b in amp.blocks)
    ints, floats = profile_numbers(amp)
    assert set_profile_numbers(amp, ints, floats) == amp
    plain = remat.profile(model, torch.randn(8, 16, requires_grad=True), timer="flops")
    assert structure(amp) != structure(plain)  # ranks must not mix them


def test_structure_differs_when_the_shared_block_inputs_differ(prof):
    # numbers are combined key by key: ranks that saw other shared inputs cannot be
    shared = dataclasses.replace(prof.shared, inputs={**prof.shared.inputs, "0,1>2": 64})
    other = dataclasses.replace(prof, shared=shared)
    assert structure(other) != structure(prof)
    same_keys = dataclasses.replace(prof.shared, inputs={k: v + 8 for k, v in shared.inputs.items()})
    assert structure(dataclasses.replace(prof, shared=same_keys)) == structure(other)
