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


def assert_all_equal(ref: list[Any], got: list[Any], what: str = "") -> None:
    """Two lists of tensors are bitwise equal (``torch.equal``), ``None`` where the other is;
    ``what`` starts the message of a failure."""
    said = f"{what}: " if what else ""
    assert len(ref) == len(got), f"{said}{len(ref)} tensors vs {len(got)}"
    for i, (r, g) in enumerate(zip(ref, got)):
        if r is None or g is None:
            assert r is None and g is None, f"{said}entry {i}: {r} vs {g}"
        else:
            assert torch.equal(r, g), f"{said}entry {i} differs{_by(r, g)}"


def assert_dicts_equal(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Two dicts of tensors have the same keys and bitwise equal values (``torch.equal``)."""
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs{_by(ref[k], got[k])}"


def _by(a: torch.Tensor, b: torch.Tensor) -> str:
    """By how much ``a`` and ``b`` differ, where they can be compared."""
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
        return f" ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})"
    return f" (max abs {float((a - b).abs().max())})"
