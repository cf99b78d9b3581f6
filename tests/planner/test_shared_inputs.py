"""Tensors handed to several blocks that die in forward with every block kept (T5's position
bias: the first block of a stack makes it, the others receive it and return it again): a
checkpoint of any of them holds it into backward, once however many do
(:class:`remat.planner.types.SharedInput`).

Counted once per checkpointed block, the step model predicted plans up to one bias per
extra block high, and plans that checkpoint a later block alone up to one bias per earlier
receiver *low* (T5's last decoder block recomputed alone: 4 % low).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import remat
from remat.planner.apply import apply_decision
from remat.planner.stepmodel import activation_terms, solver_terms
from tests.support.budgetcheck import check_default_plans
from tests.support.families import EncoderDecoder
from tests.support.plans import plan_of

pytestmark = pytest.mark.usefixtures("one_thread")

CHOICES = ("keep", "recompute", "selective")
BIAS = 64 * 128 * 4  # (1, seq, 4 * d) float32
NAMES = [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(3)]


def _model() -> tuple[EncoderDecoder, torch.Tensor, remat.Profile]:
    torch.manual_seed(0)
    model, x = EncoderDecoder(), torch.randn(4, 64, 32)
    return model, x, remat.profile(model, x, timer="flops")


def _wrong(model: EncoderDecoder, x: torch.Tensor, prof: remat.Profile, plans) -> list:
    blocks = [model.get_submodule(n) for n in NAMES]
    wrong = []
    for ds in plans:
        for b, d in zip(blocks, ds):
            apply_decision(b, d)
        measured = remat.measure_peak(model, x)
        if prof.peak(list(ds)).bytes != measured:
            wrong.append(("".join(d[0] for d in ds), prof.peak(list(ds)).bytes - measured))
    for b in blocks:
        apply_decision(b, "keep")
    return wrong


def test_a_bias_a_stack_hands_on_is_one_group_of_its_receivers_and_where_it_dies():
    model, x, prof = _model()
    assert [b.name for b in prof.blocks] == NAMES
    # the encoder's dies when the encoder returns (in block 2's window), the decoder's when
    # the forward returns (after block 5: window 6); neither is a mask made by the model
    assert prof.shared.inputs == {"1,2>2": BIAS, "4,5>6": BIAS}
    assert prof.shared.bytes == 0


def test_plans_that_checkpoint_some_of_the_receivers_are_predicted_exactly():
    model, x, prof = _model()
    plans = [[d] * 6 for d in CHOICES]
    for i, d in itertools.product(range(6), ("recompute", "selective")):
        plans.append(["keep"] * i + [d] + ["keep"] * (5 - i))  # alone: the last one was low
    plans += [
        ["keep", "recompute", "recompute", "keep", "recompute", "recompute"],  # was high
        ["keep", "recompute", "keep", "keep", "keep", "selective"],
        ["recompute", "keep", "selective", "selective", "keep", "recompute"],
    ]
    assert not _wrong(model, x, prof, plans)


@pytest.mark.slow
def test_every_plan_of_the_receivers_is_predicted_exactly():
    model, x, prof = _model()
    plans = [
        [a, b, c, d, e, f]
        for a, d in (("keep", "keep"), ("recompute", "selective"))
        for b, c, e, f in itertools.product(CHOICES, repeat=4)
    ]
    assert not _wrong(model, x, prof, plans)


def test_the_solvers_terms_bound_the_exact_ones_from_both_sides():
    # the profile's terms count a bias per checkpointed receiver (never low); the optimistic
    # ones by its last receiver only (never high): remat.plan tries those first
    _, _, prof = _model()
    terms = solver_terms(prof)
    assert terms.optimistic is not None
    static = prof.static_step_bytes
    tight = 0
    for ds in itertools.product(CHOICES, repeat=6):
        exact = prof.peak(list(ds)).bytes - static
        safe = activation_terms(terms.blocks, terms.top, ds, prof.pre)[0]
        low = activation_terms(terms.optimistic, terms.top, ds, prof.pre)[0]
        assert low <= exact <= safe, ds
        tight += low == exact == safe
    # all three agree where no receiver but the last holds the bias: per stack block 0 under
    # any decision (3) times its receivers both kept or only the last checkpointed (3)
    assert tight == 9 * 9


def test_plans_with_spans_are_never_predicted_low():
    model, x, prof = _model()
    rng = random.Random(0)
    for spans in ([(1, 2)], [(0, 2), (4, 5)], [(0, 1)], [(3, 5)]):  # inside a stack
        inside = {j for a, z in spans for j in range(a, z + 1)}
        for inner in CHOICES:
            ds = [inner if i in inside else rng.choice(CHOICES) for i in range(6)]
            predicted = prof.peak(ds, spans).bytes
            plan_of(prof, ds, spans).apply(model)
            measured = remat.measure_peak(model, x)
            assert measured <= predicted, (ds, spans, predicted - measured)
            for n in NAMES:
                apply_decision(model.get_submodule(n), "keep")


def test_budgets_the_every_block_checkpoint_meets_are_planned_met_and_predicted_exactly():
    torch.manual_seed(0)
    model, x = EncoderDecoder(depth=4), torch.randn(4, 64, 32)
    names = [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(4)]
    out = check_default_plans(model, x, blocks=names, reached={0.7, 0.5})
    assert set(out) == {0.7, 0.5}  # 30 %: below the floor of spans too


def test_blocks_that_return_the_bias_they_received_may_join_a_span():
    # A block returning a tensor it received unchanged (the bias) returns no view of the
    # block before: it is chained to it (a span may join them); the bias is a shared input
    model, x, prof = _model()
    assert prof.chained == [True] * 5
    plan = remat.plan(prof, prof.smallest_budget_bytes)
    assert plan.spans  # the floor needs spans here
    plan.apply(model)
    assert remat.measure_peak(model, x) <= plan.predicted_peak_bytes  # spans: never low
