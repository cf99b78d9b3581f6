"""Counted work (remat.planner.counting): each operator of a block's forward with its FLOPs,
the bytes it moves and whether the selective decision's cache saves it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.bench.models import build, example_input
from remat.planner.counting import count_blocks, count_call
from tests.support.models import SMALL_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


class _LinearReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)).view(-1)


def test_linear_counts_its_flops_and_bytes_and_is_saved_by_the_selective_cache():
    torch.manual_seed(0)
    block = _LinearReLU()
    model = nn.Sequential(block)
    _, counts = count_blocks(model, {"0": block}, (torch.randn(4, 8),), {})
    by_op = {c.op.split(".")[1]: c for c in counts["0"]}
    assert set(by_op) >= {"addmm", "relu", "view"}
    mm = by_op["addmm"]
    assert mm.kind == "mm" and mm.saved and mm.dtype == torch.float32
    assert mm.flops == 2 * 4 * 8 * 16
    # bias (16), input (4x8), weight transposed (8x16; a view's bytes are its elements'), out
    assert mm.bytes == 4 * (16 + 4 * 8 + 8 * 16 + 4 * 16)
    relu = by_op["relu"]
    assert relu.kind == "other" and not relu.saved and relu.flops == 0
    assert relu.bytes == 4 * (2 * 4 * 16)
    assert by_op["view"].bytes == 0  # a view moves nothing


def test_dropout_is_counted_as_random():
    drop = nn.Dropout(0.5)
    counts = count_call(lambda: drop(torch.ones(64)))
    assert any(c.kind == "random" for c in counts)


def test_counts_are_the_same_in_two_runs():
    model = build(SMALL_GPT)
    blocks = {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    x = example_input(SMALL_GPT)
    assert count_blocks(model, blocks, (x,), {}) == count_blocks(model, blocks, (x,), {})


def test_identical_blocks_have_identical_counts():
    model = build(SMALL_GPT)
    blocks = {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    _, counts = count_blocks(model, blocks, (example_input(SMALL_GPT),), {})
    first = counts["blocks.0"]
    assert len(first) > 10 and all(counts[n] == first for n in blocks)
    assert any(c.saved for c in first) and any(not c.saved for c in first)


def test_autocast_counts_matmuls_in_its_dtype():
    block = _LinearReLU()
    model = nn.Sequential(block)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, counts = count_blocks(model, {"0": block}, (torch.randn(4, 8),), {})
    mm = next(c for c in counts["0"] if "addmm" in c.op)
    assert mm.dtype == torch.bfloat16 and mm.bytes == 2 * (16 + 4 * 8 + 8 * 16 + 4 * 16)


def test_cpu_fused_attention_counts_the_flops_of_its_two_matmuls():
    # torch's flop counter has no formula for CPU's fused kernel: counted as 0 it was priced
    # by its bytes alone, as a pointwise call
    from remat.planner.counting import count_call, op_class

    q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
    fused = count_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    (call,) = [c for c in fused if "attention" in c.op]
    assert call.kind == "mm" and op_class(call) == "attention"
    # the same attention written out: q @ k^T and the weights @ v
    written = count_call(lambda: torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v)
    assert call.flops == sum(c.flops for c in written) == 4 * 2 * 4 * 64 * 64 * 16


def test_cpu_fused_attention_with_fewer_key_heads_counts_the_query_heads():
    # grouped-query attention (Llama's key/value heads): torch 2.11's own formula refuses it
    from remat.planner.counting import count_call

    q, k = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16)
    fused = count_call(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    )
    (call,) = [c for c in fused if "attention" in c.op]
    assert call.flops == 4 * 2 * 4 * 64 * 64 * 16
