"""Seeded inputs, and bitwise comparison of lists of tensors (gradients, losses)."""

from __future__ import annotations

from typing import Any

import torch


def data(*shape: int, seed: int = 1, grad: bool = True, device: str = "cpu") -> torch.Tensor:
    """A seeded standard-normal tensor of ``shape`` (the same values on every call),
    requiring grad unless ``grad=False``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g)
    if device != "cpu":
        t = t.to(device)
    return t.requires_grad_(grad)


def assert_all_equal(ref: list[Any], got: list[Any]) -> None:
    """Two lists of tensors are bitwise equal (``torch.equal``), ``None`` where the other is."""
    assert len(ref) == len(got)
    for i, (r, g) in enumerate(zip(ref, got)):
        if r is None or g is None:
            assert r is None and g is None, f"entry {i}: {r} vs {g}"
        else:
            assert torch.equal(r, g), f"entry {i} differs"
