"""The profile's probes (remat.planner.probes), each on its own on small chains of blocks:
what it records, to the byte.

The chains run a bias-free ``Linear(8, 8)`` before their blocks on a ``(4, 8)`` float32
input, so every activation is 128 bytes and every weight (and its gradient) 256 bytes.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

from remat import memory
from remat.memory import BlockHooks
from remat.planner.probes import (
    CallCount,
    InputFrees,
    OffloadFindings,
    OffloadProbe,
    TimelineProbe,
    WindowMarks,
    WindowProbe,
    dead_storage_bytes,
    kept_outputs,
    offload_inputs,
    storage_keys,
    storage_sizes,
    stored,
)
from remat.planner.scratch import _WINDOW
from remat.planner.state import StepState
from remat.planner.types import Decision, Window, WindowKind

pytestmark = pytest.mark.usefixtures("one_thread")

ACT = 4 * 8 * 4  # bytes of one activation
WEIGHT = 8 * 8 * 4  # bytes of one weight, and of its gradient


class Linear(nn.Linear):
    """A block that saves its input (for its weight's gradient)."""

    def __init__(self) -> None:
        super().__init__(8, 8, bias=False)


class Scale(nn.Module):
    """A block that saves nothing: its input is free once it returns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Tanh(nn.Module):
    """A block that saves its output (``tanh``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = Linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Chain(nn.Module):
    """``pre``, then each block on the one before's output; the loss is the sum. With
    ``hold``, the forward keeps each block's input until the next block has returned; with
    ``collect``, every block's output to the end of forward (a list of hidden states)."""

    def __init__(self, *blocks: nn.Module, hold: bool = False, collect: bool = False) -> None:
        super().__init__()
        self.pre = Linear()
        self.blocks = nn.ModuleList(blocks)
        self.hold, self.collect = hold, collect

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        prev, hidden = None, []
        for b in self.blocks:
            prev, x = (x if self.hold else None), b(x)
            if self.collect:
                hidden.append(x)
        del prev, hidden
        return x.sum()


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _forward(model: nn.Module, probe: Any, backward: bool = False) -> None:
    """One forward (and backward) of ``model`` on a fresh input with ``probe`` on its blocks."""
    with BlockHooks(list(model.blocks), probe):
        loss = model(_x())
        if backward:
            loss.backward()


# ---------------------------------------------------------------- storages


def test_storage_keys_one_key_for_a_view_none_for_an_empty_tensor():
    t = torch.zeros(4, 8)
    assert storage_keys(t) == storage_keys(t[1:]) != set()
    assert storage_keys(torch.zeros(0)) == set()


def test_stored_counts_each_storage_once_and_its_death():
    a, b = torch.zeros(4, 8), torch.zeros(2, 8)
    entries = stored([a, a[1:], b, torch.zeros(0)])  # a view of ``a``, an empty tensor
    assert [nbytes for _, nbytes, _ in entries] == [ACT, ACT // 2]
    assert dead_storage_bytes(entries) == 0
    del b
    assert dead_storage_bytes(entries) == ACT // 2


def test_stored_sees_a_storage_that_outlives_its_tensor():
    a = torch.zeros(4, 8)
    keep = a[:2]  # another tensor on a's storage
    entries = stored([a])
    del a
    assert dead_storage_bytes(entries) == 0
    del keep
    assert dead_storage_bytes(entries) == ACT


def test_storage_sizes_skips_dead_empty_subclass_and_other_device_tensors():
    a, dead = torch.zeros(4, 8), torch.zeros(2, 8)
    param = nn.Parameter(torch.zeros(8, 8))  # a subclass: its storage is its own
    meta = torch.zeros(4, 8, device="meta")
    tensors = [a, a[1:], dead, torch.zeros(0), param, meta]
    refs = [weakref.ref(t) for t in tensors]
    del tensors, dead
    assert [b for _, b in storage_sizes(refs, None)] == [ACT, ACT]  # ``a`` once, ``meta``
    assert [b for _, b in storage_sizes(refs, torch.device("cpu"))] == [ACT]


# ---------------------------------------------------------------- CallCount


def test_call_count_counts_calls_in_call_order_and_chains_blocks():
    model = Chain(Linear(), Linear(), Linear())
    model.blocks = nn.ModuleList(model.blocks[::-1])  # called in another order than named
    names = ["c", "b", "a"]
    calls = CallCount(names)
    _forward(model, calls)
    assert calls.counts == [1, 1, 1]
    assert calls.in_call_order() == names
    assert calls.chained == [True, True]
    assert calls.mutating == set()
    calls.check()


def test_call_count_orders_blocks_by_their_first_call():
    model = Chain(Linear(), Linear())
    calls = CallCount(["first", "second", "never"])
    with BlockHooks([model.blocks[1], model.blocks[0], Linear()], calls):
        model(_x())
    assert calls.in_call_indices() == [1, 0, 2]  # the block never called last
    assert calls.in_call_order() == ["second", "first", "never"]


class AddOne(nn.Module):
    """A chain whose forward adds 1 between its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Linear(), Linear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x) + 1).sum()


class Flat(nn.Module):
    """A chain whose second block returns a view of the first's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Linear(), nn.Flatten(0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x)).sum()


@pytest.mark.parametrize(
    "model",
    [
        AddOne(),  # the model's code between the blocks: the second gets a new tensor
        Flat(),  # a view of the first's output: a span ending there would keep it alive
    ],
    ids=["code-between", "view"],
)
def test_call_count_does_not_chain_blocks_apart(model):
    calls = CallCount(["a", "b"])
    _forward(model, calls)
    assert calls.chained == [False]


def test_call_count_names_a_block_that_changes_its_input_in_place():
    calls = CallCount(["relu", "lin"])
    _forward(Chain(nn.ReLU(inplace=True), Linear()), calls)
    assert calls.mutating == {"relu"}


class Twice(nn.Module):
    """Calls its first block twice and never its second."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Linear(), Linear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.blocks[0](x)).sum()


def test_call_count_refuses_a_block_run_twice_or_never():
    calls = CallCount(["a", "b"])
    _forward(Twice(), calls)
    assert calls.counts == [2, 0]
    with pytest.raises(ValueError, match="'a' ran 2 times, 'b' ran 0 times"):
        calls.check()


# ---------------------------------------------------------------- windows


class Windows(WindowProbe):
    """The window changes a step makes, as (ending, starting) labels."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.changes: list[tuple[str, str]] = []

    def enter(self, window: Window) -> None:
        self.changes.append((self.current.label, window.label))


STEP = ["fwd:0", "fwd:1", "fwd:2", "top", "bwd:2", "bwd:1", "bwd:0", "post"]


def test_window_probe_enters_each_window_of_a_step_once_in_order():
    probe = Windows(3)
    _forward(Chain(Linear(), Linear(), Linear()), probe, backward=True)
    assert probe.changes == list(zip(["pre", *STEP], STEP))
    assert probe.current == Window(WindowKind.POST)


def test_window_probe_has_no_post_window_where_the_first_block_needs_no_input_grad():
    model = Chain(Linear(), Linear())
    probe = Windows(2)
    with BlockHooks(list(model.blocks), probe):
        loss = model.blocks[1](model.blocks[0](_x())).sum()  # no layer before the blocks
        loss.backward()
    assert probe.current == Window(WindowKind.BWD, 0)


def test_window_marks_label_the_windows_in_the_profiler_events():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _forward(Chain(Linear(), Linear(), Linear()), WindowMarks(3), backward=True)
    marks = [e.name[len(_WINDOW) :] for e in prof.events() if e.name.startswith(_WINDOW)]
    assert marks == STEP


def _timeline(model: nn.Module, n: int) -> TimelineProbe:
    params, x = list(model.parameters()), _x()  # the input made before the step
    with memory.track() as tracker:
        probe = TimelineProbe(tracker, n, params, None)
        try:
            with BlockHooks(list(model.blocks), probe):
                model(x).backward()
                probe.finish()
        finally:
            probe.remove()
    return probe


def test_timeline_probe_reads_the_bytes_at_each_window():
    line = _timeline(Chain(Linear(), Linear(), Linear()), 3).line
    assert line.pre_peak == ACT  # pre's output
    assert line.input_bytes == [ACT] * 3
    # each Linear saves its input: one activation more at each block's start
    assert line.fwd_start == [ACT, 2 * ACT, 3 * ACT]
    assert line.fwd_peak == line.fwd_tail == [2 * ACT, 3 * ACT, 4 * ACT]  # and its output
    assert line.top_start == 4 * ACT
    assert line.top_peak == 4 * ACT + 4  # the loss
    assert line.top_grads == 0
    # each block's backward ends with its weight's gradient: blocks 2, 1, 0 in turn
    assert line.bwd_grads == [3 * WEIGHT, 2 * WEIGHT, WEIGHT]
    assert line.end_grads == 4 * WEIGHT  # pre's too
    assert line.outputs_freed == [0, 0]


class Aux(nn.Module):
    """A block returning its output and a second tensor the model drops."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = Linear()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.zeros(2, 8)


class AuxChain(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for b in self.blocks:
            x, _ = b(x)
        return x.sum()


def test_timeline_probe_counts_outputs_the_next_block_did_not_receive_alive_at_top():
    line = _timeline(AuxChain(Aux(), Aux(), Aux()), 3).line
    # The dropped (2, 8) tensors alive when the last block returns and dead before their
    # block's backward: block 1's (``_`` holds it to the end of forward), not block 0's
    # (block 1's replaced it in ``_``: it died in forward)
    assert line.outputs_freed == [0, ACT // 2]


def test_timeline_probe_puts_clear_autocast_cache_back():
    real = torch.clear_autocast_cache
    with memory.track() as tracker:
        probe = TimelineProbe(tracker, 1, [], None)
        assert torch.clear_autocast_cache != real
        probe.remove()
    assert torch.clear_autocast_cache is real


# ---------------------------------------------------------------- InputFrees


def _frees(model: Chain) -> InputFrees:
    x = _x()
    frees = InputFrees(model, len(model.blocks), [x])
    try:
        with BlockHooks(list(model.blocks), frees):
            model(x)
    finally:
        frees.remove()
    return frees


def test_input_frees_counts_outputs_the_next_block_frees():
    # A Scale saves nothing: each block's output dies while the next runs, the last's as
    # the forward returns (the sum saves none of it)
    assert _frees(Chain(Scale(), Scale(), Scale())).freed == [ACT] * 3
    # A Linear saves its input: only the last block's output dies
    assert _frees(Chain(Linear(), Linear(), Linear())).freed == [0, 0, ACT]


def test_input_frees_counts_inputs_held_to_the_end_of_forward():
    # the forward holds each block's input past the block; nothing else does
    found = _frees(Chain(Scale(), Scale(), Scale(), hold=True))
    assert found.held_to_end == [ACT] * 3
    assert found.freed == [0, ACT, ACT]  # block 0's output: held while block 2 runs
    # a Linear saves its input into backward: alive when forward returns
    assert _frees(Chain(Linear(), Linear(), hold=True)).held_to_end == [0, 0]


class Masked(nn.Module):
    """Blocks that each receive a mask the forward makes (a shared argument)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.pre = Linear()
        self.blocks = nn.ModuleList(Adds() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, mask = self.pre(x), torch.ones(4, 8)
        for b in self.blocks:
            x = b(x, mask)
        return x.sum()


class Adds(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + mask  # saves neither


def test_input_frees_counts_an_argument_passed_to_several_blocks_once():
    found = _frees(Masked(3))  # type: ignore[arg-type]
    assert found.shared == ACT  # the mask, dead when forward returns
    assert found.freed[:2] == [ACT, ACT]  # the outputs, not the mask: no block's own


# ---------------------------------------------------------------- kept_outputs


def _state(model: nn.Module) -> StepState:
    return StepState(model, [], None, torch.device("cpu"))


def _kept(model: Chain) -> list[bool]:
    return kept_outputs(model, list(model.blocks), (_x(),), {}, _state(model))


def test_kept_outputs_marks_outputs_the_model_keeps_past_the_next_block():
    blocks = [Linear() for _ in range(4)]
    # read when the block after next starts: the last two blocks have none
    assert _kept(Chain(*blocks, collect=True)) == [True, True, False, False]
    # without gradients nothing saves the outputs: they die
    assert _kept(Chain(*blocks)) == [False] * 4


class NeedsGrad(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("this model needs gradients in forward")
        return super().forward(x)


def test_kept_outputs_records_nothing_where_the_forward_without_gradients_fails():
    assert _kept(NeedsGrad(Linear(), Linear(), collect=True)) == [False, False]


# ---------------------------------------------------------------- offload


BEFORE = [Decision.KEEP, Decision.SELECTIVE]


def _offload(model: Chain, x: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    x = _x() if x is None else x
    return offload_inputs(model, list(model.blocks), (x,), {}, _state(model), BEFORE)


def test_offload_inputs_frees_inputs_nothing_else_holds():
    # a Scale saves nothing, so nothing holds its input once it returns; never the last's
    assert _offload(Chain(Scale(), Scale(), Scale(), Scale())) == ([ACT, ACT, ACT, 0], [0] * 4)


def test_offload_inputs_frees_no_input_a_block_saves():
    # On CPU offload leaves saved tensors where they are: a Linear's input (block 1's, 3's)
    # and a tanh's output (block 2's input) stay alive
    assert _offload(Chain(Scale(), Tanh(), Scale(), Tanh())) == ([ACT, 0, 0, 0], [0] * 4)


def test_offload_probe_holds_a_first_argument_that_needs_no_gradient():
    found = OffloadFindings(2)
    probe = OffloadProbe([Decision.OFFLOAD] * 2, True, found)
    model = Chain(Linear(), Scale())
    with BlockHooks(list(model.blocks), probe):
        model.blocks[1](model.blocks[0](_x()))  # no layer before: block 0's input needs none
        probe.end()
    assert found.held == [True, True]  # block 0's: no gradient; the last block's: always
    assert found.size == [0, ACT]
    assert found.alone == [False, True]  # the last block's input: dead when forward returns


# --- keep_lifetimes: where a tensor several blocks receive lives with every block kept


class _BiasBlock(nn.Module):
    """``x + lin(x) <op> bias``: ``add`` saves neither operand, ``mul`` saves both."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.lin, self.op = nn.Linear(4, 4), op

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return x + (h + bias if self.op == "add" else h * bias)


class _BiasChain(nn.Module):
    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.ones(4))
        self.blocks = nn.ModuleList(_BiasBlock(op) for op in ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.table * 2.0  # 16 bytes every block receives
        for b in self.blocks:
            x = b(x, bias)
        return x


@pytest.mark.parametrize(
    "ops, saved",
    [
        (["add", "add", "add"], None),  # nobody saves it: dies as the forward returns
        (["add", "mul", "mul"], 1),  # the first block that multiplies saves it: lives on
    ],
)
def test_keep_lifetimes_finds_who_saves_a_shared_tensor_and_where_it_dies(ops, saved):
    from remat.planner.probes import keep_lifetimes

    model = _BiasChain(ops)
    x = torch.randn(2, 4, requires_grad=True)
    with memory.track() as t:
        probe = keep_lifetimes(model, list(model.blocks), (x,), {}, _state(model), [x])
    (arg,) = probe.shared()
    # role: the first block that received it, its place among that block's tensor arguments
    # (the model's input x, not counted)
    assert (arg.role, arg.nbytes, arg.blocks, arg.many) == ((0, 0), 16, [0, 1, 2], True)
    assert probe.saved.get(arg.role) == saved
    # in the probe (its saved tensors dropped) it dies as the forward returns (window 3)
    # either way; with every block kept, what saved it holds it on
    assert probe.died.get(arg.role) == 3
    # the saved tensors were dropped: no block's activations outlived the forward
    assert t.current_bytes == 0


def test_input_frees_counts_a_dead_output_whose_storage_key_a_later_input_took():
    # block 0's output (received by block 1) died in block 1's window; a later storage took
    # its key (the address of a freed StorageImpl is reused) and was handed to block 2 before
    # freed[0] is read: the death is still block 0's output dying in the next block
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    frees = InputFrees(model, 3, [])
    try:
        y = torch.zeros(32)
        ref = weakref.ref(y.untyped_storage())
        key = 12345  # one key for both storages, as a reused address gives
        frees.inputs[1] = [(ref, 128, key)]
        frees._received(1)
        del y
        later = torch.zeros(32)
        frees.inputs[2] = [(weakref.ref(later.untyped_storage()), 128, key)]
        frees._received(2)
        assert frees._freed(0, [(ref, 128, key)]) == 128
        # handed on past the next block: not a free of the next block's (shared_inputs)
        frees.tracked[key].blocks.append(3)
        frees.done[0].blocks.append(3)
        assert frees._freed(0, [(ref, 128, key)]) == 0
    finally:
        frees.remove()
