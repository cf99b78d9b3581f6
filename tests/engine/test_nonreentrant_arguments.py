"""A tensor passed to a region more than once is one object again in recompute.

``nn.MultiheadAttention`` takes its packed self-attention path only when ``query is key is
value``; a recompute that hands it three different objects takes the other path, saves
other tensors (non-reentrant: a metadata error, as torch's nested checkpoint raises) or
rounds differently (reentrant: gradients that are not bitwise those of the plain run).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat

pytestmark = pytest.mark.usefixtures("one_thread")


def _attention() -> tuple[nn.MultiheadAttention, nn.Linear]:
    torch.manual_seed(0)
    return nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 32)


def _grads(run, attn: nn.Module, lin: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    attn.zero_grad(set_to_none=True)
    lin.zero_grad(set_to_none=True)
    x.grad = None
    run(lin(x)).pow(2).sum().backward()
    return [x.grad, *(p.grad for p in (*attn.parameters(), *lin.parameters()))]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_tensor_passed_three_times_is_one_object_in_recompute_and_grads_are_bitwise(
    use_reentrant,
):
    attn, lin = _attention()
    x = torch.randn(2, 8, 32, requires_grad=True)
    same: list[bool] = []

    def self_attention(q, k, v):
        same.append(q is k and k is v)
        return attn(q, k, v, need_weights=False)[0]

    plain = _grads(lambda h: self_attention(h, h, h), attn, lin, x)
    got = _grads(
        lambda h: remat.checkpoint(self_attention, h, h, h, use_reentrant=use_reentrant),
        attn,
        lin,
        x,
    )
    assert same == [True, True, True]  # plain, forward, recompute
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a, b)


def test_distinct_tensors_stay_distinct_and_get_their_own_gradients():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    seen: list[bool] = []

    def f(x, y):
        seen.append(x is y)
        return x * y.sin()

    for reentrant in (False, True):
        remat.checkpoint(f, a, b, use_reentrant=reentrant).sum().backward()
        assert torch.equal(a.grad, b.detach().sin())
        assert torch.equal(b.grad, a.detach() * b.detach().cos())
        a.grad = b.grad = None
    assert seen == [False] * 4


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_repeated_argument_gets_the_sum_of_its_uses_gradients_once(use_reentrant):
    def f(p, q, r):
        return p * q + r

    x = torch.randn(5, requires_grad=True)
    f(x, x, x).sum().backward()
    plain, x.grad = x.grad, None
    remat.checkpoint(f, x, x, x, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(x.grad, plain)
    assert torch.allclose(plain, 2 * x.detach() + 1)


class _Block(nn.Module):
    """A transformer block whose attention is called as self-attention (h, h, h)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(x)


def test_nested_checkpoint_around_wrapped_self_attention_recomputes_and_grads_are_bitwise():
    # torch 2.13's nested checkpoint raises a metadata mismatch on this block.
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 8, 32, requires_grad=True)
    block(x).sum().backward()
    plain = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    x.grad = None
    remat.checkpoint_wrapper(block.attn)
    remat.checkpoint(block, x, use_reentrant=False).sum().backward()
    got = [x.grad, *(p.grad for p in block.parameters())]
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a, b)
