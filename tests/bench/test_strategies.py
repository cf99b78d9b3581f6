"""The benchmark's strategies (remat.bench.strategies): reference gradients, plans, registry."""

from __future__ import annotations

import pytest
import torch

from remat.bench.models import build, example_input
from remat.bench.report import format_table
from remat.bench.runner import run
from remat.bench.strategies import DEEP, DEFAULT, registry
from tests.support.models import TINY_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_cpu_strategy_gives_the_reference_gradients():
    reg = registry()
    strategies = [s for s in reg.values() if not s.device_only]
    result = run(TINY_GPT, strategies, device=torch.device("cpu"), steps=1, warmup=0)
    rows = result.rows
    assert rows[0].strategy == "none" and result.reference == "none"
    for r in rows:
        assert r.max_grad_diff == 0.0, r.strategy
        assert len(r.step_times_s) == len(r.time_ratios) == 1
        assert r.ties  # every row has a tie letter
    by = {r.strategy: r for r in rows}
    assert (
        by["full"].activation_bytes < by["every-2nd"].activation_bytes < by["none"].activation_bytes
    )
    assert by["full"].activation_bytes == by["torch-full"].activation_bytes
    assert by["none"].time_ratio == 1.0 and by["none"].time_ratios == [1.0]
    for pct in (30, 50, 70):  # the planner's rows carry their plan
        details = by[f"auto-{pct}%"].details
        assert details["budget"] == f"{pct}%" and details["plan"]["decisions"]
    table = format_table(result)
    assert "strategy" in table and "spread" in table and "tie" in table


def test_auto_strategy_falls_back_to_the_smallest_reachable_budget_with_a_note():
    from remat.bench.strategies import auto

    model = build(TINY_GPT)
    details = auto(model, example_input(TINY_GPT), pct=1)  # 1%: no plan reaches it
    assert details["budget"] == "1%"
    assert (
        "no plan reaches 1%" in details["note"] and "smallest reachable budget" in details["note"]
    )
    assert any(d != "keep" for d in details["plan"]["decisions"].values())


def test_default_strategies_are_registered():
    reg = registry()
    assert set(DEFAULT) <= set(reg) and set(DEEP) <= set(reg)
    assert [s.name for s in reg.values() if s.plans] == [
        "auto-30%",
        "auto-50%",
        "auto-70%",
        "auto-floor-90%",
        "auto-floor-85%",
    ]


def test_auto_strategies_of_one_run_profile_the_model_once(monkeypatch):
    import remat

    calls = []
    real = remat.profile
    monkeypatch.setattr(remat, "profile", lambda *a, **k: calls.append(1) or real(*a, **k))
    reg = registry()
    x = example_input(TINY_GPT)
    for name in ("auto-50%", "auto-70%", "auto-floor-90%"):
        reg[name].configure(build(TINY_GPT), x)
    assert len(calls) == 1


def test_below_floor_strategy_plans_under_the_every_block_peak_or_says_it_cannot():
    import remat
    from remat.bench.strategies import auto_below_floor, floor_budget

    model, x = build(TINY_GPT), example_input(TINY_GPT)
    profiles: dict = {}
    details = auto_below_floor(model, x, pct=60, profiles=profiles)
    (prof,) = profiles.values()
    if details["note"] is None:
        peak = remat.measure_peak(model, x, set_to_none=False)
        assert peak + prof.scratch.bytes <= floor_budget(prof, 60)
    else:
        assert "no plan reaches 60% of the every-block activations" in details["note"]
        assert prof.floor_bytes + prof.scratch.bytes > floor_budget(prof, 60)


def test_device_strategies_give_the_reference_gradients_on_a_simulated_device():
    from tests.support.simdevice import simulated_device

    reg = registry()
    strategies = [reg["none"]] + [s for s in reg.values() if s.device_only]
    assert {s.name for s in strategies} == {"none", "offload", "offload-blocks"}
    with simulated_device(0) as dev:
        rows = run(TINY_GPT, strategies, device=torch.device("cpu"), steps=1, warmup=0).rows
    assert [r.max_grad_diff for r in rows] == [0.0, 0.0, 0.0]
    assert dev.copies  # the offload engine copied through the simulated device
