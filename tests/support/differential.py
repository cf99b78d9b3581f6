"""What the differential tests (test_*_differential.py) share: outcomes and their comparison."""

from __future__ import annotations

import dataclasses

import torch

from tests.support.tensors import assert_all_equal


@dataclasses.dataclass
class Outcome:
    """One run of a random program: its error, or its output, gradients and RNG state."""

    error: BaseException | None = None
    out: torch.Tensor | None = None
    grads: list[torch.Tensor | None] | None = None
    rng: torch.Tensor | None = None
    grads_again: list[torch.Tensor | None] | None = None  # from a second backward
    again_error: BaseException | None = None  # what the second backward raised
    fwd_bytes: int | None = None
    torch_frozen_warned: bool = False
    repeated_args: bool = False  # a region got one tensor as two arguments


def assert_matches_reference(ref: Outcome, got: Outcome, what: str) -> None:
    """``got`` ran like the uncheckpointed ``ref``: output, gradients, RNG, second backward."""
    assert got.error is None, f"{what} raised where the uncheckpointed run did not: {got.error!r}"
    assert ref.out is not None and got.out is not None
    assert torch.equal(ref.out, got.out), f"{what}: outputs differ"
    assert ref.grads is not None and got.grads is not None
    assert_all_equal(ref.grads, got.grads, f"{what}: gradients")
    assert ref.rng is not None and got.rng is not None
    assert torch.equal(ref.rng, got.rng), f"{what}: RNG state after backward differs"
    if got.grads_again is not None:
        want = ref.grads_again if ref.grads_again is not None else ref.grads
        assert want is not None
        assert_all_equal(want, got.grads_again, f"{what}: the other backward")


def seeded_linear(g: torch.Generator, d: int) -> torch.nn.Linear:
    """A ``d x d`` Linear with weights drawn from ``g`` (scaled to keep values moderate)."""
    lin = torch.nn.Linear(d, d)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d, d, generator=g) * 0.3)
        lin.bias.copy_(torch.randn(d, generator=g))
    return lin
