"""checkpoint_wrapper / unwrap / apply_activation_checkpointing: identity, gradients, side effects."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.bn = nn.BatchNorm1d(2 * d)
        self.out = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.out(F.gelu(self.bn(self.fc(x)))))


class Net(nn.Module):
    def __init__(self, n=4, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Sequential(nn.Linear(d, d), nn.ReLU())  # smaller container

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train_steps(model, steps=3, seed=0):
    torch.manual_seed(seed)
    grads = []
    for i in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        model.zero_grad()
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(a, b):
    ga, sa = a
    gb, sb = b
    for step_a, step_b in zip(ga, gb):
        for x, y in zip(step_a, step_b):
            assert torch.equal(x, y)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # non-reentrant, full recompute
        {"use_reentrant": True},
        {"policy": [torch.ops.aten.addmm.default]},  # selective: save the linears' outputs
        {"policy": remat.policies.save_matmuls()},
        {"offload_to_cpu": True},  # CPU-only: inputs stay in host memory as they are
        {"preserve_rng_state": True, "context_fn": remat.noop_context_fn},
    ],
)
def test_wrapped_model_grads_and_buffers_equal_unchecked_bitwise(kwargs):
    ref = train_steps(Net())
    model = Net()
    remat.apply_activation_checkpointing(model, **kwargs)
    assert_same(train_steps(model), ref)


def names_and_types(model):
    """What wrapping must not change: parameter, module, buffer and state_dict names, types."""
    return (
        [n for n, _ in model.named_parameters()],
        [n for n, _ in model.named_modules()],
        [n for n, _ in model.named_buffers()],
        list(model.state_dict()),
        [repr(type(m)) for m in model.modules()],
    )


def test_wrapper_keeps_identity_names_and_state_dict_keys():
    model = Net()
    before = names_and_types(model)
    block = model.layers[1]
    assert remat.checkpoint_wrapper(block) is block
    assert isinstance(block, Block) and type(block) is Block
    assert names_and_types(model) == before
    assert "[remat: checkpointed]" in repr(block)


def test_state_dict_of_wrapped_model_loads_into_plain_and_back():
    wrapped = Net()
    remat.apply_activation_checkpointing(wrapped)
    train_steps(wrapped, steps=1)
    plain = Net()
    plain.load_state_dict(wrapped.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(v, wrapped.state_dict()[k])
    again = Net()
    remat.apply_activation_checkpointing(again)
    again.load_state_dict(plain.state_dict())
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in again.state_dict().items())


def test_apply_default_wraps_children_of_largest_container_every_nth():
    model = Net(n=5)
    assert remat.apply_activation_checkpointing(model) == [f"layers.{i}" for i in range(5)]
    model = Net(n=5)
    assert remat.apply_activation_checkpointing(model, every=2) == [
        "layers.0",
        "layers.2",
        "layers.4",
    ]
    model = Net(n=5)
    names = remat.apply_activation_checkpointing(
        model, check_fn=lambda n, m: isinstance(m, nn.Linear)
    )
    assert "inp" in names and "layers.0.fc" in names and "head.0" in names


def test_default_blocks_are_the_repeated_ones_not_the_longest_container():
    # four blocks of five layers each: the longest container is one block's own layers, the
    # repeated blocks are the four (found by the swept unseen models: plans of blocks.0.*)
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(
                    nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                    nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
                )  # fmt: skip
                for _ in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = x + b(x)
            return x

    assert remat.apply_activation_checkpointing(Stack()) == [f"blocks.{i}" for i in range(4)]
    # a tie (two blocks; two Linears in each block's MLP): the container of one class wins
    mlp = lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))  # noqa: E731
    two = nn.ModuleList([nn.Sequential(nn.LayerNorm(4), mlp()) for _ in range(2)])
    assert remat.apply_activation_checkpointing(two) == ["0", "1"]
    prof = remat.profile(Stack(), torch.randn(2, 4, 8, 8), timer="flops")
    assert [b.name for b in prof.blocks] == [f"blocks.{i}" for i in range(4)]


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_apply_rejects_bad_every(every):
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        remat.apply_activation_checkpointing(Net(), every=every)


def test_hooks_run_once_per_call_not_again_in_recompute():
    model = Net(n=1)
    block = model.layers[0]
    calls = {"pre": 0, "post": 0, "bwd": 0}
    block.register_forward_pre_hook(lambda m, a: calls.__setitem__("pre", calls["pre"] + 1))
    block.register_forward_hook(lambda m, a, o: calls.__setitem__("post", calls["post"] + 1))
    block.register_full_backward_hook(lambda m, gi, go: calls.__setitem__("bwd", calls["bwd"] + 1))
    remat.checkpoint_wrapper(block)
    model(torch.randn(4, 16)).sum().backward()
    assert calls == {"pre": 1, "post": 1, "bwd": 1}


def test_wrapping_adds_no_reference_cycle():
    gc.collect()
    gc.disable()
    try:
        block = Block()
        remat.checkpoint_wrapper(block)
        block(torch.randn(4, 16)).sum().backward()
        ref = weakref.ref(block)
        del block
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_deepcopy_and_pickle_point_at_the_copy():
    model = Net(n=2)
    remat.apply_activation_checkpointing(model)
    dup = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (dup, loaded):
        assert m.layers[0].forward.ref() is m.layers[0]
        assert_same(train_steps(m, steps=1), train_steps(Net(n=2), steps=1))


def test_wrapping_twice_same_options_is_noop_other_options_raise():
    block = Block()
    remat.checkpoint_wrapper(block)
    fwd = block.forward
    assert remat.checkpoint_wrapper(block) is block and block.forward is fwd
    with pytest.raises(ValueError, match="already wrapped with other options"):
        remat.checkpoint_wrapper(block, use_reentrant=True)


def test_unwrap_restores_the_plain_module():
    block = Block()
    remat.checkpoint_wrapper(block)
    remat.unwrap(block)
    assert "forward" not in block.__dict__ and "[remat" not in repr(block)
    assert remat.unwrap(block) is block  # no-op when not wrapped


def test_policy_and_context_fn_together_are_rejected():
    with pytest.raises(ValueError, match="either policy"):
        remat.checkpoint_wrapper(
            Block(), policy=[torch.ops.aten.mm.default], context_fn=remat.noop_context_fn
        )


def test_no_grad_and_disable_checkpointing_run_the_plain_module():
    block = Block()
    remat.checkpoint_wrapper(block)
    seen = []
    orig = Block.forward

    def spy(self, x):
        seen.append(remat.is_checkpointing())
        return orig(self, x)

    Block.forward = spy
    try:
        with torch.no_grad():
            block(torch.randn(4, 16))
        with remat.disable_checkpointing():
            block(torch.randn(4, 16))
        block(torch.randn(4, 16))
    finally:
        Block.forward = orig
    assert seen == [False, False, True]


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


def test_batchnorm_stats_updated_once_also_without_backward():
    ref, model = Net(), Net()
    remat.apply_activation_checkpointing(model)
    x = torch.randn(8, 16)
    torch.manual_seed(1)
    ref(x)
    torch.manual_seed(1)
    model(x)  # forward only
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    assert model.layers[0].bn.num_batches_tracked.item() == 1


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


@pytest.mark.slow
def test_compiled_wrapped_model_matches_eager_without_graph_break():
    import torch._dynamo as dynamo

    model = Net(n=2)
    model.eval()  # no dropout/batch-stat randomness between compiled and eager
    x = torch.randn(8, 16)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    remat.apply_activation_checkpointing(model)
    dynamo.reset()
    explained = dynamo.explain(model)(x)
    assert explained.graph_break_count == 0
    dynamo.reset()
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    for p, r in zip(model.parameters(), ref):
        assert torch.allclose(p.grad, r, atol=1e-6)


def test_policy_given_as_partial_still_selective():
    model = Net(n=2)
    pol = functools.partial(lambda ctx, op, *a, **k: op == torch.ops.aten.addmm.default)
    remat.apply_activation_checkpointing(model, policy=pol)
    assert_same(train_steps(model, steps=1), train_steps(Net(n=2), steps=1))


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_to_cpu_moves_region_inputs_off_the_device():
    d = 1024
    block = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)).cuda()
    x = torch.randn(2048, d, device="cuda", requires_grad=True)
    h = x * 1.0  # a device activation: the region's input
    ref = block(h).sum()
    ref.backward(retain_graph=True)
    ref_grad = x.grad.clone()
    x.grad = None
    remat.checkpoint_wrapper(block)
    y1 = block(h * 1.0)
    torch.cuda.synchronize()
    kept_plain = torch.cuda.memory_allocated()
    del y1
    remat.unwrap(block)
    remat.checkpoint_wrapper(block, offload_to_cpu=True)
    h2 = h * 1.0
    y2 = block(h2)
    del h2  # only the offloaded copy keeps the region's input now
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= kept_plain - 2048 * d * 4 + 4096
    y2.sum().backward()
    assert torch.allclose(x.grad, ref_grad)


class _TiedHead(nn.Module):
    """Reads a weight it does not own (tied to an embedding elsewhere, not registered here)."""

    def __init__(self, emb):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.__dict__["tied"] = emb.weight

    def forward(self, x):
        return (self.lin(x) @ self.tied.t()).tanh()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_weight_the_module_reads_but_does_not_own_still_gets_its_gradient(use_reentrant):
    torch.manual_seed(0)
    emb = nn.Embedding(5, 8)
    head = _TiedHead(emb)
    x = torch.randn(3, 8, requires_grad=True)
    head(x).sum().backward()
    ref = [emb.weight.grad.clone(), x.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    emb.weight.grad = x.grad = None
    head.zero_grad(set_to_none=True)
    remat.checkpoint_wrapper(head, use_reentrant=use_reentrant)
    head(x).sum().backward()
    got = [emb.weight.grad, x.grad] + [p.grad for p in head.parameters()]
    for r, g in zip(ref, got):
        assert g is not None and torch.equal(r, g)
