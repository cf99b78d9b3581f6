"""The non-reentrant engine as torch's code sees it: torch's phrases in its errors, the
operators a ``context_fn`` recompute context sees, and torch's own saved-tensor hooks
(``save_on_cpu``) around remat's checkpoints."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat

CHECKPOINTS = {
    "torch": lambda fn, *a, **k: tuc.checkpoint(fn, *a, use_reentrant=False, **k),
    "remat": lambda fn, *a, **k: remat.checkpoint(fn, *a, **k),
}


def changes_in_recompute(first, then):
    """A function that runs ``first`` in forward and ``then`` in every later call."""
    calls = [0]

    def fn(x):
        calls[0] += 1
        return first(x) if calls[0] == 1 else then(x)

    return fn


def save_2(x):
    return x.sin().exp()


def save_2_other_shape(x):
    return x.sin() * torch.tensor([1.0, 2.0])


# -- torch's phrases --------------------------------------------------------------------

DEBUG_PHRASE = "You are seeing this error because you passed `debug=True` to checkpoint"


@pytest.mark.usefixtures("fresh_logging_tensor_logger")
@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize(
    "setting, debug, phrase",
    [
        (None, True, True),  # debug=True on the call
        (True, False, True),  # the setting overrides the call's False
        (False, True, False),  # the setting overrides the call's True: torch's plain message
    ],
)
def test_debug_mismatch_says_debug_was_passed_in_torchs_words(name, setting, debug, phrase):
    ckpt = CHECKPOINTS[name]
    a = torch.randn(1, requires_grad=True)
    fn = changes_in_recompute(save_2, save_2_other_shape)
    ctx = (
        contextlib.nullcontext()
        if setting is None
        else (
            tuc.set_checkpoint_debug_enabled(setting)
            if name == "torch"
            else remat.set_checkpoint_debug_enabled(setting)
        )
    )
    with pytest.raises(tuc.CheckpointError) as info:
        with ctx:
            ckpt(fn, a, debug=debug).backward()
    text = str(info.value)
    assert (DEBUG_PHRASE in text) is phrase
    if not phrase:
        assert "Recomputed values for the following tensors have different" in text


def test_remats_debug_message_goes_on_with_its_own_advice():
    a = torch.randn(1, requires_grad=True)
    fn = changes_in_recompute(save_2, save_2_other_shape)
    with pytest.raises(remat.CheckpointError) as info:
        remat.checkpoint(fn, a, debug=True).backward()
    text = str(info.value)
    after = text[text.index(DEBUG_PHRASE) :]
    assert "remat.is_recomputing()" in after  # what to do, after torch's sentence
    assert "Operators run in forward and in recompute" in text  # the side-by-side table


OVERLAP_PHRASE = "Performing two backward calls that overlap"


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_overlapping_backward_in_a_group_raises_torchs_phrase(name):
    x = torch.randn(5, requires_grad=True)
    y = CHECKPOINTS[name](lambda t: t.sin().exp(), x)
    with tuc.GraphExecGroup():
        torch.autograd.grad(y.sum(), x, retain_graph=True)
        with pytest.raises(tuc.CheckpointError, match=OVERLAP_PHRASE) as info:
            torch.autograd.grad(y.sum(), x)
    assert "Unpack is being triggered for a tensor that was already unpacked once" in str(
        info.value
    )


def test_overlap_phrase_is_only_said_inside_a_group():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors  # noqa: B018 - read twice on purpose
            (t,) = ctx.saved_tensors
            return g * t

    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(lambda t: Twice.apply(t.sin()), x)
    with pytest.raises(remat.CheckpointError) as info:
        y.sum().backward()
    assert OVERLAP_PHRASE not in str(info.value)
    assert "read it once" in str(info.value)


# -- what a context_fn's recompute context sees ------------------------------------------


class OpLogger(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "fn, forward_ops, recompute_ops",
    [
        # exp saves its output: recompute detaches it before handing it to backward
        (lambda x: x.exp(), ["exp.default"], ["exp.default", "detach.default"]),
        # sin saves its input (before it runs: autograd saves inputs first), exp its output
        (
            lambda x: x.sin().exp(),
            ["sin.default", "exp.default"],
            ["detach.default", "sin.default", "exp.default", "detach.default"],
        ),
    ],
    ids=["exp", "sin-exp"],
)
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_context_fn_contexts_see_torchs_operators(name, fn, forward_ops, recompute_ops):
    fwd, rec = OpLogger(), OpLogger()
    a = torch.tensor(1.0, requires_grad=True)
    out = CHECKPOINTS[name](fn, a, context_fn=lambda: (fwd, rec))
    out.backward()
    assert fwd.ops == forward_ops
    assert rec.ops == recompute_ops


# -- torch's save_on_cpu around remat's checkpoints ---------------------------------------


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def step_under_save_on_cpu(blocks, x, run_block):
    """Forward in ``save_on_cpu``, then backward: (bytes alive at the end of forward,
    the gradients of every parameter and of ``x``)."""
    for p in blocks.parameters():
        p.grad = None
    x.grad = None
    with remat.memory.track() as t:
        with torch.autograd.graph.save_on_cpu():
            h = x
            for block in blocks:
                h = run_block(block, h)
            loss = h.square().sum()
        kept = t.current_bytes
        del h
        loss.backward()
    return kept, [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]


RUNNERS = {
    "plain": lambda b, h: b(h),
    "torch": lambda b, h: tuc.checkpoint(b, h, use_reentrant=False),
    "remat": lambda b, h: remat.checkpoint(b, h),
    "remat-reentrant": lambda b, h: remat.checkpoint(b, h, use_reentrant=True),
}


@pytest.fixture
def blocks():
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(3))


def test_save_on_cpu_around_remat_keeps_what_it_keeps_around_torchs(blocks):
    x = torch.randn(32, 64, requires_grad=True)
    act = 32 * 64 * 4  # one block's input or output
    runs = {name: step_under_save_on_cpu(blocks, x, run) for name, run in RUNNERS.items()}
    # On CPU, save_on_cpu keeps a saved CPU tensor as it is (tensor.cpu() is the tensor).
    # A checkpointed step keeps the inputs of blocks 1 and 2 (block 0's is x, from before),
    # the last output (saved by square) and the loss.
    expected = 2 * act + act + 4
    assert runs["torch"][0] == expected
    assert runs["remat"][0] == expected
    assert runs["remat-reentrant"][0] == expected
    assert runs["plain"][0] > expected
    for name in ("torch", "remat", "remat-reentrant"):
        for got, want in zip(runs[name][1], runs["plain"][1]):
            assert torch.equal(got, want), name


def test_save_on_cpu_around_wrapped_blocks_gives_the_same_grads_and_bytes(blocks):
    x = torch.randn(32, 64, requires_grad=True)
    torch_kept, torch_grads = step_under_save_on_cpu(blocks, x, RUNNERS["torch"])
    remat.apply_activation_checkpointing(blocks, check_fn=lambda name, m: isinstance(m, Block))
    kept, grads = step_under_save_on_cpu(blocks, x, RUNNERS["plain"])
    assert kept == torch_kept
    for got, want in zip(grads, torch_grads):
        assert torch.equal(got, want)


def test_remat_inside_save_on_cpu_hands_its_inputs_to_the_outer_hooks(blocks):
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    x = torch.randn(32, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in blocks:
            h = remat.checkpoint(block, h)
    # one input per region; nothing from inside the regions
    assert packed == [torch.Size([32, 64])] * 3
    h.sum().backward()
