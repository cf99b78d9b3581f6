"""Property: any nn.Sequential, checkpointed in any segments, gives the plain gradients.

Hypothesis draws a chain of random layers (dropout included, so RNG replay is
exercised), random cut points, which segments are checkpointed, the variant,
early stop and an optional outer region around everything. Loss and every
gradient must be bitwise equal to the plain run from the same seed.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat

D = 6
LAYERS = {
    "linear": lambda: torch.nn.Linear(D, D),
    "tanh": torch.nn.Tanh,
    "gelu": torch.nn.GELU,
    "relu": torch.nn.ReLU,
    "silu": torch.nn.SiLU,
    "layernorm": lambda: torch.nn.LayerNorm(D),
    "dropout": lambda: torch.nn.Dropout(0.3),
}


class Segment(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module], how: str, early_stop: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*layers)
        self.how = how
        self.early_stop = early_stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "plain":
            return self.body(x)
        if self.how == "reentrant":
            return remat.checkpoint(self.body, x, use_reentrant=True)
        return remat.checkpoint(self.body, x, early_stop=self.early_stop)


@st.composite
def chains(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=8))
    cuts = sorted(draw(st.sets(st.integers(1, len(kinds)), max_size=len(kinds))))
    bounds = [0, *[c for c in cuts if c < len(kinds)], len(kinds)]
    hows = draw(
        st.lists(
            st.sampled_from(["plain", "nonreentrant", "reentrant"]),
            min_size=len(bounds) - 1,
            max_size=len(bounds) - 1,
        )
    )
    return kinds, bounds, hows, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 99))


def run(model: torch.nn.Module, x: torch.Tensor, outer: bool, seed: int):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = remat.checkpoint(model, x) if outer else model(x)
    loss = (out * torch.linspace(-1, 1, D)).square().sum()
    loss.backward()
    return (
        [loss.detach(), x.grad] + [p.grad for p in model.parameters()],
        torch.get_rng_state(),
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(chains())
def test_random_sequential_random_segments_grads_equal_plain(chain):
    kinds, bounds, hows, early_stop, outer, seed = chain
    torch.manual_seed(seed)
    layers = [LAYERS[k]() for k in kinds]
    plain = torch.nn.Sequential(*layers)
    segmented = torch.nn.Sequential(
        *[Segment(layers[a:b], how, early_stop) for a, b, how in zip(bounds[:-1], bounds[1:], hows)]
    )
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    ref, ref_rng = run(plain, x, False, seed)
    got, rng = run(segmented, x, outer, seed)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert (r is None and g is None) or torch.equal(r, g)
    assert torch.equal(rng, ref_rng)
