"""``auto_checkpoint`` on models unlike the built-in ones: both promises hold, or a clear error.

For each model, ``auto_checkpoint`` with AdamW, then two training steps of the default
loop: the parameters after each step are bitwise those of an unchecked copy (dropout on,
same seeds), the buffers too, and the step's absolute peak on ``torch.profiler``'s
allocator meter (``referee``) is within the plan's budget.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from referee import check_auto
from torch import nn

import remat

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(vocab: int = 100, shape: tuple[int, int] = (4, 16)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def _token_loss(out: torch.Tensor) -> torch.Tensor:
    n = out.shape[0] * out.shape[1]
    return F.cross_entropy(out.flatten(0, 1).float(), torch.arange(n) * 7 % out.shape[-1])


class RNNBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.norm(x))
        return x + self.drop(y)


class GRUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(RNNBlock() for _ in range(4))
        self.head = nn.Linear(32, 100)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _relu_inplace_mlp() -> nn.Module:
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 64))
            for _ in range(4)
        ]
    )


def test_selective_blocks_of_grus_give_bitwise_gradients():
    # nn.GRU adds to its gate products in place through unsafe_split chunks, which share
    # the saved addmm output's storage but not its version counter: the saved value was
    # served changed to the recompute (silently wrong gradients, as in torch)
    torch.manual_seed(0)
    p = check_auto(GRUModel(), _tokens(), loss_fn=_token_loss)
    assert "selective" in p.decisions.values()


class _GRUChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.GRU(16, 16, batch_first=True) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return x


def test_flops_cost_of_selective_counts_the_matmuls_the_policy_recomputes():
    # nn.GRU's hidden-state addmm outputs are changed in place (unsafe_split chunks), so the
    # planner's PREFER_SAVE policy recomputes them: one of the two addmm a step, half the
    # block's FLOPs. The FLOPs cost of "selective" counted no matmul at all (0)
    prof = remat.profile(_GRUChain(), torch.randn(4, 8, 16), timer="flops")
    for b in prof.blocks:
        assert b.cost["recompute"] == 8 * 2 * (2 * 4 * 16 * 48)  # 8 steps, 2 addmm each
        assert b.cost["selective"] == b.cost["recompute"] / 2


def test_auto_checkpoint_plans_blocks_that_relu_a_linear_output_in_place():
    # nn.ReLU(inplace=True) on a Linear's output changed the saved matmul output: the
    # profile's selective step raised CheckpointError out of auto_checkpoint
    torch.manual_seed(0)
    p = check_auto(_relu_inplace_mlp(), torch.randn(256, 64), budget="70%")
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


def _vgg() -> nn.Module:
    """torchvision's VGG layout: every layer a block, nn.ReLU(inplace=True) among them."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32),
        nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(inplace=True), nn.Dropout(0.3), nn.Linear(64, 10),
    )  # fmt: skip


def _class_loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, torch.arange(out.shape[0]) % 10)


def test_blocks_that_change_their_input_in_place_are_only_kept():
    # an nn.ReLU(inplace=True) block checkpointed alone changes the input its region keeps:
    # autograd's "modified by an inplace operation" leaked out of auto_checkpoint
    torch.manual_seed(0)
    model = _vgg()
    prof = remat.profile(model, torch.randn(4, 3, 32, 32), timer="flops")
    relus = {b.name for b in prof.blocks if isinstance(model.get_submodule(b.name), nn.ReLU)}
    assert relus == {"2", "5", "9", "13"}
    for b in prof.blocks:
        assert (set(b.cost) == {"keep"}) == (b.name in relus), b.name
    p = check_auto(model, torch.randn(4, 3, 32, 32), budget="75%", loss_fn=_class_loss)
    assert all(p.decisions[n] == "keep" for n in relus)
    assert not any(set(s) & relus for s in p.spans)


def test_profile_with_flops_measures_decisions_without_recompute():
    # step_cost read each block's "recompute" cost: KeyError when it was not measured
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    prof = remat.profile(model, torch.randn(4, 8), decisions=["keep", "selective"], timer="flops")
    assert prof.step_cost == 3 * 3 * 2 * 4 * 8 * 8  # three forwards' FLOPs of three matmuls


class UNet(nn.Module):
    """Skip connections across blocks (not a chain): encoder outputs reused by the decoder."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()

        def conv(i: int, o: int, stride: int = 1) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1), nn.GroupNorm(2, o), nn.SiLU())

        self.blocks = nn.ModuleList(
            [
                conv(3, c),
                conv(c, 2 * c, 2),
                conv(2 * c, 4 * c, 2),
                conv(4 * c, 2 * c),
                conv(4 * c, c),
                nn.Conv2d(2 * c, 3, 3, padding=1),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        e1 = b[0](x)
        e2 = b[1](e1)
        d2 = b[3](F.interpolate(b[2](e2), scale_factor=2))
        d1 = b[4](F.interpolate(torch.cat([d2, e2], 1), scale_factor=2))
        return b[5](torch.cat([d1, e1], 1))


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
    from remat._spans import apply_span

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

    from remat._spans import spans_in
    from remat._wrap import wrapping_state

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


class ViewBlocks(nn.Module):
    """Blocks that return views of what the block before returned (Unflatten, Flatten)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Linear(64, 128), nn.Unflatten(1, (2, 64)), nn.Flatten()]
            + [nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 64)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_a_block_returning_a_view_of_its_input_does_not_end_a_span():
    # a span [Linear, Unflatten] was predicted to free the Linear's output, which the
    # Unflatten's view keeps: the floor plan measured 128 KiB over its prediction
    torch.manual_seed(0)
    model, x = ViewBlocks(), torch.randn(256, 64)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, x, optimizer=opt, timer="flops")
    assert prof.chained == [False, False, True, True, True]
    p = remat.plan(prof, prof.floor_bytes + prof.scratch_bytes)
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
