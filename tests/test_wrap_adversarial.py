"""checkpoint_wrapper against the plain module in corner cases: each pins a fixed bug."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat

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


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(F.gelu(self.bn(self.fc(x))))


def model_and_copy():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), Block(), nn.Linear(8, 8))
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
