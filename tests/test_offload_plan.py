"""The planner's ``offload`` decisions on a device, checked on the simulated device
(tests/simdevice.py): offloaded tensors live in host buffers out of the meter's sight, as
pinned host memory is out of ``torch.cuda.max_memory_allocated``'s."""

from __future__ import annotations

import copy
import itertools

import torch
from simdevice import simulated_device
from spanmodels import GPT

import remat
from remat.planner.apply import apply_decision


def _blocks(model: torch.nn.Module, prof: remat.Profile) -> list[torch.nn.Module]:
    return [model.get_submodule(b.name) for b in prof.blocks]


def test_offload_is_offered_where_offload_moves_tensors_off_the_device():
    model, x = GPT(n=2), torch.randn(2, 8, 16)
    assert "offload" not in remat.profile(model, x, timer="flops").decisions  # CPU
    with simulated_device(0):
        assert "offload" in remat.profile(model, x, timer="flops").decisions


def test_every_per_block_offload_plan_is_predicted_exactly_on_a_device():
    torch.manual_seed(0)
    with simulated_device(0):
        model = GPT(n=3)
        x = torch.randn(2, 8, 16, requires_grad=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        prof = remat.profile(
            model, x, optimizer=opt, timer="flops", decisions=["keep", "recompute", "offload"]
        )
        assert all(b.retained["offload"] < b.retained["keep"] for b in prof.blocks)
        wrong = []
        for ds in itertools.product(["keep", "recompute", "offload"], repeat=3):
            for b, d in zip(_blocks(model, prof), ds):
                apply_decision(b, d)
            measured = remat.measure_peak(model, x, optimizer=opt)
            if prof.peak(list(ds)).bytes != measured:
                wrong.append((ds, prof.peak(list(ds)).bytes - measured))
        assert not wrong


def test_auto_checkpoint_plans_offload_on_a_device_within_budget_bitwise():
    torch.manual_seed(0)
    with simulated_device(0):
        model = GPT(n=4)
        ref = copy.deepcopy(model)
        x = torch.randn(16, 32, 16, requires_grad=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        prof = remat.profile(
            model, x, optimizer=opt, timer="flops", decisions=["keep", "recompute", "offload"]
        )
        plan = remat.auto_checkpoint(
            model, x, budget="50%", optimizer=opt, timer="flops", profile=prof
        )
        assert "offload" in plan.decisions.values()  # offload costs no FLOPs: chosen first
        assert remat.measure_peak(model, x, optimizer=opt) <= plan.budget_bytes
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.manual_seed(3)
            o.zero_grad()
            m(x).backward()
            o.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.equal(a, b)
