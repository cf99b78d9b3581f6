"""The device calibration (remat.planner.calibration) and the cost model that prices counted
work with it (remat.planner.timing.modelled_costs)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import remat
from remat.planner.calibration import (
    Constants,
    cache_file,
    calibrate,
    constants,
    device_key,
    on_grid,
    store,
)
from remat.planner.counting import count_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
#: Made-up constants, far from any machine's, to see that the cache is what prices work.
FIXED = Constants(
    mm_rate=2.0**30,
    conv_rate=2.0**29,
    byte_rate=2.0**28,
    random_rate=2.0**24,
    per_op=2.0**-10,
    saved_op=2.0**-9,
    recomputed_op=2.0**-8,
    region=2.0**-6,
    selective_region=2.0**-5,
    host_rate=2.0**28,
)


def test_on_grid_rounds_to_powers_of_the_fourth_root_of_two():
    for v in (1e-7, 3.3e-5, 1.0, 7.7e10):
        g = on_grid(v)
        assert on_grid(g) == g
        assert abs(math.log2(g / v)) <= 1 / 8 + 1e-12
        assert (math.log2(g) * 4) == pytest.approx(round(math.log2(g) * 4))
    assert on_grid(0.0) == 0.0 and on_grid(-1.0) == 0.0


def test_the_first_calibration_kept_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    key = device_key(CPU, torch.float32, 1)
    other = dataclasses.replace(FIXED, per_op=1.0)
    assert store(key, FIXED) == FIXED
    assert store(key, other) == FIXED  # a second writer reads the kept one
    assert json.loads(cache_file(key).read_text())["key"] == key
    assert constants(CPU, torch.float32, 1) == FIXED  # read, not calibrated again


def test_calibration_is_on_the_grid_and_leaves_threads_rng_and_grad_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    rng = torch.get_rng_state()
    with torch.no_grad():
        made = calibrate(CPU, torch.float32, 1)
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == 1
    values = dataclasses.asdict(made)
    assert all(v > 0 for k, v in values.items() if k not in ("region", "selective_region"))
    assert all(on_grid(v) == v for v in values.values())
    # a matmul does more work per second than a pointwise operator moves bytes
    assert made.mm_rate > made.byte_rate / 4 > made.random_rate / 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.relu(self.fc(x)), 0.1) + x


def test_modelled_costs_price_counted_operators_with_the_cached_constants(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    store(device_key(CPU, torch.float32, 1), FIXED)
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(16, 32)
    prof = remat.profile(model, x, decisions=["keep", "recompute", "selective"])
    _, counts = count_blocks(model, {"0": model[0], "1": model[1]}, (x,), {})
    calls = counts["0"]
    k = FIXED
    again = sum(k.op_seconds(c.kind, c.flops, c.bytes) + k.per_op for c in calls) + k.region
    sel = k.selective_region + sum(
        k.saved_op if c.saved else k.op_seconds(c.kind, c.flops, c.bytes) + k.recomputed_op
        for c in calls
    )
    for b in prof.blocks:
        assert b.cost["keep"] == 0.0
        assert b.cost["recompute"] == pytest.approx(again, rel=1e-12)
        assert b.cost["selective"] == pytest.approx(sel, rel=1e-12)
        assert b.noise == {"keep": 0.0, "recompute": 0.0, "selective": 0.0}
    assert prof.cost_unit == "s" and prof.step_cost > 0


def test_modelled_profiles_of_one_model_are_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), _Block())
    x = torch.randn(16, 32)
    a = remat.profile(model, x, optimizer=torch.optim.AdamW(model.parameters()))
    b = remat.profile(model, x, optimizer=torch.optim.AdamW(model.parameters()))
    assert [blk.cost for blk in a.blocks] == [blk.cost for blk in b.blocks]
    assert a.step_cost == b.step_cost


def test_measured_timer_times_blocks_with_noise():
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    prof = remat.profile(model, torch.randn(16, 32), timer="measured", repeats=2)
    assert prof.cost_unit == "s" and prof.step_cost > 0
    assert all(b.cost["recompute"] >= 0 and "recompute" in b.noise for b in prof.blocks)


def test_unknown_timer_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"timer must be one of \['time', 'measured', 'flops'\]"):
        remat.profile(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2), timer="wall")


_CALIBRATE = """
import json, sys, torch
torch.set_num_threads(1)
from remat.planner.calibration import constants
print(json.dumps(constants(torch.device("cpu"), torch.float32, 1).__dict__))
"""


@pytest.mark.slow
def test_processes_calibrating_at_once_share_one_calibration(tmp_path):
    env = {"REMAT_CACHE_DIR": str(tmp_path), "PYTHONPATH": ":".join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CALIBRATE], stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({o.strip() for o in outs}) == 1, outs
    assert len(list(tmp_path.glob("calibration-*.json"))) == 1


def test_batch_norm_is_priced_at_its_own_rate_and_at_the_byte_rate_by_older_calibrations():
    from remat.planner.counting import count_call

    x = torch.randn(4, 8, 16, 16)
    calls = count_call(
        lambda: torch.nn.functional.batch_norm(x, None, None, training=True)  # statistics
    )
    (bn,) = [c for c in calls if "batch_norm" in c.op]
    assert bn.kind == "norm" and bn.bytes > 0
    with_rate = dataclasses.replace(FIXED, norm_rate=2.0**26)
    assert with_rate.op_seconds(bn.kind, bn.flops, bn.bytes) == bn.bytes / 2.0**26
    # a calibration made before the rate (0: not measured) prices it as a pointwise call
    assert FIXED.norm_rate == 0.0
    assert FIXED.op_seconds(bn.kind, bn.flops, bn.bytes) == bn.bytes / FIXED.byte_rate
    # the calibration measures it
    assert calibrate(CPU, torch.float32, 1).norm_rate > 0
