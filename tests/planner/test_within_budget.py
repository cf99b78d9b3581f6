"""auto_checkpoint plans a model whose unchecked step does not fit: the profile is made from
shapes, and every real step it runs is a step of the planned model (#31 item 1)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import remat
from remat.bench.models import ModelConfig, build, example_input

SCRIPT = pathlib.Path(__file__).parents[1] / "support" / "limited_plan.py"
GPT = ModelConfig(layers=4, d_model=64, seq=128, batch=2, heads=4, vocab=128)


def test_no_step_auto_checkpoint_runs_holds_more_than_the_budget():
    model, x = build(GPT), example_input(GPT)
    opt = torch.optim.AdamW(model.parameters())
    unchecked = remat.measure_peak(model, x, optimizer=opt)
    with remat.memory.track() as t:  # every tensor any step inside allocates
        p = remat.auto_checkpoint(model, x, budget="50%", optimizer=opt, timer="flops", quiet=True)
    params = sum(q.nbytes for q in model.parameters())
    assert p.budget_bytes < unchecked
    # the profile ran on meta tensors: what real steps held is the planned model's, and the
    # parameters' values kept to put back after the optimizer's steps (in host memory: on
    # CPU they add to the step's bytes)
    assert params + x.nbytes + t.peak_bytes_by_device["cpu"] <= p.budget_bytes + params


def test_planning_says_each_stage_unless_quiet(capsys):
    model, x = build(GPT), example_input(GPT)
    remat.auto_checkpoint(model, x, budget="70%", timer="flops")
    err = capsys.readouterr().err
    assert "profiling from shapes" in err and "checking the plan in real steps" in err
    assert "planned, measured peak" in err
    remat.auto_checkpoint(build(GPT), x, budget="70%", timer="flops", quiet=True)
    assert capsys.readouterr().err == ""


def test_a_model_with_an_optimizer_is_profiled_from_shapes(capsys):
    # the optimizer's steps on the meta twin keep its parameters' values (none: meta) to put back
    model, x = build(GPT), example_input(GPT)
    opt = torch.optim.AdamW(model.parameters())
    remat.auto_checkpoint(model, x, budget="70%", optimizer=opt, timer="flops")
    err = capsys.readouterr().err
    assert "profiling from shapes" in err and "profiling real steps" not in err


def test_a_model_on_the_meta_device_is_planned_and_the_plan_applies_to_the_real_one():
    with torch.device("meta"):
        meta = build(GPT, device="meta")
    mx = example_input(GPT, device="meta")
    p = remat.auto_checkpoint(meta, mx, budget="50%", timer="flops", quiet=True)
    model, x = build(GPT), example_input(GPT)
    p.apply(model)
    assert remat.measure_peak(model, x) == p.predicted_peak_bytes


def test_device_is_refused_for_a_model_on_a_real_device():
    model, x = build(GPT), example_input(GPT)
    with pytest.raises(ValueError, match="device='cpu' is for a model on the meta device"):
        remat.auto_checkpoint(model, x, budget="50%", device="cpu", quiet=True)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp32", "amp", "measured", "small-batch"])
def test_a_model_whose_unchecked_step_exceeds_the_address_space_limit_is_planned_and_trains(
    recipe,
):
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}
    flags = {"fp32": [], "amp": ["--amp"], "measured": ["--measured"], "small-batch": ["--small-batch"]}[recipe]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["unchecked_fits"] is False  # the limit bites: the unchecked step fails
    assert seen["predicted"] < seen["limit_over_process"] < seen["unchecked"]
    assert seen["trained"] == 2


class _Routed(torch.nn.Module):
    """A block whose work depends on its input's values (as a mixture of experts' routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pick = int((x.sum() > 0).item())
        return torch.relu((self.a if pick else self.b)(x)) + x


def test_a_model_whose_shapes_depend_on_values_is_refused_from_shapes_and_profiled_real(capsys):
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[_Routed() for _ in range(3)])
    with pytest.raises(RuntimeError, match="cannot be profiled from shapes alone"):
        remat.profile(meta, torch.empty(8, 16, device="meta"), timer="flops")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Routed() for _ in range(3)])
    x = torch.randn(64, 16, requires_grad=True)
    p = remat.auto_checkpoint(model, x, budget="90%", timer="flops")
    assert "profiling real steps" in capsys.readouterr().err
    assert remat.measure_peak(model, x) <= p.budget_bytes


class _Owner:
    """A hook's owner that cannot be copied (a generator among its attributes), as the
    Trainer's callbacks and meters are."""

    def __init__(self) -> None:
        self.calls = 0
        self.stream = (i for i in range(3))

    def hook(self, module: torch.nn.Module, args: object) -> None:
        self.calls += 1


def test_a_model_with_hooks_whose_owners_cannot_be_copied_is_profiled_from_shapes(capsys):
    model, x = build(GPT), example_input(GPT)
    owner = _Owner()
    model.register_forward_pre_hook(owner.hook)
    remat.auto_checkpoint(model, x, budget="70%", timer="flops")
    err = capsys.readouterr().err
    assert "profiling from shapes" in err and "profiling real steps" not in err
    assert owner.calls > 0  # the meta copy ran the model's own hooks (the very objects)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_model_whose_unchecked_step_exceeds_the_memory_fraction_is_planned_and_trains():
    cfg = ModelConfig(layers=6, d_model=512, seq=1024, batch=8, heads=8, vocab=512)
    model, x = build(cfg, device="cuda"), example_input(cfg, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    from remat.planner.meta import twin

    m, (mx,), _, mo = twin(model, (x,), {}, opt)
    unchecked = remat.profile(m, mx, optimizer=mo, timer="flops", device="cuda").unchecked_peak_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_allocated() + int(0.75 * unchecked)
    torch.cuda.set_per_process_memory_fraction(limit / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):  # the limit bites
            model(x).sum().backward()
        for q in model.parameters():
            q.grad = None
        torch.cuda.empty_cache()
        p = remat.auto_checkpoint(model, x, budget="50%", optimizer=opt, timer="flops", quiet=True)
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert torch.cuda.max_memory_allocated() <= p.budget_bytes
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
