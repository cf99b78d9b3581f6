"""Planner helpers: a plan of given decisions, the per-block floor, the step-model tests'
models and optimizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import remat
from remat.bench.models import build, example_input
from remat.planner.solve import smallest_chain
from remat.planner.types import Span
from tests.support.models import TINY_GPT, MLPNet


def plan_of(prof: Any, ds: Sequence[str], spans: Sequence[Sequence[int]] = ()) -> remat.Plan:
    """A :class:`remat.Plan` of given decisions and spans (block indices ``(first, last)``,
    or ``(first, last, 1)`` for a span whose input is offloaded), as plan() makes it, with
    the profile's prediction as its peak and budget."""
    names = [b.name for b in prof.blocks]
    spans = [Span.of(s) for s in spans]
    expected = prof.peak(list(ds), spans).bytes
    named = [[names[s.first], names[s.last]] for s in spans]
    return remat.Plan(
        decisions=dict(zip(names, ds)),
        predicted_peak_bytes=expected,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=prof.unchecked_peak_bytes,
        budget_bytes=expected,
        spans=named,
        offloaded_spans=[n for n, s in zip(named, spans) if s.offloaded],
    )


def make_model(name: str) -> tuple[nn.Module, torch.Tensor]:
    """``"gpt"``: the built-in GPT at :data:`TINY_GPT` and its input; ``"mlp"``:
    :class:`MLPNet` and a 16-row batch."""
    if name == "gpt":
        return build(TINY_GPT), example_input(TINY_GPT)
    torch.manual_seed(0)
    return MLPNet(), torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def make_optimizer(name: str | None, model: nn.Module) -> torch.optim.Optimizer | None:
    """``None``, ``"adamw"`` or ``"sgd-momentum"`` over the model's parameters."""
    if name is None:
        return None
    if name == "adamw":
        return torch.optim.AdamW(model.parameters())
    assert name == "sgd-momentum"
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def per_block_floor(prof: remat.Profile) -> int:
    """The smallest predicted step peak of one decision per block (no spans)."""
    return prof.peak(smallest_chain(prof.blocks, prof.top, prof.decisions, 1)[0]).bytes


def wide_mlp() -> tuple[nn.Module, torch.Tensor]:
    """Parameters dominate (two-row batch): AdamW's state and step outweigh the activations."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)]), torch.randn(2, 128)


def json_differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """The fields of two JSON documents (parsed) that differ: ``(path, a's, b's)``."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in json_differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b))
        return [d for i, (x, y) in pairs for d in json_differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [(path, a, b)]


def measured_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """:func:`json_differences` of two profiles' JSON but their scratch, ``from_shapes`` (a
    profile that measures its scratch under the plan, from shapes or pair steps) and
    ``steps`` (how its lines were measured)."""
    return [
        d
        for d in json_differences(a, b)
        if "scratch" not in d[0] and d[0] not in (".from_shapes", ".steps")
    ]
