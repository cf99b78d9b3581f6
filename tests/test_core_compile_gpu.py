"""torch.compile (slow) and CUDA (gpu) behaviour of remat.checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import remat

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.parametrize("early_stop", [True, False])
def test_compiled_checkpoint_matches_eager_without_graph_break(early_stop):
    import torch._dynamo as dynamo

    lin = torch.nn.Linear(8, 8)

    def step(x):
        return remat.checkpoint(lambda t: lin(t).tanh().exp(), x, early_stop=early_stop).sum()

    x = torch.randn(4, 8, requires_grad=True)
    lin(x).tanh().exp().sum().backward()
    ref = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.zero_grad()
    dynamo.reset()
    explained = dynamo.explain(step)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    dynamo.reset()
    torch.compile(step, backend="aot_eager")(x).backward()
    assert torch.allclose(x.grad, ref[0]) and torch.allclose(lin.weight.grad, ref[1])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_cuda_dropout_rng_replayed_and_global_cuda_rng_restored(use_reentrant):
    x = torch.randn(64, 64, device="cuda", requires_grad=True)

    def f(t):
        return F.dropout(t, 0.5, training=True).exp()

    torch.manual_seed(0)
    f(x).sum().backward()
    ref, ref_rng = x.grad.clone(), torch.cuda.get_rng_state()
    x.grad = None
    torch.manual_seed(0)
    remat.checkpoint(f, x, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(x.grad, ref)
    assert torch.equal(torch.cuda.get_rng_state(), ref_rng)


@needs_cuda
@pytest.mark.gpu
def test_cuda_autocast_bf16_replayed():
    lin = torch.nn.Linear(32, 32, device="cuda")
    x = torch.randn(8, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_out = lin(x)
    ref_out.float().sum().backward()
    ref = x.grad.clone()
    x.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = remat.checkpoint(lin, x)
    y.float().sum().backward()
    assert torch.equal(x.grad, ref)
