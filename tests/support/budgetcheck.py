"""Plan a model with the default blocks at 70 %, 50 % and 30 % and check each plan against
measured steps (tests/planner/test_*_models.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import remat
from remat.planner.apply import apply_decision
from remat.planner.stepmodel import allocator_peak
from tests.support.steps import step_grads

BUDGETS = (0.7, 0.5, 0.3)


class PredictionOff(AssertionError):
    """A plan's predicted peak is not the measured one (raised after every other check
    passed, so that a known inaccuracy can be marked alone)."""


def check_default_plans(
    model: nn.Module,
    *args: Any,
    blocks: list[str],
    reached: set[float],
    scratch_apart: bool = False,
    **kwargs: Any,
) -> dict[float, tuple[int, int]]:
    """Profile ``model`` with the default blocks (asserted equal to ``blocks``) and plan it at
    each of :data:`BUDGETS`. A budget the every-block checkpoint of those blocks meets
    (measured, with the scratch inside operators where the planner locates it) is planned;
    every plan made is met by a measured step and its gradients equal the unchecked step's
    bitwise; then :class:`PredictionOff` unless every prediction is the measured peak, to
    the byte (the step model is exact on CPU for these chains). Returns
    ``{share: (predicted, measured)}`` of the plans.

    ``reached`` pins the shares of the tensors' step (the static bytes to the unchecked
    peak, no scratch) that the every-block checkpoint's measured peak meets: tensors' bytes
    are the same on every CPU, while the scratch, which a percentage budget adds whole (its
    largest), is the kernel library's (oneDNN's convolution backward takes several times
    more with AVX-512 than with AVX2) and so is not pinned. Each such share is also met with
    the scratch counted. ``scratch_apart``: the scratch where the every-block peak falls is
    less than the largest (located where it happens, #22), the case that lets a checkpoint
    meet more shares than its tensors do."""
    ref = step_grads(copy.deepcopy(model), args, kwargs)
    prof = remat.profile(model, *args, timer="flops", **kwargs)
    assert [b.name for b in prof.blocks] == blocks
    every = copy.deepcopy(model)
    assert remat.apply_activation_checkpointing(every) == blocks
    every_peak = remat.measure_peak(every, *args, **kwargs)
    # a share of the activations, with the static bytes and the largest scratch inside
    # operators on top; a plan's peak as the allocator counts it: its tensors' peak plus
    # the scratch of its window (Plan.scratch_bytes)
    n = len(prof.blocks)
    base = prof.static_step_bytes + prof.scratch.bytes
    full = prof.unchecked_peak_bytes + prof.scratch.bytes
    every_scratch = allocator_peak(prof, ["recompute"] * n).bytes - prof.peak(["recompute"] * n).bytes
    met: set[float] = set()
    out: dict[float, tuple[int, int]] = {}
    for share in BUDGETS:
        budget = base + int(share * (full - base))
        every_meets = every_peak + every_scratch <= budget
        if every_meets:
            met.add(share)
        try:
            plan = remat.plan(prof, f"{share:.0%}")
        except remat.PlanError:
            assert not every_meets, f"{share:.0%}: the every-block checkpoint meets it"
            continue
        assert abs(plan.budget_bytes - budget) <= 1, (plan.budget_bytes, budget)
        planned = copy.deepcopy(model)
        plan.apply(planned)
        measured = remat.measure_peak(planned, *args, **kwargs)
        assert measured + plan.scratch_bytes <= plan.budget_bytes, (share, measured, plan)
        got = step_grads(planned, args, kwargs)
        assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref)), share
        out[share] = (plan.predicted_peak_bytes, measured)
    static, activations = prof.static_step_bytes, prof.unchecked_peak_bytes - prof.static_step_bytes
    tensors = {share for share in BUDGETS if every_peak <= static + int(share * activations)}
    assert tensors == reached, f"the every-block checkpoint ({every_peak} B) meets {sorted(tensors)}"
    assert tensors <= met, (sorted(tensors), sorted(met), every_scratch, prof.scratch.bytes)
    if scratch_apart:
        assert every_scratch < prof.scratch.bytes, (every_scratch, prof.scratch.bytes)
    off = {s: pm for s, pm in out.items() if pm[0] != pm[1]}
    if off:
        raise PredictionOff(f"(predicted, measured) peaks differ: {off}")
    return out


def mispredicted_mixes(
    model: nn.Module, prof: remat.Profile, mixes: int, **batch: Any
) -> list[tuple[list[str], int]]:
    """Each block of ``prof`` recomputed alone, then ``mixes`` random mixes of ``keep``,
    ``recompute`` and ``selective`` (seed 0), applied to ``model`` and measured: those whose
    predicted peak is not the measured one, with by how much."""
    n = len(prof.blocks)
    gen = torch.Generator().manual_seed(0)
    choices = ("keep", "recompute", "selective")
    plans = [["keep"] * i + ["recompute"] + ["keep"] * (n - 1 - i) for i in range(n)]
    plans += [[choices[int(c)] for c in torch.randint(0, 3, (n,), generator=gen)] for _ in range(mixes)]
    wrong = []
    for ds in plans:
        for b, d in zip(prof.blocks, ds):
            apply_decision(model.get_submodule(b.name), d)
        measured = remat.measure_peak(model, **batch)
        if prof.peak(ds).bytes != measured:
            wrong.append((ds, prof.peak(ds).bytes - measured))
    return wrong
