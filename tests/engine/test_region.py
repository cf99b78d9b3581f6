"""What one call of a wrapped module runs (remat.engine.region): the class's forward with its keywords
and outputs, guarded against side effects in recompute.

Buffers changed in forward, a Hugging Face-style layer with a cache, keyword arguments and
dataclass outputs, object and list arguments the caller changes after forward,
``is_recomputing`` guards: each compared with the plain module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import remat


class Counting(nn.Module):
    """Reads and bumps its own buffer in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step += 1
        return self.lin(x) * self.step


def test_buffers_changed_in_forward_recompute_bitwise_and_update_once():
    ref_model, model = Counting(), Counting()
    model.load_state_dict(ref_model.state_dict())
    remat.checkpoint_wrapper(model)
    for _ in range(3):
        x = torch.randn(2, 4)
        ref_model(x).sum().backward()
        model(x).sum().backward()
    assert model.step.item() == ref_model.step.item() == 3
    assert torch.equal(model.lin.weight.grad, ref_model.lin.weight.grad)


# ------------------------------------------------------------- Hugging Face-style decoder layer


class Cache:
    def __init__(self):
        self.keys: list[torch.Tensor] = []

    def update(self, k):
        self.keys.append(k)
        return torch.cat(self.keys, dim=1)


@dataclasses.dataclass
class LayerOutput:
    hidden: torch.Tensor
    attn: torch.Tensor | None


class DecoderLayer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_embeddings=None,
        past_key_value=None,
        use_cache=False,
        output_attentions=False,
    ):
        cos, sin = position_embeddings
        q = self.q(hidden_states) * cos + sin
        k = self.k(hidden_states)
        if use_cache and past_key_value is not None:
            k = past_key_value.update(k)
        scores = q @ k.transpose(1, 2)
        if attention_mask is not None:
            scores = scores + attention_mask[..., : k.shape[1]]
        attn = scores.softmax(-1)
        out = self.o(attn @ k)
        return (
            hidden_states + out,
            attn if output_attentions else None,
            past_key_value if use_cache else None,
        )


def hf_inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    pos = (torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g))
    mask = torch.zeros(2, 5, 5)
    return h, pos, mask


def test_hf_style_layer_with_kwargs_tuple_outputs_and_none():
    torch.manual_seed(0)
    ref, layer = DecoderLayer(), DecoderLayer()
    layer.load_state_dict(ref.state_dict())
    remat.checkpoint_wrapper(layer)
    grads = []
    for m in (ref, layer):
        h, pos, mask = hf_inputs()
        out, attn, cache = m(
            h, attention_mask=mask, position_embeddings=pos, use_cache=False, output_attentions=True
        )
        assert cache is None
        (out.sum() + attn.sum()).backward()
        grads.append([h.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_cache_append_repeated_in_recompute_raises_naming_module():
    layer = remat.checkpoint_wrapper(DecoderLayer())
    h, pos, mask = hf_inputs()
    cache = Cache()
    out, _, _ = layer(
        h, attention_mask=mask, position_embeddings=pos, past_key_value=cache, use_cache=True
    )
    assert len(cache.keys) == 1
    with pytest.raises(
        remat.CheckpointError,
        match=r"DecoderLayer.*past_key_value.*Cache.*use_cache=False.*is_recomputing",
    ):
        out.sum().backward()


class _Seen:
    """A plain object (passed by reference, unlike lists, which recompute gets as they were)."""

    def __init__(self):
        self.items: list[torch.Tensor] = []


class _ObjArg(nn.Module):
    def __init__(self, guarded_append=False, reads_length=False):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.guarded_append = guarded_append
        self.reads_length = reads_length

    def forward(self, x, seen):
        y = self.lin(x)
        if self.reads_length:
            y = y.reshape(len(seen.items) + 4, 3)  # x has 4 rows: fits only while empty
        if self.guarded_append and not remat.is_recomputing():
            seen.items.append(y.detach())
        return y.tanh()


def test_object_argument_changed_by_caller_after_forward_is_fine():
    torch.manual_seed(0)
    m = _ObjArg()
    x = torch.randn(12, 3, requires_grad=True)
    m(x, _Seen()).sum().backward()
    ref = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    remat.checkpoint_wrapper(m)
    seen = _Seen()
    y = m(x, seen)
    seen.items.append(torch.zeros(2))  # the caller collects something after the call
    y.sum().backward()
    for a, b in zip(ref, [x.grad] + [p.grad for p in m.parameters()]):
        assert torch.equal(a, b)


def test_side_effect_guarded_with_is_recomputing_runs_once_and_recompute_succeeds():
    m = remat.checkpoint_wrapper(_ObjArg(guarded_append=True))
    x = torch.randn(12, 3, requires_grad=True)
    seen = _Seen()
    m(x, seen).sum().backward()
    assert len(seen.items) == 1 and x.grad is not None


def test_recompute_that_fails_on_an_argument_the_forward_changed_names_it():
    m = remat.checkpoint_wrapper(_ObjArg(guarded_append=True, reads_length=True))
    x = torch.randn(4, 3, requires_grad=True)
    seen = _Seen()
    y = m(x, seen)
    with pytest.raises(
        remat.CheckpointError, match=r"_ObjArg's recompute failed while argument 1 \(_Seen\)"
    ) as info:
        y.sum().backward()
    assert isinstance(info.value.__cause__, RuntimeError)


def test_cache_guarded_with_is_recomputing_works():
    class Guarded(DecoderLayer):
        def forward(self, hidden_states, past_key_value=None, **kw):
            if remat.is_recomputing():
                return super().forward(hidden_states, **kw)
            return super().forward(hidden_states, past_key_value=past_key_value, **kw)

    layer = remat.checkpoint_wrapper(Guarded())
    h, pos, _ = hf_inputs()
    cache = Cache()
    out, _, _ = layer(h, position_embeddings=pos, past_key_value=cache, use_cache=False)
    out.sum().backward()
    assert h.grad is not None


def test_list_argument_is_replayed_as_it_was_when_the_forward_started():
    m = remat.checkpoint_wrapper(_ObjArg())
    seen_lengths = []

    def forward(x, lst):
        seen_lengths.append(len(lst))
        return m.lin(x).tanh()

    x = torch.randn(4, 3, requires_grad=True)
    lst: list[int] = []
    y = remat.checkpoint(forward, x, lst)
    lst.append(1)
    y.sum().backward()
    assert seen_lengths == [0, 0]


class KW(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, scale=1.0, as_dataclass=False):
        y = self.lin(x) * scale
        return LayerOutput(y, None) if as_dataclass else (y, None)


def test_dataclass_outputs_non_reentrant():
    m = remat.checkpoint_wrapper(KW())
    x = torch.randn(3, 4, requires_grad=True)
    out = m(x, scale=2.0, as_dataclass=True)
    assert out.attn is None
    out.hidden.sum().backward()
    assert torch.allclose(x.grad, 2.0 * m.lin.weight.sum(0).expand(3, 4))


def test_reentrant_wrapper_takes_keyword_arguments():
    m = remat.checkpoint_wrapper(KW(), use_reentrant=True)
    x = torch.randn(3, 4, requires_grad=True)
    y, none = m(x, scale=2.0)
    assert none is None
    y.sum().backward()
    assert torch.allclose(x.grad, 2.0 * m.lin.weight.sum(0).expand(3, 4))


def test_is_recomputing_guard_skips_side_effects_in_wrapped_module():
    log = []

    class Logs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if not remat.is_recomputing():
                log.append("step")
            return self.lin(x).tanh()

    m = remat.checkpoint_wrapper(Logs())
    m(torch.randn(2, 4)).sum().backward()
    assert log == ["step"]


def test_reentrant_wrapper_supports_autograd_grad_and_frozen_inputs():
    ref, m = KW(), KW()
    m.load_state_dict(ref.state_dict())
    remat.checkpoint_wrapper(m, use_reentrant=True)
    x = torch.randn(3, 4)  # frozen input: parameters must still get gradients
    (gr,) = torch.autograd.grad(ref(x)[0].sum(), [ref.lin.weight])
    (gm,) = torch.autograd.grad(m(x)[0].sum(), [m.lin.weight])  # torch's reentrant raises here
    assert torch.equal(gr, gm)


def test_reentrant_wrapper_rejects_policy():
    with pytest.raises(ValueError, match="use_reentrant=False"):
        remat.checkpoint_wrapper(KW(), use_reentrant=True, policy=[torch.ops.aten.mm.default])
