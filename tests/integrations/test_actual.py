"""Plan vs actual (remat.integrations.actual) and MemoryTracker.include: exact bytes per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import remat
from remat.integrations import PeakCheck, PeakMeter

pytestmark = pytest.mark.usefixtures("one_thread")


def blocks(depth: int = 3, d: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(depth)]
    )


def make_optimizer(kind: str | None, model: nn.Module) -> torch.optim.Optimizer | None:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return None


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def default_loop_step(model, x, optimizer, set_to_none):
    """One step of the planner's default loop, the output held to the end as measure_peak does."""
    for p in model.parameters():
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.detach_().zero_()
    out = model(x)
    loss = loss_of(out)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    del out, loss


@pytest.mark.parametrize(
    "optimizer,set_to_none",
    [
        (None, True),  # forward and backward only
        ("adamw", True),  # optimizer state created in the first measured step
        ("adamw", False),  # gradients kept between steps (accumulation)
        ("sgd-momentum", True),  # a momentum buffer, gradients freed by the next step
    ],
)
def test_meter_peak_equals_measure_peak_of_the_same_loop(optimizer, set_to_none):
    model = blocks()
    opt = make_optimizer(optimizer, model)
    x = torch.randn(8, 16)
    expected = remat.measure_peak(model, x, optimizer=opt, set_to_none=set_to_none, loss_fn=loss_of)
    if not set_to_none:  # the loop's gradients exist before its first step
        loss_of(model(x)).backward()
    meter = PeakMeter(budget=expected)
    for _ in range(2):
        with meter.step(model, x, optimizer=opt):
            default_loop_step(model, x, opt, set_to_none)
    assert max(c.peak_bytes for c in meter.checks) == expected
    assert [c.step for c in meter.checks] == [0, 1]
    assert all(c.source == "tensors" and not c.over_budget for c in meter.checks)


def test_meter_counts_the_plans_prediction_and_budget():
    model = blocks(depth=4)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 16)
    plan = remat.auto_checkpoint(model, x, budget="60%", optimizer=opt, timer="flops")
    meter = PeakMeter(plan)
    with meter.step(model, x, optimizer=opt):
        default_loop_step(model, x, opt, True)
    check = meter.last
    assert check.predicted_bytes == plan.predicted_peak_bytes
    assert check.budget_bytes == plan.budget_bytes
    assert check.peak_bytes <= plan.budget_bytes
    assert check.logs() == {
        "remat/peak_bytes": check.peak_bytes,
        "remat/predicted_bytes": plan.predicted_peak_bytes,
        "remat/budget_bytes": plan.budget_bytes,
    }


def test_step_over_the_budget_warns_and_is_flagged():
    model = blocks()
    x = torch.randn(8, 16)
    meter = PeakMeter(budget=1000)
    with pytest.warns(RuntimeWarning, match="over the budget of 1000 bytes"):
        with meter.step(model, x):
            loss_of(model(x)).backward()
    assert meter.last.over_budget
    assert "(OVER)" in str(meter.last)


def test_inputs_included_again_are_counted_once():
    x = torch.randn(100)  # 400 bytes
    meter = PeakMeter()
    model = nn.Linear(1, 1, bias=False)  # 4 bytes
    meter.start(model, x)
    meter.include(x, [x, {"again": x[:10]}], 3, None)
    check = meter.stop()
    assert check.peak_bytes == 404


def test_exception_inside_a_step_closes_the_meter_and_leaves_no_check():
    meter = PeakMeter()
    with pytest.raises(ZeroDivisionError):
        with meter.step(nn.Linear(2, 2)):
            raise ZeroDivisionError
    assert not meter.running and meter.checks == []
    assert _get_current_dispatch_mode_stack() == []


def test_start_twice_and_stop_without_start_raise():
    meter = PeakMeter()
    with pytest.raises(RuntimeError, match="call start"):
        meter.stop()
    meter.start(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="being measured already"):
        meter.start(nn.Linear(2, 2))
    meter.close()
    assert _get_current_dispatch_mode_stack() == []


@pytest.mark.parametrize("budget", [0, -5, 1.5, "1GiB", True])
def test_meter_rejects_a_budget_that_is_not_positive_bytes(budget):
    with pytest.raises(ValueError, match="budget must be a positive number of bytes"):
        PeakMeter(budget=budget)


def test_reset_peak_forgets_work_before_the_step():
    model = nn.Linear(4, 4, bias=False)  # 64 bytes
    meter = PeakMeter()
    meter.start(model)
    big = torch.empty(1000)  # not the step's: freed before it
    del big
    meter.reset_peak()
    small = torch.empty(10)
    assert meter.stop().peak_bytes == 64 + 40
    del small


def test_check_str_without_plan_shows_only_the_peak():
    check = PeakCheck(
        step=3, peak_bytes=2**20, predicted_bytes=None, budget_bytes=None, source="tensors"
    )
    assert str(check) == "step 3: peak 1.00 MiB"
    assert check.logs(prefix="") == {"peak_bytes": 2**20}
    assert not check.over_budget


def test_tracker_include_counts_existing_storages_until_they_die():
    w = torch.zeros(100)  # 400 bytes, allocated before the context
    with remat.memory.track() as t:
        assert t.include([w, w.view(10, 10)]) == 400  # a view: one storage
        assert t.include([w]) == 0  # included before
        y = torch.ones(25)  # 100 bytes, counted as allocated
        assert t.include([y]) == 0  # allocated inside: counted already
        del w
        assert t.current_bytes == 100
    assert t.peak_bytes == 500
    del y


def test_tracker_include_skips_other_devices_and_non_tensors():
    with remat.memory.track("cuda:0") as t:  # counts that device only: CPU tensors skipped
        assert t.include([torch.zeros(10), "x", None, torch.empty(4, device="meta")]) == 0
    assert t.peak_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_meter_reads_the_allocator_on_cuda():
    model = blocks().cuda()
    x = torch.randn(8, 16, device="cuda")
    meter = PeakMeter()
    torch.cuda.synchronize()
    with meter.step(model, x):
        default_loop_step(model, x, None, True)
    torch.cuda.synchronize()
    assert meter.last.source == "allocator"
    assert meter.last.peak_bytes == torch.cuda.max_memory_allocated()
