"""What a span refuses (remat.modules.spans), each with an error that says what to do: a forward that
is not a chain of its blocks, a skip connection inside it, an early exit, a block called on
its own, compile and DataParallel, bad arguments to ``apply_span``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.modules.spans import apply_span, remove_span, spans_in
from tests.support.models import GPT, GPTBlock, spanned

# -- refusals: not a chain ---------------------------------------------------------------


class Custom(nn.Module):
    """A chain of GPT blocks run by ``body(self, x, mask)``, for the refusal tests."""

    def __init__(self, body, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(GPTBlock(16) for _ in range(n))
        self.body = body

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        return self.body(self, x, mask).square().mean()


def _run(model):
    x = torch.randn(2, 8, 16, requires_grad=True)
    model(x).backward()


def _in_order(m, x, mask):
    for layer in m.layers:
        x = layer(x, mask=mask)
    return x


@pytest.mark.parametrize(
    ("body", "match"),
    [
        # the model changes the hidden state between the blocks
        (
            lambda m, x, mask: _in_order_with(m, x, mask, lambda h: h * 2),
            "did not receive the output of layers.1",
        ),
        # the blocks are called in another order than given
        (
            lambda m, x, mask: m.layers[1](m.layers[0](m.layers[2](x, mask=mask), mask=mask)),
            "layers.2 was called, but layers.1 did not run just before it .no block of the span",
        ),
        # a block skipped
        (
            lambda m, x, mask: m.layers[3](m.layers[2](m.layers[0](x, mask=mask), mask=mask)),
            "layers.2 was called, but layers.1 did not run just before it",
        ),
        # a block repeated
        (
            lambda m, x, mask: m.layers[1](m.layers[1](m.layers[0](x, mask=mask), mask=mask)),
            "layers.1 was called, but layers.0 did not run just before it",
        ),
        # the hidden states are kept (output_hidden_states)
        (lambda m, x, mask: _hidden_states(m, x, mask), "output of layers.0 is still referenced"),
        # changed in place between blocks
        (
            lambda m, x, mask: _in_order_with(m, x, mask, lambda h: h.mul_(1.0)),
            "changed in place before layers.2",
        ),
    ],
)
def test_non_chain_forward_is_refused_with_a_clear_error(body, match):
    model = Custom(body)
    apply_span(model, [f"layers.{i}" for i in range(4)])
    with pytest.raises(remat.PlanError, match=match) as info:
        _run(model)
    assert "checkpoint" in str(info.value) or "end the span" in str(info.value).lower()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # the same model without the span runs
    remove_span(model, "layers.0")
    _run(model)


def _in_order_with(m, x, mask, between):
    for i, layer in enumerate(m.layers):
        x = layer(x, mask=mask)
        if i == 1:
            x = between(x)
    return x


def test_a_skip_connection_inside_the_span_is_refused():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, skip=None):
            y = torch.tanh(self.fc(x))
            return y if skip is None else y + skip

    class UNetish(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Skip() for _ in range(3))

        def forward(self, x):
            h0 = self.layers[0](x)
            h1 = self.layers[1](h0)
            return self.layers[2](h1, skip=h0).sum()  # layers.0's output reaches layers.2

    model = UNetish()
    apply_span(model, ["layers.0", "layers.1", "layers.2"])
    with pytest.raises(remat.PlanError, match="layers.2 received a tensor that layers.0 returned"):
        model(torch.randn(2, 8, requires_grad=True))
    apply_span(model := UNetish(), ["layers.0", "layers.1"])  # a span that ends before: fine
    model(torch.randn(2, 8, requires_grad=True)).backward()


def _hidden_states(m, x, mask):
    kept = []
    for layer in m.layers:
        x = layer(x, mask=mask)
        kept.append(x)
    return x + sum(h.sum() for h in kept[:-1])


def test_kept_hidden_states_are_refused_on_the_meta_device_too():
    # every meta tensor's data is at address 0: the outputs' storages are told apart as
    # storages (a profile from shapes runs a plan applied to a meta model)
    with torch.device("meta"):
        model = Custom(_hidden_states)
        apply_span(model, [f"layers.{i}" for i in range(4)])
        with pytest.raises(remat.PlanError, match="output of layers.0 is still referenced"):
            model(torch.empty(2, 8, 16)).backward()


def test_early_exit_is_refused_in_backward():
    model = Custom(lambda m, x, mask: m.layers[1](m.layers[0](x, mask=mask), mask=mask))
    apply_span(model, [f"layers.{i}" for i in range(4)])
    with pytest.raises(remat.PlanError, match="stopped after layers.1 .layers.2 never ran"):
        _run(model)


def test_a_block_of_a_span_called_on_its_own_with_grad_is_refused():
    model = spanned(GPT(), [[0, 1, 2]])
    with pytest.raises(remat.PlanError, match="no block of the span ran before it"):
        model.layers[1](torch.randn(2, 4, 16, requires_grad=True))


def test_under_compile_a_span_refuses(monkeypatch):
    model = spanned(GPT(), [[0, 1]])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(remat.PlanError, match="eager mode only"):
        model.layers[0](torch.randn(2, 4, 16, requires_grad=True))


def test_data_parallel_replicate_is_refused():
    model = spanned(GPT(), [[0, 1]])
    with pytest.raises(remat.PlanError, match="DataParallel"):
        model.layers[0]._replicate_for_data_parallel()


# -- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "kw", "match"),
    [
        ([], {}, "non-empty list of block names"),
        ("layers.0", {}, "non-empty list of block names"),
        (["layers.0", "layers.9"], {}, "no submodule 'layers.9'"),
        (["layers.0", "layers.0"], {}, "named twice"),
        (["layers.0", "layers.0.attn"], {}, "nested"),
        (["layers.0", ""], {}, "non-empty strings"),
        (["layers.0", "layers.1"], {"inner": "fast"}, "inner must be one of"),
        (["layers.0", "layers.1"], {"inner": "selective"}, "policy goes with inner='selective'"),
        (["layers.0", "layers.1"], {"policy": [torch.ops.aten.mm.default]}, "policy goes with"),
        (["layers.0", "layers.1"], {"offload_inputs": True}, "nothing to do on CPU"),
    ],
)
def test_apply_span_rejects_bad_arguments(names, kw, match):
    model = GPT()
    with pytest.raises(remat.PlanError, match=match):
        apply_span(model, names, **kw)
    assert spans_in(model) == []


def test_apply_span_rejects_wrapped_or_spanned_blocks_and_shared_modules():
    model = GPT()
    remat.checkpoint_wrapper(model.layers[1])
    with pytest.raises(remat.PlanError, match="unwrap"):
        apply_span(model, ["layers.0", "layers.1"])
    remat.unwrap(model.layers[1])
    apply_span(model, ["layers.0", "layers.1"])
    with pytest.raises(remat.PlanError, match="already in a span"):
        apply_span(model, ["layers.1", "layers.2"])
    shared = nn.Sequential()
    block = nn.Linear(4, 4)
    shared.add_module("a", block)
    shared.add_module("b", block)
    with pytest.raises(remat.PlanError, match="same module"):
        apply_span(shared, ["a", "b"])
    with pytest.raises(remat.PlanError, match="not a block of a span"):
        remove_span(model, "layers.3")


def test_offload_inputs_on_cpu_is_refused_in_forward_for_blocks_without_parameters():
    model = nn.Sequential(nn.Tanh(), nn.Sigmoid())
    apply_span(model, ["0", "1"], offload_inputs=True)  # no parameter tells the device yet
    with pytest.raises(remat.PlanError, match="offload_inputs=True.*on cpu"):
        model(torch.randn(3, requires_grad=True))
