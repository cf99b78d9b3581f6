"""``auto_checkpoint`` on models that change tensors in place, return views or keep outputs:
both promises hold, or a clear error.

Blocks that ReLU a linear output in place or change their input in place, outputs the
model keeps (a U-Net's skips) or collects, blocks that return a view of their input: each
planned with AdamW, then two training steps bitwise those of an unchecked copy, the peak on
``torch.profiler``'s allocator meter (``referee``) within the budget.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from tests.support.families import UNet, ViewBlocks, class_loss, relu_inplace_mlp, vgg
from tests.support.referee import check_auto

pytestmark = pytest.mark.usefixtures("one_thread")


def test_auto_checkpoint_plans_blocks_that_relu_a_linear_output_in_place():
    # nn.ReLU(inplace=True) on a Linear's output changed the saved matmul output: the
    # profile's selective step raised CheckpointError out of auto_checkpoint
    torch.manual_seed(0)
    p = check_auto(relu_inplace_mlp(), torch.randn(256, 64), budget="70%")
    assert "selective" in p.decisions.values()


def test_prefer_save_recomputes_a_saved_output_changed_in_place_and_must_save_raises():
    torch.manual_seed(0)
    gru = nn.GRU(8, 8, batch_first=True)
    x = torch.randn(2, 3, 8, requires_grad=True)

    def grads(run: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        gru.zero_grad()
        x.grad = None
        run(x).square().sum().backward()
        return [*(p.grad for p in gru.parameters()), x.grad]  # type: ignore[list-item]

    def fn(t: torch.Tensor) -> torch.Tensor:
        return gru(t)[0]

    def ctx(prefer: bool) -> Any:
        return functools.partial(
            remat.create_selective_checkpoint_contexts, remat.policies.save_matmuls(prefer)
        )

    plain = grads(fn)
    ours = grads(lambda t: remat.checkpoint(fn, t, context_fn=ctx(True)))
    assert all(torch.equal(a, b) for a, b in zip(plain, ours))
    with pytest.raises(remat.CheckpointError, match="unsafe_split"):
        grads(lambda t: remat.checkpoint(fn, t, context_fn=ctx(False)))


def test_blocks_that_change_their_input_in_place_are_only_kept():
    # an nn.ReLU(inplace=True) block checkpointed alone changes the input its region keeps:
    # autograd's "modified by an inplace operation" leaked out of auto_checkpoint
    torch.manual_seed(0)
    model = vgg()
    prof = remat.profile(model, torch.randn(4, 3, 32, 32), timer="flops")
    relus = {b.name for b in prof.blocks if isinstance(model.get_submodule(b.name), nn.ReLU)}
    assert relus == {"2", "5", "9", "13"}
    for b in prof.blocks:
        assert (set(b.cost) == {"keep"}) == (b.name in relus), b.name
    p = check_auto(model, torch.randn(4, 3, 32, 32), budget="75%", loss_fn=class_loss)
    assert all(p.decisions[n] == "keep" for n in relus)
    assert not any(set(s) & relus for s in p.spans)


def test_profile_records_outputs_the_model_keeps_and_plans_no_span_over_them():
    # the U-Net's encoder outputs e1, e2 (blocks 0, 1) are kept by forward's own code past
    # the next block: a span holding block i and the two after it would free what the model
    # still uses, and refuse it at run time
    torch.manual_seed(0)
    model, x = UNet(), torch.randn(8, 3, 32, 32)
    prof = remat.profile(model, x, optimizer=torch.optim.AdamW(model.parameters()), timer="flops")
    assert prof.kept_outputs == [True, True, False, False, False, False]
    assert prof.chained == [True, True, False, False, False]
    p = remat.plan(prof, budget="72%")
    assert p.spans  # a span the model accepts ([blocks.0, blocks.1] with FLOPs costs)
    assert all(z - a < 2 for a, z in ([int(n[-1]) for n in s] for s in p.spans))
    check_auto(UNet(), torch.randn(8, 3, 32, 32), budget="72%")  # met, bitwise


def test_outputs_a_model_collects_but_does_not_pass_on_do_not_limit_spans():
    from remat.modules.spans import apply_span

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.lin(x).tanh()
            return y, y.sum(-1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(Block() for _ in range(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            extras = []
            for layer in self.layers:
                x, extra = layer(x)
                extras.append(extra)
            return x.sum() + torch.stack(extras).sum()

    model, x = Model(), torch.randn(32, 16)
    prof = remat.profile(model, x, timer="flops")
    assert prof.kept_outputs == [False] * 5 and all(prof.chained)
    ref = copy.deepcopy(model)
    apply_span(model, [f"layers.{i}" for i in range(5)], inner="recompute")  # not refused
    model(x).backward()
    ref(x).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_a_span_the_model_refuses_leaves_the_model_as_it_was():
    # a span the model refuses at run time (here: a profile without the record of kept
    # outputs plans one over the U-Net's encoder) raised the span's PlanError from
    # auto_checkpoint's measuring step with the span left applied: every later forward of
    # the user's model raised
    import dataclasses

    from remat.modules.spans import spans_in
    from remat.modules.wrap import wrapping_state

    torch.manual_seed(0)
    model, x = UNet(), torch.randn(8, 3, 32, 32)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, x, optimizer=opt, timer="flops")
    blind = dataclasses.replace(prof, kept_outputs=[])
    with pytest.raises(remat.PlanError, match="refused the plan's span.*without spans"):
        remat.auto_checkpoint(
            model, x, budget="72%", optimizer=opt, profile=blind, timer="flops", quiet=True
        )
    assert not spans_in(model)
    assert all(not wrapping_state(m) for m in model.modules())
    torch.manual_seed(5)
    model(x).sum().backward()
    torch.manual_seed(5)
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
    check_auto(UNet(), torch.randn(8, 3, 32, 32), budget="80%")  # a plan without spans


def test_a_block_returning_a_view_of_its_input_does_not_end_a_span():
    # a span [Linear, Unflatten] was predicted to free the Linear's output, which the
    # Unflatten's view keeps: the floor plan measured 128 KiB over its prediction
    torch.manual_seed(0)
    model, x = ViewBlocks(), torch.randn(256, 64)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, x, optimizer=opt, timer="flops")
    assert prof.chained == [False, False, True, True, True]
    p = remat.plan(prof, prof.floor_bytes + prof.scratch.bytes)
    p.apply(model)
    assert remat.measure_peak(model, x, optimizer=opt) <= p.predicted_peak_bytes


class ScalesItsInput(nn.Module):
    """A forward that changes its input in place (``x /= 255``, as image models do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x /= 255.0
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_planner_gives_back_an_input_the_model_changes_in_place():
    # every profiling and measuring step ran the model on the user's input: a forward that
    # scales it in place left it scaled by 255**k, and later steps saw other values
    model, x = ScalesItsInput(), torch.rand(256, 64) * 255
    x0 = x.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, optimizer=opt, timer="flops")
    assert torch.equal(x, x0)
    first = remat.measure_peak(model, x, optimizer=opt)
    assert torch.equal(x, x0)
    assert remat.measure_peak(model, x, optimizer=opt) == first == prof.peak(["keep"] * 4).bytes
    ref = copy.deepcopy(model)
    remat.auto_checkpoint(model, x, budget="70%", optimizer=opt, timer="flops", quiet=True)
    assert torch.equal(x, x0)
    xa, xb = x0.clone(), x0.clone()
    model(xa).sum().backward()
    ref(xb).sum().backward()
    assert torch.equal(xa, xb)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
