"""Benchmark models and strategies (fast, in-process)."""

from __future__ import annotations

import pytest
import torch

from remat.bench.models import ModelConfig, build, example_input, param_bytes
from remat.bench.runner import format_table, run
from remat.bench.strategies import registry

CFG = ModelConfig(layers=3, d_model=32, seq=16, batch=2, heads=2, vocab=64)


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


def test_every_cpu_strategy_gives_the_reference_gradients():
    reg = registry()
    strategies = [s for s in reg.values() if not s.device_only]
    rows = run(CFG, strategies, device=torch.device("cpu"), steps=1, warmup=0)
    assert rows[0].strategy == "none"
    for r in rows:
        assert r.max_grad_diff == 0.0, r.strategy
    by = {r.strategy: r for r in rows}
    assert (
        by["full"].activation_bytes < by["every-2nd"].activation_bytes < by["none"].activation_bytes
    )
    assert by["full"].activation_bytes == by["torch-full"].activation_bytes
    assert "strategy" in format_table(rows)


def test_device_strategies_give_the_reference_gradients_on_a_simulated_device():
    from simdevice import simulated_device

    reg = registry()
    strategies = [reg["none"]] + [s for s in reg.values() if s.device_only]
    assert {s.name for s in strategies} == {"none", "offload", "offload-blocks"}
    with simulated_device(0) as dev:
        rows = run(CFG, strategies, device=torch.device("cpu"), steps=1, warmup=0)
    assert [r.max_grad_diff for r in rows] == [0.0, 0.0, 0.0]
    assert dev.copies  # the offload engine copied through the simulated device


def test_device_runs_report_device_activation_bytes_and_host_bytes_apart():
    from types import SimpleNamespace

    from remat.bench.runner import device_and_host_peaks

    t = SimpleNamespace(peak_bytes=700, peak_bytes_by_device={"cuda:1": 500, "cpu": 200})
    assert device_and_host_peaks(t, torch.device("cuda", 1)) == (500, 200)
    assert device_and_host_peaks(t, torch.device("cpu")) == (700, 0)
