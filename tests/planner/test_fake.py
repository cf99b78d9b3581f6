"""Profiles from shapes inside torch.autocast (#31 item 1): a fake twin of a real model
(remat.planner.fake) has the byte terms of the real step's, so auto_checkpoint plans a model
under the mixed-precision recipe without running its unchecked step."""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner import measure
from remat.planner.fake import check_fakeable, fake_mode_of, fake_twin, on_fake
from remat.planner.inputs import Inputs
from remat.planner.loop import Loop
from remat.planner.meta import AutocastInForward
from tests.support.families import (
    GRUModel,
    MobileNet,
    RotaryLM,
    SDPABlock,
    TiedLM,
    TokenLM,
    Towers,
    UNet,
    ViT,
    class_loss,
    token_loss,
    tokens,
)

pytestmark = pytest.mark.usefixtures("one_thread")

GPT = ModelConfig(layers=4, d_model=64, seq=128, batch=2, heads=4, vocab=128)


def _region() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _bytes_of(prof: remat.Profile) -> dict[str, Any]:
    """Every term of a profile but its scratch (a fake step shows none) and where it was
    made."""

    def keep(key: str) -> bool:
        return not any(s in key for s in ("scratch", "from_shapes", "device"))

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if keep(k)}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    out: dict[str, Any] = strip(json.loads(prof.to_json()))
    return out


def _twin_profile(model: nn.Module, args: tuple[Any, ...], opt: Any, loss: Any) -> remat.Profile:
    fake, fake_opt, mode = fake_twin(model, opt)
    a, k = on_fake(mode, (args, {}))
    return measure.profile_loop(fake, Inputs(*a, **k), Loop(fake_opt, loss_fn=loss, timer="flops"))


CASES = {
    "gpt": lambda: (build(GPT), (example_input(GPT),), None),
    "vit": lambda: (ViT(), (torch.randn(8, 3, 16, 16),), class_loss),
    "rotary-mask": lambda: (
        RotaryLM(), (tokens(shape=(8, 64)), torch.ones(8, 64, dtype=torch.bool)), token_loss
    ),
    "tied-layernorm": lambda: (TiedLM(), (tokens(shape=(8, 16)),), token_loss),
    "batchnorm-cnn": lambda: (MobileNet(), (torch.randn(8, 3, 16, 16),), class_loss),
    "groupnorm-unet": lambda: (UNet(), (torch.randn(8, 3, 32, 32),), None),
    "two-towers": lambda: (Towers(), (torch.randn(128, 32), torch.randn(128, 32)), None),
    "sdpa-dropout": lambda: (TokenLM(SDPABlock), (tokens(shape=(4, 32)),), token_loss),
}


#: The cases the default run takes (each is 3-4 s); the others run with the slow tests.
DEFAULT_CASES = ("gpt", "tied-layernorm", "groupnorm-unet", "two-towers")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n in DEFAULT_CASES else [pytest.mark.slow]) for n in CASES],
)
def test_a_fake_twins_profile_under_autocast_has_the_real_steps_bytes(name):
    torch.manual_seed(0)
    model, args, loss = CASES[name]()
    opt = torch.optim.AdamW(model.parameters())
    with _region():
        real = remat.profile(model, *args, optimizer=opt, loss_fn=loss, timer="flops")
        fake = _twin_profile(model, args, opt, loss)
    assert fake.from_shapes and not real.from_shapes
    assert _bytes_of(fake) == _bytes_of(real)  # and the FLOPs each decision recomputes


def _with_scratch_of(prof: remat.Profile, real: remat.Profile) -> remat.Profile:
    """``prof`` with ``real``'s scratch inside operators (block and step terms)."""
    blocks = [
        dataclasses.replace(b, fwd_scratch=r.fwd_scratch, bwd_scratch=r.bwd_scratch)
        for b, r in zip(prof.blocks, real.blocks)
    ]
    return dataclasses.replace(prof, blocks=blocks, from_shapes=False, scratch=real.scratch)


def test_auto_checkpoint_under_autocast_runs_no_unchecked_step(capsys):
    model, x = build(GPT), example_input(GPT)
    opt = torch.optim.AdamW(model.parameters())
    with _region():
        unchecked = remat.measure_peak(model, x, optimizer=opt)
        with remat.memory.track() as t:  # every tensor any step inside allocates
            p = remat.auto_checkpoint(model, x, budget="50%", optimizer=opt, timer="flops")
    err = capsys.readouterr().err
    assert "a fake copy of the model, for autocast" in err and "profiling real steps" not in err
    params = sum(q.nbytes for q in model.parameters())
    assert p.budget_bytes < unchecked
    assert params + x.nbytes + t.peak_bytes_by_device["cpu"] <= p.budget_bytes + params


def test_a_plan_made_from_a_fake_twin_equals_the_plan_made_from_real_steps():
    torch.manual_seed(0)
    model, x = build(GPT), example_input(GPT)
    opt = torch.optim.AdamW(model.parameters())
    with _region():
        real = remat.profile(model, x, optimizer=opt, timer="flops")
        fake = _twin_profile(model, (x,), opt, None)
    # the scratch inside operators that auto_checkpoint measures in a real step of the plan
    fake = _with_scratch_of(fake, real)
    for budget in (*(int(real.unchecked_peak_bytes * s) for s in (0.8, 0.6)), real.smallest_budget_bytes):
        ours, theirs = remat.plan(fake, budget), remat.plan(real, budget)
        assert (ours.decisions, ours.spans) == (theirs.decisions, theirs.spans)
        assert ours.predicted_peak_bytes + ours.scratch_bytes <= theirs.predicted_peak_bytes + (
            theirs.scratch_bytes
        )


def test_recurrent_kernels_on_cpu_are_profiled_in_real_steps_and_say_why(capsys):
    torch.manual_seed(0)
    model = GRUModel()
    with pytest.raises(TypeError, match=r"GRU\) runs CPU's own recurrent kernel"):
        check_fakeable(model)
    x = tokens(100)
    opt = torch.optim.AdamW(model.parameters())
    with _region():
        remat.auto_checkpoint(model, x, budget="90%", optimizer=opt, loss_fn=token_loss,
                              timer="flops")  # fmt: skip
    err = capsys.readouterr().err
    assert "profiling real steps" in err and "recurrent kernel" in err


def test_the_fake_twin_shares_the_models_hooks_and_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    seen: list[str] = []
    model.register_forward_hook(lambda m, a, o: seen.append(type(o).__name__))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake, _, mode = fake_twin(model, None)
    (x,), _ = on_fake(mode, ((torch.randn(2, 4),), {}))
    with mode, _region():
        fake(x).float().sum().backward()
    assert seen == ["FakeTensor"] and fake_mode_of(fake, ()) is mode
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_a_fake_model_takes_no_device_argument():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fake, _, mode = fake_twin(model, None)
    (x,), _ = on_fake(mode, ((torch.randn(2, 4),), {}))
    with pytest.raises(ValueError, match="device='cuda' is for a model on the meta device"):
        remat.profile(fake, x, timer="flops", device="cuda")


def _hf_marks(family: str) -> list[pytest.MarkDecorator]:
    return [] if family == "llama" else [pytest.mark.slow]


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=_hf_marks(f)) for f in ("llama", "t5", "gpt2", "bert", "vit", "neox")],
)
def test_a_fake_twin_of_a_hugging_face_model_under_autocast_has_its_bytes(family):
    pytest.importorskip("transformers", reason="needs the test extra: pip install -e '.[test]'")
    from tests.support.hf_models import FAMILIES, MORE_FAMILIES

    make = FAMILIES[family][0] if family in FAMILIES else MORE_FAMILIES[family]
    torch.manual_seed(0)
    model, batch = make()
    opt = torch.optim.AdamW(model.parameters())
    with _region():
        real = remat.profile(model, optimizer=opt, timer="flops", **batch)
        fake, fake_opt, mode = fake_twin(model, opt)
        a, k = on_fake(mode, ((), batch))
        prof = measure.profile_loop(fake, Inputs(*a, **k), Loop(fake_opt, timer="flops"))
    assert _bytes_of(prof) == _bytes_of(real)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_fake_twin_under_autocast_has_the_real_steps_bytes():
    # fake CUDA tensors run the meta kernels: SDPA's choice and the norms' dtypes as CUDA's?
    torch.manual_seed(0)
    model, x = build(GPT, device="cuda"), example_input(GPT, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        real = remat.profile(model, x, optimizer=opt, timer="flops")
        fake = _twin_profile(model, (x,), opt, None)
    assert _bytes_of(fake) == _bytes_of(real)


@pytest.mark.slow
def test_a_measured_peak_off_the_prediction_is_said(capsys):
    # BART under autocast: transformers takes fake tensors for a trace and builds a decoder
    # mask the eager step leaves to the kernel (see remat.planner.fake): predicted high
    pytest.importorskip("transformers", reason="needs the test extra: pip install -e '.[test]'")
    from tests.support.hf_models import MORE_FAMILIES

    torch.manual_seed(0)
    model, batch = MORE_FAMILIES["bart"]()
    opt = torch.optim.AdamW(model.parameters())
    with _region():
        p = remat.auto_checkpoint(model, budget="90%", optimizer=opt, timer="flops", **batch)
        measured = remat.measure_peak(model, optimizer=opt, **batch)
    err = capsys.readouterr().err
    assert measured < p.predicted_peak_bytes
    assert "below the prediction" in err


def _casts_inside(model: nn.Module) -> nn.Module:
    """``model`` whose forward runs in a bfloat16 autocast region, as accelerate's mixed
    precision patches it (the bound method replaced on the instance)."""
    forward = type(model).forward
    model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(forward), model)
    return model


def _mlp_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)]
    )


def test_a_model_that_turns_autocast_on_in_its_forward_is_profiled_through_a_fake_copy(capsys):
    model = _casts_inside(_mlp_stack())
    x = torch.randn(64, 32, requires_grad=True)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.float().sum()

    p = remat.auto_checkpoint(model, x, budget="80%", timer="flops", loss_fn=loss)
    err = capsys.readouterr().err
    assert "a meta copy" in err and "a fake copy of the model, for autocast" in err
    assert "the prediction" not in err  # measured as predicted
    assert remat.measure_peak(model, x, loss_fn=loss) == p.predicted_peak_bytes


def test_a_meta_model_that_turns_autocast_on_in_its_forward_is_refused():
    with torch.device("meta"):
        model = _casts_inside(_mlp_stack())
    with pytest.raises(AutocastInForward, match="turns torch.autocast on inside its forward"):
        remat.profile(model, torch.empty(64, 32, device="meta"), timer="flops")
