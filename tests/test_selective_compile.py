"""Selective checkpointing inside torch.compile: torch's traced path, no graph break."""

from __future__ import annotations

import functools

import pytest
import torch

import remat

pytestmark = pytest.mark.slow


def test_compiled_selective_checkpoint_matches_eager_without_graph_break():
    import torch._dynamo as dynamo

    w = torch.randn(16, 16, requires_grad=True)

    def f(x):
        return torch.mm(x, w).sin().cos()

    ctx_fn = functools.partial(
        remat.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )

    def step(x):
        return remat.checkpoint(f, x, context_fn=ctx_fn).sum()

    x = torch.randn(8, 16, requires_grad=True)
    f(x).sum().backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    dynamo.reset()
    explained = dynamo.explain(step)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    dynamo.reset()
    torch.compile(step, backend="aot_eager")(x).backward()
    assert torch.allclose(x.grad, ref[0]) and torch.allclose(w.grad, ref[1])
