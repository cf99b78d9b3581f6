"""checkpoint_wrapper / unwrap / apply_activation_checkpointing: identity, gradients, corner cases.

The corner cases (a buffer reassigned in forward, forward keywords named like checkpoint
options, eval between forward and backward, applying twice, DataParallel replicas) each
pin a fixed bug, compared with the plain module.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from tests.support.models import BNBlock


class Net(nn.Module):
    def __init__(self, n=4, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(BNBlock(d) for _ in range(n))
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
    assert isinstance(block, BNBlock) and type(block) is BNBlock
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
        block = BNBlock()
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
    block = BNBlock()
    remat.checkpoint_wrapper(block)
    fwd = block.forward
    assert remat.checkpoint_wrapper(block) is block and block.forward is fwd
    with pytest.raises(ValueError, match="already wrapped with other options"):
        remat.checkpoint_wrapper(block, use_reentrant=True)


def test_unwrap_restores_the_plain_module():
    block = BNBlock()
    remat.checkpoint_wrapper(block)
    remat.unwrap(block)
    assert "forward" not in block.__dict__ and "[remat" not in repr(block)
    assert remat.unwrap(block) is block  # no-op when not wrapped


def test_policy_and_context_fn_together_are_rejected():
    with pytest.raises(ValueError, match="either policy"):
        remat.checkpoint_wrapper(
            BNBlock(), policy=[torch.ops.aten.mm.default], context_fn=remat.noop_context_fn
        )


def test_no_grad_and_disable_checkpointing_run_the_plain_module():
    block = BNBlock()
    remat.checkpoint_wrapper(block)
    seen = []
    orig = BNBlock.forward

    def spy(self, x):
        seen.append(remat.is_checkpointing())
        return orig(self, x)

    BNBlock.forward = spy
    try:
        with torch.no_grad():
            block(torch.randn(4, 16))
        with remat.disable_checkpointing():
            block(torch.randn(4, 16))
        block(torch.randn(4, 16))
    finally:
        BNBlock.forward = orig
    assert seen == [False, False, True]


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


# ---------------------------------------------------------------- corner cases (fixed bugs)


VARIANTS = [
    {},  # non-reentrant
    {"use_reentrant": True},
    {"policy": remat.policies.save_matmuls()},  # selective
]


def grads(model):
    return [p.grad for p in model.parameters()]


def assert_equal_lists(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x is not None and y is not None and torch.equal(x, y)


class Reassigns(nn.Module):
    """Assigns a new tensor to its buffer in forward instead of changing it in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step = self.step + 1
        return self.lin(x) * self.step


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_buffer_reassigned_in_forward_recomputes_with_its_forward_value(kwargs):
    torch.manual_seed(0)
    ref = Reassigns()
    model = remat.checkpoint_wrapper(copy.deepcopy(ref), **kwargs)
    for _ in range(2):
        x = torch.randn(2, 4)
        ref(x).sum().backward()
        model(x).sum().backward()
    assert model.step.item() == ref.step.item() == 2  # was 4: the recompute assigned it again
    assert_equal_lists(grads(model), grads(ref))


class Keywords(nn.Module):
    """A forward whose keywords share names with checkpoint()'s own options."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self,
        x,
        function=None,
        debug=False,
        early_stop=None,
        determinism_check=None,
        context_fn=None,
        preserve_rng_state=None,
        use_reentrant=None,
    ):
        seen = (
            function,
            debug,
            early_stop,
            determinism_check,
            context_fn,
            preserve_rng_state,
            use_reentrant,
        )
        scale = 1.0 + sum(v is not None and v is not False for v in seen)
        return self.lin(x) * scale


@pytest.mark.parametrize("kwargs", VARIANTS)
@pytest.mark.parametrize(
    "name",
    [
        "function",
        "debug",
        "early_stop",
        "determinism_check",
        "context_fn",
        "preserve_rng_state",
        "use_reentrant",
    ],
)
def test_forward_keywords_named_like_checkpoint_options_reach_the_forward(kwargs, name):
    torch.manual_seed(0)
    ref = Keywords()
    model = remat.checkpoint_wrapper(copy.deepcopy(ref), **kwargs)
    x = torch.randn(3, 4)
    want = ref(x, **{name: "value"})
    got = model(x, **{name: "value"})  # was swallowed by checkpoint, or raised TypeError
    assert torch.equal(got, want)
    want.sum().backward()
    got.sum().backward()
    assert_equal_lists(grads(model), grads(ref))


def test_forward_keyword_named_like_checkpoint_option_under_compile():
    torch.manual_seed(0)
    ref = Keywords()
    model = remat.checkpoint_wrapper(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    compiled = torch.compile(lambda t: model(t, debug=True), backend="eager", fullgraph=True)
    assert torch.allclose(compiled(x), ref(x, debug=True))


class DropoutBNBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(F.gelu(self.bn(self.fc(x))))


def model_and_copy():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), DropoutBNBlock(), nn.Linear(8, 8))
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_eval_between_forward_and_backward_recomputes_in_forward_mode(kwargs):
    ref, model = model_and_copy()
    remat.checkpoint_wrapper(model[1], **kwargs)
    x = torch.randn(6, 8)
    outs = []
    for m in (ref, model):
        torch.manual_seed(1)
        y = m(x)
        m.eval()  # e.g. an evaluation callback before backward
        y.sum().backward()  # was: CheckpointError, or (reentrant) silently wrong gradients
        outs.append(torch.get_rng_state())
        assert not any(sub.training for sub in m.modules())  # left as the caller set it
    assert torch.equal(outs[0], outs[1])
    assert_equal_lists(grads(model), grads(ref))
    for a, b in zip(ref.buffers(), model.buffers()):
        assert torch.equal(a, b)


def test_apply_twice_does_not_wrap_inside_an_already_wrapped_module():
    _, model = model_and_copy()
    assert remat.apply_activation_checkpointing(model) == ["0", "1", "2"]
    names = remat.apply_activation_checkpointing(
        model, check_fn=lambda n, m: isinstance(m, nn.Linear)
    )
    assert names == ["0", "2"]  # not "1.fc", inside the wrapped "1"
    assert "forward" not in model[1].fc.__dict__


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_data_parallel_replica_runs_with_its_own_parameters(use_reentrant):
    # nn.DataParallel replicates a module by a shallow copy of its __dict__ and then gives
    # the replica its own parameters; its forward must use those, not the original's.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    remat.checkpoint_wrapper(lin, use_reentrant=use_reentrant)
    replica = lin._replicate_for_data_parallel()
    w = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    replica._parameters["weight"], replica._parameters["bias"] = w, b
    x = torch.randn(3, 4, requires_grad=True)
    y = replica(x)
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    y.sum().backward()
    assert w.grad is not None and lin.weight.grad is None
    assert "remat: checkpointed" in repr(replica)
    assert remat.unwrap(lin) is lin and "_replicate_for_data_parallel" not in lin.__dict__
