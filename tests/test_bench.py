"""Benchmark models and strategies (fast, in-process)."""

from __future__ import annotations

import pytest
import torch

from remat.bench.models import PRESETS, ModelConfig, build, example_input, param_bytes
from remat.bench.report import format_table
from remat.bench.runner import run, work
from remat.bench.strategies import DEEP, DEFAULT, registry

CFG = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_models_are_deterministic_and_return_a_scalar_loss(kind):
    cfg = ModelConfig(**{**CFG.__dict__, "model": kind})
    a, b = build(cfg), build(cfg)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    a.eval()
    x = example_input(cfg)
    assert a(x).shape == torch.Size([])
    assert torch.equal(a(x), a(x))
    assert param_bytes(a) == 4 * sum(p.numel() for p in a.parameters())


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="choose one of gpt, mlp"):
        build(ModelConfig(model="vit"))


def test_default_model_config_is_the_default_preset():
    assert PRESETS["default"].config() == ModelConfig()
    sizes = [
        estimate
        for estimate in (
            PRESETS[k].layers * PRESETS[k].d_model ** 2 * PRESETS[k].seq
            for k in ("quick", "default", "large")
        )
    ]
    assert sizes == sorted(sizes)  # quick < default < large


def test_every_cpu_strategy_gives_the_reference_gradients():
    reg = registry()
    strategies = [s for s in reg.values() if not s.device_only]
    result = run(CFG, strategies, device=torch.device("cpu"), steps=1, warmup=0)
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


def test_cpu_clock_times_one_thread_only():
    result = run(CFG, [registry()["none"]], device=torch.device("cpu"), steps=2, clock="cpu")
    assert result.clock == "cpu" and result.threads == 1 and result.rounds == 2
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="one thread"):
            run(CFG, [registry()["none"]], device=torch.device("cpu"), steps=1, clock="cpu")
    finally:
        torch.set_num_threads(1)  # the module's one_thread fixture puts the count back after it


def test_run_reports_its_calibration_and_progress_adds_up_to_the_work():
    strategies = [registry()[n] for n in ("none", "full", "auto-50%")]
    seen: list[tuple[str, float]] = []
    calibrations: list[tuple[float, float]] = []
    run(
        CFG,
        strategies,
        device=torch.device("cpu"),
        steps=2,
        progress=lambda label, weight: seen.append((label, weight)),
        calibrated=lambda step, wall: calibrations.append((step, wall)),
    )
    assert len(calibrations) == 1 and all(t > 0 for t in calibrations[0])
    assert sum(w for _, w in seen) == pytest.approx(work(strategies, 2))
    assert seen[0][0] == "configure none"  # calibration comes before any other work


def test_auto_strategy_falls_back_to_the_smallest_reachable_budget_with_a_note():
    from remat.bench.strategies import auto

    model = build(CFG)
    details = auto(model, example_input(CFG), pct=1)  # 1%: no plan reaches it
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
    x = example_input(CFG)
    for name in ("auto-50%", "auto-70%", "auto-floor-90%"):
        reg[name].configure(build(CFG), x)
    assert len(calls) == 1


def test_below_floor_strategy_plans_under_the_every_block_peak_or_says_it_cannot():
    import remat
    from remat.bench.strategies import auto_below_floor, floor_budget

    model, x = build(CFG), example_input(CFG)
    profiles: dict = {}
    details = auto_below_floor(model, x, pct=60, profiles=profiles)
    (prof,) = profiles.values()
    if details["note"] is None:
        peak = remat.measure_peak(model, x, set_to_none=False)
        assert peak + prof.scratch_bytes <= floor_budget(prof, 60)
    else:
        assert "no plan reaches 60% of the every-block activations" in details["note"]
        assert prof.floor_bytes + prof.scratch_bytes > floor_budget(prof, 60)


def test_device_strategies_give_the_reference_gradients_on_a_simulated_device():
    from simdevice import simulated_device

    reg = registry()
    strategies = [reg["none"]] + [s for s in reg.values() if s.device_only]
    assert {s.name for s in strategies} == {"none", "offload", "offload-blocks"}
    with simulated_device(0) as dev:
        rows = run(CFG, strategies, device=torch.device("cpu"), steps=1, warmup=0).rows
    assert [r.max_grad_diff for r in rows] == [0.0, 0.0, 0.0]
    assert dev.copies  # the offload engine copied through the simulated device


def test_device_runs_report_device_activation_bytes_and_host_bytes_apart():
    from types import SimpleNamespace

    from remat.bench.runner import device_and_host_peaks

    t = SimpleNamespace(peak_bytes=700, peak_bytes_by_device={"cuda:1": 500, "cpu": 200})
    assert device_and_host_peaks(t, torch.device("cuda", 1)) == (500, 200)
    assert device_and_host_peaks(t, torch.device("cpu")) == (700, 0)


def test_deep_preset_runs_the_floor_comparison_by_default():
    from remat.cli.bench import _strategies

    chosen, skipped = _strategies(None, torch.device("cpu"), "deep")
    assert [s.name for s in chosen] == list(DEEP) and skipped == []
    assert "torch-2nd" in DEEP and any(n.startswith("auto-floor-") for n in DEEP)
