"""``remat.checkpoint`` and selective checkpointing inside torch.compile: traced like torch's
checkpoint, no graph break.

Slow (compiles); run with ``-m slow``. ``aot_eager`` runs the traced ATen ops
without fusion, so gradients are bitwise those of eager.
"""

from __future__ import annotations

import functools

import pytest
import torch

import remat

pytestmark = pytest.mark.slow


class CountingBackend:
    """A torch.compile backend that counts the graphs it receives, then runs aot_eager."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def block(lin: torch.nn.Module):
    def f(t, *, scale):
        return (lin(t).tanh() * scale).exp()

    return f


@pytest.mark.parametrize(
    "options",
    [
        {},  # defaults
        {"early_stop": False},  # the option is passed on
        {"determinism_check": "values"},  # remat-only mode: acts as "default" when traced
        {"use_reentrant": None},  # None is the non-reentrant variant
    ],
)
def test_compiled_checkpoint_gives_eager_grads_in_one_graph(options):
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    f = block(lin)

    def step(t):
        return remat.checkpoint(f, t, scale=0.5, **options).sum()

    loss = f(x, scale=0.5).sum()
    ref = [loss.detach(), *torch.autograd.grad(loss, [x, *lin.parameters()])]

    dynamo.reset()
    backend = CountingBackend()
    loss = torch.compile(step, backend=backend, fullgraph=True)(x)
    got = [loss.detach(), *torch.autograd.grad(loss, [x, *lin.parameters()])]
    assert backend.graphs == 1
    for r, g in zip(ref, got):
        assert torch.equal(r, g)

    dynamo.reset()
    explained = dynamo.explain(step)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    dynamo.reset()


def test_compiled_dropout_inside_checkpoint_matches_torch_checkpoint():
    import torch._dynamo as dynamo
    import torch.utils.checkpoint as tuc

    x = torch.randn(4, 8, requires_grad=True)

    def body(t):
        return torch.nn.functional.dropout(t.sin(), 0.5, training=True).exp()

    def run(ck):
        dynamo.reset()
        torch.manual_seed(3)
        loss = torch.compile(lambda t: ck(body, t).sum(), backend="aot_eager", fullgraph=True)(x)
        return [loss.detach(), *torch.autograd.grad(loss, x)]

    ref = run(lambda fn, t: tuc.checkpoint(fn, t, use_reentrant=False))
    got = run(remat.checkpoint)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    dynamo.reset()


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
