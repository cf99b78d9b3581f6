"""Spans over several blocks (remat.modules.spans): gradients, state, identity.

Every behaviour is compared bitwise (torch.equal) with the model run without
checkpointing from the same RNG state, dropout on. What a span refuses is in
test_spans_refusals.py, blocks split in parts in test_split.py.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import pickle
import random
import weakref

import pytest
import torch
from torch import nn

import remat
from remat.modules.spans import apply_span, remove_span, span_of, spans_in
from remat.modules.split import split_block
from tests.support.models import GPT, BNChain, MLPChain, gpt_step, spanned
from tests.support.steps import param_grads
from tests.support.tensors import assert_all_equal

INNERS = ["keep", "recompute", "split", "selective"]


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize(
    "groups",
    [
        [[0, 1, 2, 3, 4, 5]],  # one span over every block
        [[0, 1], [2, 3], [4, 5]],  # spans of two
        [[1, 2, 3]],  # a span in the middle, plain blocks around it
    ],
)
def test_span_grads_loss_and_rng_equal_unchecked_bitwise(inner, groups):
    ref, rng = gpt_step(GPT())
    got, rng2 = gpt_step(spanned(GPT(), groups, inner))
    assert_all_equal(ref, got)
    assert torch.equal(rng, rng2)


@pytest.mark.parametrize("seed", range(6))
def test_random_span_partitions_and_inners_equal_unchecked(seed):
    # property: any partition of the chain into spans, plain blocks and per-block
    # checkpoints, with any inner, gives the unchecked gradients
    rnd = random.Random(seed)
    model = GPT(n=7, seed=seed)
    i = 0
    while i < 7:
        k = rnd.randint(1, 4)
        kind = rnd.choice(["span", "span", "plain", "wrap"])
        group = list(range(i, min(i + k, 7)))
        if kind == "span":
            spanned(model, [group], rnd.choice(INNERS))
        elif kind == "wrap":
            for j in group:
                remat.checkpoint_wrapper(model.layers[j])
        i += k
    ref, rng = gpt_step(GPT(n=7, seed=seed), seed=seed)
    got, rng2 = gpt_step(model, seed=seed)
    assert_all_equal(ref, got)
    assert torch.equal(rng, rng2)


@pytest.mark.parametrize(
    ("inner", "runs"),
    [
        # forward, then the span's recompute: every block (the last one stops early,
        # after fc1: fc2 saves gelu's output, the last tensor the span dropped)
        ("keep", 4 + 4),
        # forward; the span's recompute stops when the last block's own checkpoint has
        # taken its input (before its fc1); then each block's checkpoint recomputes it
        ("recompute", 4 + 3 + 4),
    ],
)
def test_span_recomputes_each_block_as_its_inner_says(inner, runs):
    model = MLPChain(n=4)
    calls = []
    for layer in model.layers:
        layer.fc1.register_forward_pre_hook(lambda m, a: calls.append(1))
    apply_span(model, ["layers.0", "layers.1", "layers.2", "layers.3"], inner=inner)
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert len(calls) == runs


@pytest.mark.parametrize("inner", INNERS)
def test_batchnorm_running_stats_updated_once_per_step(inner):
    def steps(model):
        out = []
        for i in range(3):
            torch.manual_seed(i)
            x = torch.randn(8, 16, requires_grad=True)
            model.zero_grad()
            model(x).backward()
            out.append(param_grads(model, x))
        return out, {k: v.clone() for k, v in model.state_dict().items()}

    ref_grads, ref_state = steps(BNChain())
    model = BNChain()
    policy = remat.policies.save_matmuls() if inner == "selective" else None
    apply_span(
        model,
        [f"layers.{i}" for i in range(4)],
        inner=inner if inner != "split" else "keep",
        policy=policy,
    )
    if inner == "split":
        remove_span(model, "layers.0")
        for i in range(4):
            split_block(model, f"layers.{i}", children=["bn", "out"])
        apply_span(model, [f"layers.{i}" for i in range(4)], inner="recompute")
    got_grads, got_state = steps(model)
    for a, b in zip(ref_grads, got_grads):
        assert_all_equal(a, b)
    assert ref_state.keys() == got_state.keys()
    for k in ref_state:
        assert torch.equal(ref_state[k], got_state[k]), k


def test_eval_between_forward_and_backward_does_not_change_the_recompute():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    ref = BNChain()
    ref(x).backward()
    model = BNChain()
    apply_span(model, [f"layers.{i}" for i in range(4)], inner="recompute")
    loss = model(x)
    model.eval()
    x.grad = None
    loss.backward()
    assert_all_equal(param_grads(ref), param_grads(model))


@pytest.mark.parametrize("inner", INNERS)
def test_autocast_bfloat16_replayed_in_recompute(inner):
    def step(model):
        torch.manual_seed(0)
        x = torch.randn(2, 8, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()  # outside autocast: the recompute must enter it again
        return [loss.detach(), *param_grads(model, x)]

    ref = step(GPT())
    got = step(spanned(GPT(), [[0, 1, 2], [3, 4, 5]], inner))
    assert_all_equal(ref, got)


def test_rng_consumed_between_blocks_is_replayed_per_block():
    class Noisy(GPT):
        def forward(self, x):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x, mask=mask)
                torch.rand(3)  # the model draws between blocks (a stochastic-depth coin)
            return self.ln(x).square().mean()

    ref, rng = gpt_step(Noisy())
    got, rng2 = gpt_step(spanned(Noisy(), [[0, 1, 2, 3, 4, 5]], "keep"))
    assert_all_equal(ref, got)
    assert torch.equal(rng, rng2)


@pytest.mark.parametrize("inner", ["keep", "recompute", "selective"])
def test_retain_graph_second_backward_and_autograd_grad(inner):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    ref_model = GPT()
    torch.manual_seed(1)
    ref_loss = ref_model(x)
    ref = torch.autograd.grad(ref_loss, [x, *ref_model.parameters()])
    model = spanned(GPT(), [[0, 1, 2], [3, 4, 5]], inner)
    torch.manual_seed(1)
    loss = model(x)
    first = torch.autograd.grad(loss, [x, *model.parameters()], retain_graph=True)
    assert_all_equal(list(ref), list(first))
    if inner == "selective":  # what the policy saved served the first (torch alike)
        with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
            torch.autograd.grad(loss, [x, *model.parameters()])
        return
    second = torch.autograd.grad(loss, [x, *model.parameters()])
    assert_all_equal(list(ref), list(second))


def test_grad_of_an_input_only_and_backward_inputs():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    ref_model = GPT()
    torch.manual_seed(1)
    (ref,) = torch.autograd.grad(ref_model(x), x)
    model = spanned(GPT(), [[0, 1, 2, 3]])
    torch.manual_seed(1)
    (got,) = torch.autograd.grad(model(x), x)
    assert torch.equal(ref, got)
    torch.manual_seed(1)
    model(x).backward(inputs=[model.layers[1].mlp.fc.weight])
    assert model.layers[1].mlp.fc.weight.grad is not None
    assert model.layers[0].mlp.fc.weight.grad is None


def test_span_of_one_block_equals_checkpoint_wrapper():
    def step(model):
        torch.manual_seed(0)
        x = torch.randn(2, 8, 16, requires_grad=True)
        with remat.memory.track() as t:
            loss = model(x)
            after = t.current_bytes
            loss.backward()
        return [loss.detach(), *param_grads(model, x)], after, t.peak_bytes

    wrapped = GPT()
    for layer in wrapped.layers:
        remat.checkpoint_wrapper(layer)
    single = spanned(GPT(), [[i] for i in range(6)], "keep")
    a, b = step(wrapped), step(single)
    assert_all_equal(a[0], b[0])
    assert a[1:] == b[1:]


def test_spans_combined_with_per_block_decisions_outside_them():
    model = GPT(n=7)
    spanned(model, [[0, 1, 2]])
    remat.checkpoint_wrapper(model.layers[3])
    remat.checkpoint_wrapper(model.layers[4], policy=remat.policies.save_matmuls())
    split_block(model, "layers.5")  # layer 6 stays plain
    ref, rng = gpt_step(GPT(n=7))
    got, rng2 = gpt_step(model)
    assert_all_equal(ref, got)
    assert torch.equal(rng, rng2)


def test_tuple_outputs_and_two_carried_tensors():
    class Pair(nn.Module):
        """A block that takes and returns (hidden, residual), as Mamba-style blocks do."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.drop = nn.Dropout(0.3)

        def forward(self, h, residual, scale=1.0):
            residual = h + residual
            return self.drop(torch.tanh(self.fc(residual))) * scale, residual

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(Pair() for _ in range(4))

        def forward(self, x):
            h, r = x, torch.zeros_like(x)
            for layer in self.layers:
                h, r = layer(h, r, scale=0.5)
            return (h + r).square().sum()

    def step(model):
        torch.manual_seed(0)
        x = torch.randn(8, 16, requires_grad=True)
        model(x).backward()
        return param_grads(model, x)

    model = Net()
    apply_span(model, [f"layers.{i}" for i in range(4)], inner="recompute")
    assert_all_equal(step(Net()), step(model))


def test_is_recomputing_guards_side_effects_in_the_span_recompute():
    seen: list[bool] = []

    class Logging(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            seen.append(remat.is_recomputing())
            return torch.tanh(self.fc(x))

    model = nn.Sequential(*[Logging() for _ in range(3)])
    apply_span(model, ["0", "1", "2"], inner="keep")
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert seen[:3] == [False, False, False]
    assert seen[3:] and all(seen[3:])


def test_no_grad_and_disable_checkpointing_run_the_plain_blocks():
    model = spanned(GPT(), [[0, 1, 2, 3, 4, 5]])
    plain = GPT()
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        torch.manual_seed(1)
        a = model(x)
        torch.manual_seed(1)
        b = plain(x)
    assert torch.equal(a, b)
    with remat.disable_checkpointing():
        ref, _ = gpt_step(GPT())
        got, _ = gpt_step(model)
    assert_all_equal(ref, got)
    # a single block called on its own is fine where nothing is checkpointed
    with torch.no_grad():
        model.layers[3](torch.randn(2, 8, 16))


def test_early_stop_off_gives_the_same_gradients():
    ref, _ = gpt_step(GPT())
    with remat.set_checkpoint_early_stop(False):
        got, _ = gpt_step(spanned(GPT(), [[0, 1, 2, 3, 4, 5]], "recompute"))
    assert_all_equal(ref, got)


def test_an_exception_inside_the_span_leaves_no_hooks_and_the_next_step_works():
    class Flaky(GPT):
        fail = True

        def forward(self, x):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            x = self.inp(x)
            for i, layer in enumerate(self.layers):
                if i == 3 and self.fail:
                    raise KeyError("boom between blocks")
                x = layer(x, mask=mask)
            return self.ln(x).square().mean()

    model = spanned(Flaky(), [[0, 1, 2, 3, 4, 5]])
    hooks_before = torch._C._autograd._top_saved_tensors_default_hooks(False)
    with pytest.raises(KeyError, match="boom"):
        gpt_step(model)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks_before
    assert not remat.is_checkpointing()
    model.fail = False
    ref_model = Flaky()
    ref_model.fail = False
    ref, _ = gpt_step(ref_model)
    got, _ = gpt_step(model)
    assert_all_equal(ref, got)


def test_an_exception_inside_a_block_restores_state():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("inside the block")

    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4))
    apply_span(model, ["0", "1", "2"])
    with pytest.raises(ValueError, match="inside the block"):
        model(torch.randn(2, 4, requires_grad=True))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not remat.is_checkpointing()


# -- applying, removing, identity ----------------------------------------------------------


def test_span_keeps_names_state_dict_and_class_and_remove_restores():
    model = GPT()
    before = (
        [n for n, _ in model.named_parameters()],
        list(model.state_dict()),
        [type(m) for m in model.modules()],
    )
    spanned(model, [[0, 1, 2], [3, 4, 5]], "split")
    after = (
        [n for n, _ in model.named_parameters()],
        list(model.state_dict()),
        [type(m) for m in model.modules()],
    )
    assert before == after
    assert spans_in(model) == [
        ("layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5"),
    ]
    assert span_of(model.layers[4]) == ("layers.3", "layers.4", "layers.5")
    assert "[remat: span 2/3 of layers.0, layers.1, layers.2, inner=split]" in repr(model)
    assert remat.modules.wrap.is_wrapped(model.layers[0].attn)
    assert remove_span(model, "layers.1") == ["layers.0", "layers.1", "layers.2"]
    assert not remat.modules.wrap.is_wrapped(model.layers[0].attn)  # the span's split is undone
    assert "forward" not in model.layers[0].__dict__ and "[remat" not in repr(model.layers[0])
    assert spans_in(model) == [("layers.3", "layers.4", "layers.5")]


def test_a_span_over_blocks_with_an_instance_forward_keeps_it():
    model = MLPChain(n=3)
    calls = []
    plain = model.layers[1].forward

    def logged(x):
        calls.append(1)
        return plain(x)

    model.layers[1].forward = logged
    apply_span(model, ["layers.0", "layers.1", "layers.2"], inner="keep")
    model(torch.randn(2, 16, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward and the span's recompute
    remove_span(model, "layers.0")
    assert model.layers[1].forward is logged


def test_span_adds_no_reference_cycle():
    gc.collect()
    gc.disable()
    try:
        model = spanned(GPT(), [[0, 1, 2]])
        gpt_step(model)
        ref = weakref.ref(model)
        del model
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_deepcopy_and_pickle_of_a_spanned_model_point_at_the_copy():
    model = spanned(GPT(), [[0, 1, 2], [3, 4, 5]])
    dup = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ref, _ = gpt_step(GPT())
    for m in (dup, loaded):
        assert m.layers[1].forward.ref() is m.layers[1]
        assert m.layers[1].forward.span is m.layers[2].forward.span
        assert m.layers[1].forward.span is not model.layers[1].forward.span
        got, _ = gpt_step(m)
        assert_all_equal(ref, got)
    assert pickle.loads(pickle.dumps(model.layers[0].forward.span)).opts.names == (
        "layers.0",
        "layers.1",
        "layers.2",
    )


def test_module_hooks_of_span_blocks_run_once_per_call_not_in_recompute():
    model = MLPChain(n=3)
    calls = {"pre": 0, "post": 0}
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: calls.__setitem__("pre", calls["pre"] + 1))
        layer.register_forward_hook(lambda m, a, o: calls.__setitem__("post", calls["post"] + 1))
    apply_span(model, ["layers.0", "layers.1", "layers.2"], inner="recompute")
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert calls == {"pre": 3, "post": 3}


@pytest.mark.parametrize(
    "middle",
    [
        nn.Identity,  # returns its input: the next block gets the tensor two blocks made
        functools.partial(nn.Unflatten, 1, (4, 4)),  # returns a view of its input
    ],
)
def test_blocks_returning_their_input_or_a_view_of_it_are_a_chain(middle):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(
                [nn.Linear(16, 16), nn.Tanh(), middle(), nn.Flatten(1), nn.Linear(16, 16)]
            )

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.square().sum()

    def step(model):
        torch.manual_seed(0)
        x = torch.randn(4, 16, requires_grad=True)
        model(x).backward()
        return param_grads(model, x)

    model = Net()
    apply_span(model, [f"layers.{i}" for i in range(5)], inner="recompute")
    assert_all_equal(step(Net()), step(model))


def test_double_backward_through_a_span():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])

    def grad_penalty(model):
        x = torch.randn(4, 6, requires_grad=True, generator=torch.Generator().manual_seed(1))
        (g,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        g.square().sum().backward()
        return param_grads(model)

    model = make()
    apply_span(model, ["0", "1", "2"], inner="recompute")
    assert_all_equal(grad_penalty(make()), grad_penalty(model))
