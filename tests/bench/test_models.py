"""The built-in benchmark models (remat.bench.models)."""

from __future__ import annotations

import pytest
import torch

from remat.bench.models import PRESETS, ModelConfig, build, example_input, param_bytes
from tests.support.models import TINY_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_models_are_deterministic_and_return_a_scalar_loss(kind):
    cfg = ModelConfig(**{**TINY_GPT.__dict__, "model": kind})
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
