"""``remat.planner.meta.AsDevice``: attention on meta tensors saves for backward what the CPU
kernel saves (shapes and dtypes), whatever mask and grouping it is given."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from remat.planner.meta import AsDevice

B, H, L, E = 2, 4, 64, 8  # batch, query heads, sequence, head size


def _saved(device: str, mask: str, kv_heads: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what attention saves for backward on ``device``."""
    q = torch.empty(B, H, L, E, device=device, requires_grad=True)
    k, v = (torch.empty(B, kv_heads, L, E, device=device, requires_grad=True) for _ in "kv")
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L).contiguous()
    masks = {
        "none": None,
        "bool": causal,
        "float": torch.zeros(B, 1, L, L).masked_fill(~causal, -1e9),
    }
    m = masks[mask]
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    routed = AsDevice(torch.device("cpu")) if device == "meta" else contextlib.nullcontext()
    with routed, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if m is None else m.to(device), enable_gqa=kv_heads != H
        )
    return saved


@pytest.mark.parametrize(
    ("mask", "kv_heads"),
    [
        ("none", H),  # the flash kernel: a logsumexp, no L x L weights
        ("bool", H),  # made additive first: the float mask is saved, not the boolean one
        ("float", H),  # an additive mask, saved as it is
        ("none", 2),  # grouped-query attention: flash keeps the unexpanded keys and values
        ("bool", 2),  # both
    ],
)
def test_attention_on_meta_saves_what_the_cpu_kernel_saves(mask, kv_heads):
    assert _saved("meta", mask, kv_heads) == _saved("cpu", mask, kv_heads)
