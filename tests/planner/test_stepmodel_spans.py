"""The step model with spans (remat.planner.stepmodel): spans and splits predicted as measured,
plans with spans below the per-block floor and never dearer than per-block plans, spans only
over blocks the model calls back to back, and a span's input held into backward.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.apply import apply_decision
from remat.planner.auto import step_peaks
from tests.support.chains import layouts, random_chain
from tests.support.plans import per_block_floor, plan_of

pytestmark = pytest.mark.usefixtures("one_thread")


def _span_forward(spans):
    """A GPT forward that runs ``spans`` (first, last) as one checkpoint each, by hand."""

    def forward(self, tokens):
        h = self.embed(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
        starts = dict(spans)
        i = 0
        while i < len(self.blocks):
            if i in starts:
                z = starts[i]

                def run(h, a=i, z=z):
                    for j in range(a, z + 1):
                        h = self.blocks[j](h)
                    return h

                h = remat.checkpoint(run, h)
                i = z + 1
            else:
                h = self.blocks[i](h)
                i += 1
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return forward


def test_span_and_split_predictions_equal_measured_steps():
    cfg = ModelConfig(layers=4, d_model=32, seq=64, batch=2, heads=2, vocab=64)
    model, x = build(cfg), example_input(cfg)
    prof = remat.profile(model, x, timer="flops")
    assert "split" in prof.decisions
    layouts = [
        (["recompute"] * 4, [(0, 1)]),
        (["split"] * 4, [(0, 3)]),
        (["keep", "recompute", "recompute", "recompute"], [(1, 3)]),
        (["split", "split", "recompute", "selective"], [(0, 1)]),
        (["recompute", "recompute", "split", "split"], [(0, 1), (2, 3)]),
        (["split", "recompute", "split", "keep"], []),
    ]
    plain = model.forward
    try:
        for ds, spans in layouts:
            for b, d in zip(model.blocks, ds):
                apply_decision(b, d)
            model.forward = types.MethodType(_span_forward(spans), model)
            assert max(step_peaks(model, x)) == prof.peak(ds, spans).bytes, (ds, spans)
    finally:
        model.forward = plain
        for b in model.blocks:
            apply_decision(b, "keep")


def test_plan_apply_with_split_spans_is_predicted_exactly_and_keeps_gradients():
    # Plan.apply puts spans on through remat.modules.spans with inner="split": the children it makes
    # regions are the ones the profile measured for the block's "split" (one rule, _split)
    cfg = ModelConfig(layers=4, d_model=32, seq=64, batch=2, heads=2, vocab=64)  # dropout 0.1
    x = example_input(cfg)
    opt_of = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    probe = build(cfg)
    prof = remat.profile(probe, x, optimizer=opt_of(probe), timer="flops")
    ref = build(cfg)
    torch.manual_seed(3)
    ref(x).backward()
    layouts = [
        (["split"] * 4, [(0, 1), (2, 3)]),
        (["split"] * 4, [(0, 3)]),
        (["recompute", "keep", "split", "split"], [(2, 3)]),
    ]
    for ds, spans in layouts:
        model = build(cfg)
        opt = opt_of(model)
        expected = prof.peak(ds, spans).bytes
        plan = plan_of(prof, ds, spans)
        plan.apply(model)
        assert remat.measure_peak(model, x, optimizer=opt) == expected, (ds, spans)
        torch.manual_seed(3)
        model(x).backward()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), (ds, spans, n)


@pytest.mark.slow  # 6.5 s
def test_every_span_layout_of_a_small_chain_is_measured_as_predicted():
    # the brute-force grid with spans: every layout of 3 blocks (each block alone under keep,
    # recompute, selective or split, or in a span with any inner), applied by Plan.apply,
    # measured over the first and a later step with SGD momentum, grads None between steps
    cfg = ModelConfig(layers=3, d_model=32, seq=32, batch=2, heads=2, vocab=64)
    x = example_input(cfg)
    probe = build(cfg)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    prof = remat.profile(probe, x, optimizer=sgd(probe), timer="flops")
    grid = list(layouts(prof.blocks, ("keep", "recompute", "selective", "split"), 3))
    inner = {ds[a] for ds, spans in grid for a, _ in spans}
    assert inner == {"keep", "recompute", "selective", "split"} and len(grid) > 60
    wrong = []
    model = build(cfg)
    opt = sgd(model)
    for ds, spans in grid:
        expected = prof.peak(ds, spans).bytes
        plan = plan_of(prof, ds, spans)
        plan.apply(model)  # replaces the previous layout's wrapping and spans
        measured = remat.measure_peak(model, x, optimizer=opt)
        if measured != expected:
            wrong.append((ds, spans, expected, measured))
    assert not wrong


class Pointwise(nn.Module):
    """A block without parameters: its input is most of what it keeps, so spans pay off."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(torch.sin(x) * torch.cos(x))


def _pointwise_chain() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(*[Pointwise() for _ in range(8)])
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    return model, x


def test_plan_with_spans_goes_below_the_per_block_floor():
    model, x = _pointwise_chain()
    prof = remat.profile(model, x, timer="flops")
    floor = per_block_floor(prof)
    per_block = remat.plan(prof, floor, spans=False)
    assert per_block.predicted_peak_bytes == floor and not per_block.spans
    with pytest.raises(remat.PlanError):
        remat.plan(prof, floor - 1, spans=False)
    assert prof.floor_bytes < floor
    p = remat.plan(prof, prof.floor_bytes, spans=True)
    assert p.spans and p.predicted_peak_bytes == prof.floor_bytes <= p.budget_bytes
    assert remat.plan(prof, prof.floor_bytes) == p  # spans are the default


def test_a_plan_with_spans_costs_no_more_than_the_best_per_block_plan():
    model, x = _pointwise_chain()
    prof = remat.profile(model, x, timer="flops")
    floor = per_block_floor(prof)
    for budget in range(floor, prof.unchecked_peak_bytes + 1, 4096):
        with_spans = remat.plan(prof, budget)
        per_block = remat.plan(prof, budget, spans=False)
        assert with_spans.predicted_peak_bytes <= budget
        assert with_spans.predicted_overhead_s <= per_block.predicted_overhead_s


class _NormBetween(nn.Module):
    """Pointwise blocks with a norm of the model's own between blocks 1 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Pointwise() for _ in range(4))
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1:
                x = self.norm(x)
        return x


def test_spans_join_only_blocks_the_model_calls_back_to_back():
    model = _NormBetween()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    prof = remat.profile(model, x, timer="flops")
    assert prof.chained == [True, False, True]
    p = remat.plan(prof, prof.floor_bytes + prof.scratch.bytes)
    assert p.spans  # below the per-block floor, but never across the norm
    for first, last in p.spans:
        assert (first, last) in {("layers.0", "layers.1"), ("layers.2", "layers.3")}
    p.apply(model)
    assert remat.measure_peak(model, x) == p.predicted_peak_bytes


def test_milp_plans_per_block_and_refuses_spans():
    pytest.importorskip("scipy")
    model, x = _pointwise_chain()
    prof = remat.profile(model, x, timer="flops")
    floor = per_block_floor(prof)
    milp = remat.plan(prof, floor, solver="milp")  # spans left out: per block
    assert not milp.spans
    assert milp.predicted_overhead_s == remat.plan(prof, floor, spans=False).predicted_overhead_s
    with pytest.raises(ValueError, match=r"solver='milp'.*spans=True.*solver='auto'"):
        remat.plan(prof, floor, solver="milp", spans=True)


def test_a_plan_with_spans_is_measured_as_predicted():
    # remat.plan(spans=True) predicts a span (one region over consecutive blocks, each
    # block checkpointed inside) below the per-block floor; applied, it must measure so.
    model, x = _pointwise_chain()
    prof = remat.profile(model, x, timer="flops")
    p = remat.plan(prof, prof.floor_bytes, spans=True)
    assert p.spans
    p.apply(model)
    assert remat.measure_peak(model, x) == p.predicted_peak_bytes <= p.budget_bytes


def test_plan_per_block_costs_and_savings_add_up_with_selective_spans():
    # Plan.added_cost and Plan.saved_bytes of every plan over random chains add up to the
    # plan's predicted overhead and to what its segments save; some plans hold selective spans
    from remat.planner.stepmodel import layout

    seen = set()
    for seed in range(12):
        blocks, top = random_chain(seed, 6)
        decs = ["keep", "recompute", "selective"]
        prof = remat.Profile(
            blocks=blocks,
            top=top,
            decisions=decs,
            cost_unit="s",
            input_shapes=[],
            device="cpu",
            torch_version=torch.__version__,
            chained=[True] * 5,
        )
        lo = prof.floor_bytes
        hi = prof.peak(["keep"] * 6).bytes
        for frac in (0.0, 0.1, 0.3, 0.6):
            p = remat.plan(prof, budget=int(lo + frac * (hi - lo)))
            ds = list(p.decisions.values())
            names = list(p.decisions)
            spans = [(names.index(a), names.index(z)) for a, z in p.spans]
            seen |= {ds[a] for a, _ in spans}
            assert sum(p.added_cost.values()) == pytest.approx(p.predicted_overhead_s, abs=1e-9)
            segs = layout(blocks, ds, spans)
            assert sum(p.saved_bytes.values()) == sum(s.saved for s in segs)
    assert "selective" in seen


class _StemBody(torch.nn.Module):
    """The blocks in an ``nn.Sequential`` the model calls with the stem's output: the
    caller's frame keeps that input until the blocks return; the first block (Dropout
    first) saves none of it."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(d, d)
        self.body = torch.nn.Sequential(
            *[
                torch.nn.Sequential(
                    torch.nn.Dropout(0.1), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                    torch.nn.Linear(4 * d, d), torch.nn.Tanh(),
                )  # fmt: skip
                for _ in range(3)
            ]
        )
        self.head = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def test_a_plain_span_holds_its_input_that_the_kept_step_frees_at_forwards_end():
    # The span's checkpoint holds the stem's output into backward; under keep it dies when
    # the blocks return. Found by the offload sweep: (keep span 0..1) was 8 KB low.
    torch.manual_seed(0)
    model, x = _StemBody(), torch.randn(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prof = remat.profile(model, x, optimizer=opt, timer="flops")
    assert prof.blocks[0].held_to_end == 64 * 32 * 4
    low = []
    for (a, z), inner, other in itertools.product(
        [(0, 1), (1, 2), (0, 2)], ["keep", "recompute", "selective"], ["keep", "recompute"]
    ):
        ds = [other] * 3
        ds[a : z + 1] = [inner] * (z - a + 1)
        plan_of(prof, ds, [(a, z)]).apply(model)
        measured = remat.measure_peak(model, x, optimizer=opt)
        if prof.peak(ds, [(a, z)]).bytes < measured:
            low.append((ds, (a, z), measured - prof.peak(ds, [(a, z)]).bytes))
    assert not low
