"""Profiles from shapes (:mod:`remat.planner.meta`): the bench GPT, a ResNet-shaped CNN and
Hugging Face Llama and T5 built on the meta device profile to the byte terms of their CPU
profiles, scratch inside operators aside, and plan the same at 70, 50 and 30 %; a plan made
from shapes, applied to the real model, meets its prediction; profiling from shapes allocates
nothing real; what it refuses."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.types import ScratchTerms
from tests.support.vision_models import ResNet

pytestmark = pytest.mark.usefixtures("one_thread")

#: what a profile from shapes does not measure (scratch inside operators: a real device's),
#: what says how it was made, and timing noise (none with timer="flops")
NOT_COMPARED = {"scratch", "from_shapes", "device", "noise", "blocks"}
NOT_COMPARED_IN_BLOCKS = {"fwd_scratch", "bwd_scratch", "noise"}

BUDGETS = ("70%", "50%", "30%")

Batch = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]


def _on(device: str, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` on ``device``, a tensor passed twice (input ids as labels) moved once."""
    moved = {id(v): v.to(device) for v in batch.values() if isinstance(v, torch.Tensor)}
    return {k: moved.get(id(v), v) for k, v in batch.items()}


#: the built-in GPT at three layers of width 32, activations (a 64-token sequence) above
#: AdamW's state: every budget reachable
GPT = ModelConfig(layers=3, d_model=32, seq=64, batch=2, heads=2, vocab=64)


def _gpt(device: str) -> Batch:
    return build(GPT, device=device), (example_input(GPT, device=device),), {}


def _gpt_bf16(device: str) -> Batch:
    """In bfloat16: CPU's layer norm keeps its statistics in bfloat16, meta's in float32."""
    return build(GPT, device=device).to(torch.bfloat16), (example_input(GPT, device=device),), {}


def _resnet(device: str) -> Batch:
    torch.manual_seed(0)
    with torch.device(device):
        model = ResNet()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return model, (x.to(device),), {}


def _hf(make: Callable[[], tuple[torch.nn.Module, dict[str, Any]]], device: str) -> Batch:
    torch.manual_seed(0)
    with torch.device(device):
        model, _ = make()
    _, batch = make()  # the same inputs, made on CPU
    return model, (), _on(device, batch)


def _llama(device: str) -> Batch:
    from tests.support.hf_models import llama

    return _hf(llama, device)


def _llama_causal_mask(device: str) -> Batch:
    """Llama given its causal mask, 4-D: transformers builds none (no values read)."""
    model, args, batch = _llama(device)
    b, t = batch["input_ids"].shape
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, 1, t, t).contiguous()
    return model, args, {**batch, "attention_mask": mask.to(device)}


def _t5(device: str) -> Batch:
    from tests.support.hf_models import t5

    return _hf(t5, device)


needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs the test extra: pip install -e '.[test]'",
)

FAMILIES = [
    pytest.param(_gpt, id="bench-gpt"),  # SDPA (dropout: the math kernel), a vocabulary head
    pytest.param(_gpt_bf16, id="bench-gpt-bf16"),  # normalisation statistics in bf16 on CPU
    pytest.param(_resnet, id="resnet"),  # BatchNorm's running statistics, in-place ReLU
    # transformers (5.x) reads the position ids' values to find packed rows
    # (find_packed_sequence_indices): answered "one sequence a row" on meta, as the model's
    # own arange has (remat.planner.meta.one_sequence_a_row)
    pytest.param(_llama, id="llama", marks=needs_hf),
    pytest.param(_llama_causal_mask, id="llama-4d-mask", marks=needs_hf),
    pytest.param(_t5, id="t5", marks=needs_hf),  # a position bias handed along each stack
]


@pytest.fixture(scope="module")
def profiles() -> Callable[[Callable[[str], Batch], str], remat.Profile]:
    """``profiles(make, device)``: the family's profile on ``device`` (``"meta"``: from
    shapes, for CPU), AdamW, FLOPs as cost; each made once for the module."""
    made: dict[tuple[Callable[[str], Batch], str], remat.Profile] = {}

    def get(make: Callable[[str], Batch], device: str) -> remat.Profile:
        if (make, device) not in made:
            model, args, kwargs = make(device)
            opt = torch.optim.AdamW(model.parameters())
            on = {"device": "cpu"} if device == "meta" else {}
            made[make, device] = remat.profile(
                model, *args, optimizer=opt, timer="flops", **on, **kwargs
            )
        return made[make, device]

    return get


def _terms(prof: remat.Profile) -> dict[str, Any]:
    """Every field of the profile and of its blocks but those in ``NOT_COMPARED*``."""
    out = {f.name: getattr(prof, f.name) for f in dataclasses.fields(prof)}
    out = {k: v for k, v in out.items() if k not in NOT_COMPARED}
    out["blocks"] = [
        {f.name: getattr(b, f.name) for f in dataclasses.fields(b)
         if f.name not in NOT_COMPARED_IN_BLOCKS}
        for b in prof.blocks
    ]  # fmt: skip
    return out


def _without_scratch(prof: remat.Profile) -> remat.Profile:
    """The profile with the scratch inside operators, which shapes cannot show, left out."""
    blocks = [dataclasses.replace(b, fwd_scratch=0, bwd_scratch=0) for b in prof.blocks]
    return dataclasses.replace(prof, blocks=blocks, scratch=ScratchTerms())


def _plan(prof: remat.Profile, budget: str) -> tuple[Any, ...]:
    try:
        p = remat.plan(prof, budget)
    except remat.PlanError:
        return ("unreachable",)
    return p.decisions, p.spans, p.predicted_peak_bytes


@pytest.mark.parametrize("make", FAMILIES)
def test_profile_from_shapes_has_the_cpu_profiles_terms_and_plans(make, profiles):
    meta = profiles(make, "meta")
    cpu = profiles(make, "cpu")
    assert meta.from_shapes and not cpu.from_shapes
    assert meta.device == cpu.device == "cpu"
    assert meta.scratch == ScratchTerms()  # none, and not located
    assert all(b.fwd_scratch == b.bwd_scratch == 0 for b in meta.blocks)
    assert _terms(meta) == _terms(cpu)
    bare = _without_scratch(cpu)
    # and at the smallest reachable peak: a budget every family reaches
    budgets = [*BUDGETS, meta.floor_bytes]
    plans = [_plan(meta, budget) for budget in budgets]
    assert plans == [_plan(bare, budget) for budget in budgets]
    assert plans[-1] != ("unreachable",)


def test_plan_from_shapes_applied_to_the_real_gpt_meets_its_prediction(profiles):
    meta = profiles(_gpt, "meta")
    scratch = profiles(_gpt, "cpu").scratch.bytes
    model, (x,), _ = _gpt("cpu")
    opt = torch.optim.AdamW(model.parameters())
    planned = 0
    for budget in [*BUDGETS, meta.floor_bytes]:
        try:
            plan = remat.plan(meta, budget)
        except remat.PlanError:
            continue
        plan.apply(model)
        measured = remat.measure_peak(model, x, optimizer=opt)
        # the real step adds the scratch inside operators, which shapes do not show
        assert plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes + scratch, budget
        planned += 1
    assert planned >= 2


def test_a_model_too_large_for_memory_is_profiled_from_shapes_allocating_nothing():
    # 4 layers of width 16384: ~51 GB of float32 weights, three times that with AdamW
    cfg = ModelConfig(layers=4, d_model=16384, seq=64, batch=1, heads=128, vocab=512)
    with torch.device("meta"):
        model = build(cfg, device="meta")
    x = example_input(cfg, device="meta")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > 50 * 10**9
    opt = torch.optim.AdamW(model.parameters())
    with remat.memory.track("cpu") as cpu:
        prof = remat.profile(
            model, x, optimizer=opt, timer="flops", device="cpu", decisions=["keep", "recompute"]
        )
    assert cpu.peak_bytes < 2**20  # the SDPA choice's one-row stand-ins, nothing of the model
    assert prof.from_shapes and len(prof.blocks) == 4
    assert prof.static_bytes >= weights
    assert prof.optim.state_bytes >= 2 * weights  # AdamW's two moments
    with pytest.raises(remat.PlanError, match=r"The peak is in optimizer.step\(\)"):
        remat.plan(prof, "50%")  # AdamW's first step: no checkpointing lowers it


def test_a_model_built_on_meta_is_planned_inside_the_meta_device_context(profiles):
    # the chain DP's tables are made on the host whatever device the caller made the default
    prof = profiles(_gpt, "meta")
    with torch.device("meta"):
        plan = remat.plan(prof, "50%")
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.spans or set(plan.decisions.values()) != {"keep"}


def _meta_linear() -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), torch.empty(4, 8)


def test_device_is_refused_for_a_model_that_is_not_on_meta():
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8)
    with pytest.raises(ValueError, match="device='cpu' is for a model on the meta device"):
        remat.profile(model, x, timer="flops", device="cpu")


def test_measured_timer_is_refused_from_shapes():
    model, x = _meta_linear()
    with pytest.raises(ValueError, match="timer='measured' times real steps"):
        remat.profile(model, x, timer="measured", device="cpu")


def test_autocast_is_refused_from_shapes():
    model, x = _meta_linear()
    with torch.autocast("cpu"), pytest.raises(ValueError, match="inside torch.autocast"):
        remat.profile(model, x, timer="flops", device="cpu")


def test_offload_is_refused_from_shapes():
    model, x = _meta_linear()
    with pytest.raises(ValueError, match="'offload' is not measured from shapes"):
        remat.profile(model, x, timer="flops", device="cpu", decisions=["keep", "offload"])


def test_device_must_be_cpu_or_cuda_from_shapes():
    model, x = _meta_linear()
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        remat.profile(model, x, timer="flops", device="mps")


def test_a_fused_optimizer_is_profiled_from_shapes_as_on_cpu():
    """AdamW(fused=True), the Trainer's default: its kernels run on meta tensors."""
    from remat.planner.meta import twin

    model, x = build(GPT), example_input(GPT)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    real = remat.profile(model, x, optimizer=opt, timer="flops")
    m, (mx,), _, mo = twin(model, (x,), {}, opt)
    shaped = remat.profile(m, mx, optimizer=mo, timer="flops")
    assert shaped.optim == real.optim
