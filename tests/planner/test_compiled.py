"""Compiled plans (#33): each block compiled on its own, the partitioner's budget per block
chosen for a byte budget of the step, measured at the allocator.

The fast tests check the allocator's timeline against the tracker's on an eager step, the
regional compile's bookkeeping and the refusals; the slow ones compile (inductor, CPU) and
check plans at 70/50/30 % against the allocator's measured peak, to the byte.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner import measure
from remat.planner.apply import apply_decision
from remat.planner.inputs import Inputs
from remat.planner.loop import Loop, Step
from remat.planner.regional import LEVELS, CompiledForward, compile_block, compiled_level
from remat.planner.types import Decision

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # inductor's first compile in a process imports code torch itself deprecates
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # dynamo reads .grad of the non-leaf tensors it traces (its own warning, not the model's)
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]

SMALL = ModelConfig(layers=3, d_model=64, seq=64, batch=4, heads=4, vocab=128)
#: 8 blocks without dropout (compiled graphs draw dropout's masks their own way: gradients
#: are compared where they are deterministic); 30 % is reachable
GPT = ModelConfig(layers=8, d_model=64, seq=128, batch=4, heads=4, vocab=128, dropout=0.0)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.blocks)


def test_the_allocators_timeline_of_an_eager_step_is_the_trackers_between_operators():
    torch.manual_seed(0)
    model, x = build(SMALL), example_input(SMALL)
    opt = torch.optim.AdamW(model.parameters())
    modules = _blocks(model)
    step = Step(model, Inputs(x), Loop(opt))
    step()
    storages = measure.unsharded_storages(model)
    try:
        for d in ("keep", "recompute", "selective"):
            for m in modules:
                apply_decision(m, d)
            step.clear_grads()
            tracked, _ = measure._memory_step(step, modules, storages, False)
            step.clear_grads()
            seen, _ = measure._allocator_step(step, modules, False)
            for name in ("fwd_start", "bwd_start", "top_start", "end_bytes", "top_grads",
                         "bwd_grads", "end_grads", "input_bytes"):  # fmt: skip
                assert getattr(seen, name) == getattr(tracked, name), (d, name)
            # a window's peak: the tracker's plus what operators take inside (scratch)
            assert all(a >= b for a, b in zip(seen.fwd_peak, tracked.fwd_peak))
            assert all(a >= b for a, b in zip(seen.bwd_peak, tracked.bwd_peak))
            assert seen.top_peak >= tracked.top_peak and seen.pre_peak >= tracked.pre_peak
            assert seen.fwd_tail == [] and seen.outputs_freed == []  # not recorded
    finally:
        step.state.restore()
        for m in modules:
            apply_decision(m, "keep")


def test_a_compiled_block_keeps_its_identity_and_state_dict_and_is_undone_by_an_eager_decision():
    lin = torch.nn.Linear(4, 4)
    keys = list(lin.state_dict())
    compile_block(lin, 0.5)
    assert isinstance(lin.__dict__["forward"], CompiledForward) and compiled_level(lin) == 0.5
    assert list(lin.state_dict()) == keys
    apply_decision(lin, "recompute", compiled=True)
    assert compiled_level(lin) == LEVELS[Decision.RECOMPUTE] == 0.0
    apply_decision(lin, "recompute")  # an eager plan after a compiled one
    assert compiled_level(lin) is None and "remat: checkpointed" in repr(lin)
    apply_decision(lin, "keep")
    assert "forward" not in lin.__dict__
    with pytest.raises(ValueError, match="budget must be in"):
        compile_block(lin, 1.5)


def test_compiled_decisions_are_the_partitioners_budgets_and_others_are_refused():
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"'offload'\] are not planned for compiled blocks"):
        apply_decision(lin, "offload", compiled=True)
    model, x = build(SMALL), example_input(SMALL)
    with pytest.raises(ValueError, match="not planned for compiled blocks"):
        remat.profile(model, x, compile=True, decisions=["keep", "split"])
    with pytest.raises(ValueError, match="compile=True with timer='flops'"):
        remat.profile(model, x, compile=True, timer="flops")
    with pytest.raises(TypeError, match="compile must be True or False"):
        remat.profile(model, x, compile="yes")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="not planned inside torch.autocast"):
            remat.profile(model, x, compile=True)
    meta, mx = build(SMALL, device="meta"), example_input(SMALL, device="meta")
    with pytest.raises(ValueError, match="a model on the meta device"):
        remat.profile(meta, mx, compile=True)
    with pytest.raises(ValueError, match="compile=True plans the compiled blocks of a real model"):
        remat.auto_checkpoint(model, x, budget="50%", compile=True, shapes=remat.Shapes(dims=1))


def test_a_compiled_profile_plans_no_spans_and_its_plan_says_compiled_in_json():
    model, x = build(SMALL), example_input(SMALL)
    prof = dataclasses.replace(remat.profile(model, x, timer="flops"), compiled=True)
    with pytest.raises(ValueError, match="spans of compiled blocks are not planned"):
        remat.plan(prof, "60%", spans=True)
    p = remat.plan(prof, "60%")
    assert p.compiled and not p.spans
    assert remat.Plan.from_json(p.to_json()).compiled
    assert remat.Profile.from_json(prof.to_json()).compiled
    eager = remat.plan(dataclasses.replace(prof, compiled=False), "60%")
    assert "compiled" not in json.loads(eager.to_json())  # eager JSON as before
    assert "compiled" not in json.loads(dataclasses.replace(prof, compiled=False).to_json())


#: inductor on CPU builds its kernels with a C++ compiler
needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="no C++ compiler: torch.compile's inductor cannot build CPU kernels here",
)


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = out.float().pow(2).mean() if torch.is_tensor(out) else out.loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@needs_compiler
def test_compiled_plans_meet_70_50_and_30_percent_to_the_byte_and_train_as_compiled():
    torch.manual_seed(0)
    base, x = build(GPT), example_input(GPT)
    prof = remat.profile(copy.deepcopy(base), x, compile=True, repeats=2)
    assert prof.compiled and prof.cost_unit == "s" and prof.scratch.bytes == 0
    unchecked = copy.deepcopy(base)
    for m in _blocks(unchecked):
        compile_block(m, LEVELS[Decision.KEEP])
    want = _grads(unchecked, x)
    measured = []
    for budget in ("70%", "50%", "30%"):
        model = copy.deepcopy(base)
        p = remat.auto_checkpoint(model, x, budget=budget, profile=prof, quiet=True)
        assert p.compiled and all(compiled_level(m) is not None for m in _blocks(model))
        peak = remat.measure_peak(model, x)  # the allocator's: the blocks are compiled
        assert peak == p.predicted_peak_bytes <= p.budget_bytes
        measured.append(peak)
        # the partitioner's budgets change what is saved, not what is computed (no dropout)
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), want))
    assert measured == sorted(measured, reverse=True)  # a smaller budget never measures more
    assert measured[-1] < 0.5 * prof.unchecked_peak_bytes


@pytest.mark.slow
@needs_compiler
def test_auto_checkpoint_with_compile_profiles_and_checks_at_the_allocator(capsys):
    # the other slow test's model: its graphs come from inductor's cache, not compiled again
    torch.manual_seed(0)
    model, x = build(GPT), example_input(GPT)
    opt = torch.optim.AdamW(model.parameters())
    p = remat.auto_checkpoint(model, x, budget="70%", optimizer=opt, compile=True)
    err = capsys.readouterr().err
    assert "compile=True measures compiled kernels in real steps" in err
    assert remat.measure_peak(model, x, optimizer=opt) == p.predicted_peak_bytes <= p.budget_bytes
    assert remat.Plan.from_json(p.to_json()).apply(build(GPT)) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_plans_on_a_gpu_meet_their_budget_at_the_caching_allocator():
    # the allocator's events of the profiler (the prediction) against the caching
    # allocator's own count (max_memory_allocated), which rounds blocks up
    torch.manual_seed(0)
    cfg = dataclasses.replace(GPT, batch=8)
    base, x = build(cfg, device="cuda"), example_input(cfg, device="cuda")
    prof = remat.profile(copy.deepcopy(base), x, compile=True, repeats=2)
    for budget in ("50%", "30%"):
        model = copy.deepcopy(base)
        p = remat.auto_checkpoint(model, x, budget=budget, profile=prof, quiet=True)
        assert remat.measure_peak(model, x) == p.predicted_peak_bytes <= p.budget_bytes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        _grads(model, x)
        torch.cuda.synchronize()
        step = torch.cuda.max_memory_allocated() - start
        static = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])
        # gradients of the previous step freed by _grads: the step's bytes above the static
        assert static + step <= p.budget_bytes + 512 * 1024, (budget, static + step, p)


def test_compiled_plans_under_a_process_group_are_refused_with_the_reason(monkeypatch):
    from remat.planner import auto

    model, x = build(SMALL), example_input(SMALL)
    monkeypatch.setattr(measure, "active", lambda distributed: True)
    monkeypatch.setattr(auto, "active", lambda distributed: True)
    with pytest.raises(ValueError, match="compile=True under a process group is not planned"):
        remat.profile(model, x, compile=True)
    with pytest.raises(ValueError, match="communication threads' buffers"):
        remat.auto_checkpoint(model, x, budget="50%", compile=True)


def test_explain_says_a_compiled_plans_blocks_ran_eagerly_in_its_steps():
    model, x = build(SMALL), example_input(SMALL)
    for m in _blocks(model):
        compile_block(m, 0.0)
    report = remat.explain(model, x)
    assert report.compiled == ("blocks.0", "blocks.1", "blocks.2")
    assert "Compiled: blocks.0, blocks.1, blocks.2 ran eagerly here" in str(report)
    assert remat.explain(build(SMALL), x).compiled == ()
