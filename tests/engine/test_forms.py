"""The call forms of torch's distributed wrapper and fairscale's (remat.engine.forms), against torch's wrapper.

Each form is run on a copy of one model and compared, bitwise, with torch's
``checkpoint_wrapper`` / ``apply_activation_checkpointing`` on another copy (and
with the unchecked model): only the import changes.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as tw
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import remat
from remat import CheckpointImpl


class ScaledBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x, *, scale=1.0):
        return x + scale * self.out(F.dropout(F.gelu(self.fc(x)), 0.2, training=self.training))


class Net(nn.Module):
    def __init__(self, n=3, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(ScaledBlock(d) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x, scale=0.5)
        return x


BASE = Net()


def step(model):
    """One training step from a fixed RNG state: the gradients in parameter order."""
    model.zero_grad()
    torch.manual_seed(3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def torch_wrapped(**kwargs):
    model = copy.deepcopy(BASE)
    for i, b in enumerate(model.blocks):
        model.blocks[i] = tw.checkpoint_wrapper(b, **kwargs)
    return model


def remat_wrapped(*args, **kwargs):
    model = copy.deepcopy(BASE)
    for b in model.blocks:
        assert remat.checkpoint_wrapper(b, *args, **kwargs) is b
    return model


PLAIN = step(copy.deepcopy(BASE))


def counting_checkpoint(calls):
    """A checkpoint function of the user's own (delegates to torch's)."""

    def ckpt(function, *args, **kwargs):
        calls.append(sorted(kwargs))
        return tuc.checkpoint(function, *args, **kwargs)

    return ckpt


@pytest.mark.parametrize(
    "remat_args, remat_kwargs, torch_kwargs",
    [
        # fairscale: the offload flag positionally (offload changes no gradient)
        ((True,), {}, {}),
        ((False,), {}, {}),
        # torch: checkpoint_impl positionally, remat's enum
        ((CheckpointImpl.REENTRANT,), {}, {"checkpoint_impl": tw.CheckpointImpl.REENTRANT}),
        # torch's own enum, positionally and by keyword
        ((tw.CheckpointImpl.REENTRANT,), {}, {"checkpoint_impl": tw.CheckpointImpl.REENTRANT}),
        (
            (),
            {"checkpoint_impl": tw.CheckpointImpl.NO_REENTRANT},
            {"checkpoint_impl": tw.CheckpointImpl.NO_REENTRANT},
        ),
        # torch's checkpoint as checkpoint_fn with its options (torchtitan's form)
        (
            (),
            {
                "checkpoint_impl": tw.CheckpointImpl.NO_REENTRANT,
                "checkpoint_fn": tuc.checkpoint,
                "use_reentrant": False,
                "preserve_rng_state": True,
            },
            {"checkpoint_fn": tuc.checkpoint, "use_reentrant": False, "preserve_rng_state": True},
        ),
        # ... as a functools.partial, positionally after checkpoint_impl
        (
            (
                CheckpointImpl.NO_REENTRANT,
                functools.partial(tuc.checkpoint, use_reentrant=False, early_stop=False),
            ),
            {},
            {
                "checkpoint_fn": functools.partial(
                    tuc.checkpoint, use_reentrant=False, early_stop=False
                )
            },
        ),
        # **checkpoint_fn_kwargs: options of checkpoint
        (
            (),
            {"determinism_check": "none", "early_stop": False, "debug": False},
            {"determinism_check": "none", "early_stop": False, "debug": False},
        ),
    ],
    ids=[
        "fairscale-offload-true",
        "fairscale-offload-false",
        "impl-positional-remat-enum",
        "impl-positional-torch-enum",
        "impl-keyword-torch-enum",
        "checkpoint-fn-torch-checkpoint",
        "checkpoint-fn-partial-positional",
        "checkpoint-fn-kwargs",
    ],
)
def test_call_form_gives_torchs_wrapper_gradients(remat_args, remat_kwargs, torch_kwargs):
    theirs = step(torch_wrapped(**torch_kwargs))
    model = remat_wrapped(*remat_args, **remat_kwargs)
    ours = step(model)
    same(theirs, ours)
    same(PLAIN, ours)  # and the unchecked model's
    assert list(model.state_dict()) == list(BASE.state_dict())  # names unchanged


def test_reentrant_partial_of_torchs_checkpoint_takes_forward_keywords():
    # torch's wrapper raises "Unexpected keyword arguments: scale" here (it packs keywords
    # only for CheckpointImpl.REENTRANT); remat always passes them positionally
    fn = functools.partial(tuc.checkpoint, use_reentrant=True)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        step(torch_wrapped(checkpoint_fn=fn))
    model = remat_wrapped(CheckpointImpl.NO_REENTRANT, fn)
    same(PLAIN, step(model))
    assert "reentrant" in repr(model.blocks[0])


def test_torch_checkpoint_as_checkpoint_fn_runs_remats_engine():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(remat.is_recomputing())
            return x.sin()

    m = remat.checkpoint_wrapper(Probe(), checkpoint_fn=tuc.checkpoint, use_reentrant=False)
    m(torch.randn(3, requires_grad=True)).sum().backward()
    assert seen == [False, True]  # remat's recompute: side-effect guards apply


def test_custom_checkpoint_fn_is_called_with_torchs_arguments():
    calls = []
    ckpt = counting_checkpoint(calls)
    theirs = step(torch_wrapped(checkpoint_fn=ckpt, use_reentrant=False, determinism_check="none"))
    # torch passes the forward's scale= by keyword, remat positionally
    assert calls == [["determinism_check", "scale", "use_reentrant"]] * 3
    calls.clear()
    model = remat_wrapped(checkpoint_fn=ckpt, use_reentrant=False, determinism_check="none")
    ours = step(model)
    same(theirs, ours)
    assert calls == [["determinism_check", "use_reentrant"]] * 3
    assert "checkpoint_fn=" in repr(model.blocks[0])


def test_custom_checkpoint_fn_gets_keywords_positionally_and_preserve_only_when_false():
    got = []

    def ckpt(function, *args, **kwargs):
        got.append((len(args), kwargs))
        return function(*args)

    m = remat.checkpoint_wrapper(ScaledBlock(), checkpoint_fn=ckpt, preserve_rng_state=False)
    m(torch.randn(2, 8, requires_grad=True), scale=2.0).sum().backward()
    assert got == [(2, {"preserve_rng_state": False})]


def test_reentrant_impl_takes_forward_keywords_as_torchs_wrapper_does():
    theirs = torch_wrapped(checkpoint_impl=tw.CheckpointImpl.REENTRANT)
    ours = remat_wrapped(checkpoint_impl=tw.CheckpointImpl.REENTRANT)
    same(step(theirs), step(ours))  # Net passes scale= by keyword to every block
    assert "reentrant" in repr(ours.blocks[0])


def test_older_torchs_positional_offload_after_impl_sets_offload_to_cpu():
    m = remat.checkpoint_wrapper(nn.Linear(2, 2), CheckpointImpl.REENTRANT, True)
    assert "offload_to_cpu" in repr(m) and "reentrant" in repr(m)
    m(torch.randn(1, 2, requires_grad=True)).sum().backward()


def test_fairscale_positional_offload_sets_offload_to_cpu():
    m = remat.checkpoint_wrapper(nn.Linear(2, 2), True)
    assert "offload_to_cpu" in repr(m)
    assert remat.checkpoint_wrapper(m, offload_to_cpu=True) is m  # the same options


# -- offload_wrapper ----------------------------------------------------------------------


def test_offload_wrapper_gives_the_plain_gradients_and_torchs_up_to_rounding():
    theirs = copy.deepcopy(BASE)
    for i, b in enumerate(theirs.blocks):
        theirs.blocks[i] = tw.offload_wrapper(b)
    ours = copy.deepcopy(BASE)
    for b in ours.blocks:
        assert remat.offload_wrapper(b) is b
    got = step(ours)
    same(PLAIN, got)  # bitwise: saved tensors keep their strides
    # torch's save_on_cpu copies saved tensors into contiguous buffers: the backward
    # matmuls then round differently (about 1e-8 here)
    for t, o in zip(step(theirs), got):
        assert torch.allclose(t, o, rtol=0, atol=1e-6)
    assert "offloaded" in repr(ours.blocks[0])
    remat.unwrap(ours.blocks[0])
    assert "remat" not in repr(ours.blocks[0])


def test_offload_wrapper_on_a_checkpointed_module_offloads_its_inputs():
    m = remat.offload_wrapper(remat.checkpoint_wrapper(nn.Linear(2, 2)))
    assert "checkpointed" in repr(m) and "offload_to_cpu" in repr(m)
    assert remat.offload_wrapper(m) is m


# -- apply_activation_checkpointing --------------------------------------------------------


def is_block(m):
    return isinstance(m, ScaledBlock)


@pytest.mark.parametrize(
    "wrapper_fn",
    [
        None,  # remat's checkpoint_wrapper
        remat.checkpoint_wrapper,
        functools.partial(remat.checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
        functools.partial(remat.checkpoint_wrapper, checkpoint_impl=tw.CheckpointImpl.NO_REENTRANT),
        remat.offload_wrapper,
    ],
    ids=["default", "checkpoint-wrapper", "partial-reentrant", "partial-torch-enum", "offload"],
)
def test_apply_with_torchs_one_argument_check_fn_matches_torch(wrapper_fn):
    theirs = copy.deepcopy(BASE)
    tw.apply_activation_checkpointing(theirs, check_fn=is_block)
    ours = copy.deepcopy(BASE)
    kwargs = {} if wrapper_fn is None else {"checkpoint_wrapper_fn": wrapper_fn}
    names = remat.apply_activation_checkpointing(ours, check_fn=is_block, **kwargs)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    same(step(theirs), step(ours))
    assert list(ours.state_dict()) == list(BASE.state_dict())


def test_apply_takes_torchs_arguments_positionally():
    ours = copy.deepcopy(BASE)
    names = remat.apply_activation_checkpointing(ours, remat.checkpoint_wrapper, is_block)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    same(PLAIN, step(ours))


def test_apply_with_torchs_own_wrapper_replaces_the_modules_as_torch_does():
    theirs = copy.deepcopy(BASE)
    tw.apply_activation_checkpointing(theirs, checkpoint_wrapper_fn=tw.checkpoint_wrapper)
    ours = copy.deepcopy(BASE)
    names = remat.apply_activation_checkpointing(
        ours, checkpoint_wrapper_fn=tw.checkpoint_wrapper, check_fn=is_block
    )
    assert all(isinstance(ours.get_submodule(n), tw.CheckpointWrapper) for n in names)
    same(PLAIN, step(ours))


def torch_targets(policy):
    """Names of the outermost modules torch's apply wraps for ``policy``."""
    model = copy.deepcopy(BASE)
    tw.apply_activation_checkpointing(model, auto_wrap_policy=policy)
    names = [n for n, m in model.named_modules() if isinstance(m, tw.CheckpointWrapper)]
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return [n.replace("._checkpoint_wrapped_module", "") for n in outer], model


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({ScaledBlock}),  # a policy object
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ScaledBlock}),
        functools.partial(lambda_auto_wrap_policy, lambda_fn=is_block),
        functools.partial(size_based_auto_wrap_policy, min_num_params=200),  # nested in torch
    ],
    ids=["module-wrap-policy", "transformer", "lambda", "size-based"],
)
def test_apply_with_auto_wrap_policy_wraps_what_torch_wraps(policy):
    want, theirs = torch_targets(policy)
    ours = copy.deepcopy(BASE)
    names = remat.apply_activation_checkpointing(ours, auto_wrap_policy=policy)
    assert names == want and names
    same(step(theirs), step(ours))


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, pieces",
    [
        (lambda m: remat.checkpoint_wrapper(m, 1), TypeError, ["offload_to_cpu (a bool)", "int 1"]),
        (
            lambda m: remat.checkpoint_wrapper(m, True, offload_to_cpu=True),
            TypeError,
            ["offload_to_cpu given positionally", "pass it once"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(
                m, CheckpointImpl.REENTRANT, checkpoint_impl=CheckpointImpl.REENTRANT
            ),
            TypeError,
            ["checkpoint_impl given positionally"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(m, True, tuc.checkpoint),
            TypeError,
            ["third positional argument", "checkpoint_fn=... by keyword"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(m, checkpoint_impl="REENTRANT"),
            TypeError,
            ["checkpoint_impl must be CheckpointImpl.REENTRANT", "'REENTRANT'"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(
                m, use_reentrant=True, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            ValueError,
            ["use_reentrant=True contradicts", "NO_REENTRANT"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(
                m, checkpoint_impl=CheckpointImpl.REENTRANT, debug=True
            ),
            ValueError,
            ["only supported when use_reentrant=False", "Drop debug=True"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(
                m, use_reentrant=True, policy=remat.policies.save_matmuls()
            ),
            ValueError,
            ["only supported when use_reentrant=False"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(m, scale=2.0),
            TypeError,
            ["unexpected keyword argument 'scale'", "determinism_check", "functools.partial"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(m, determinism_check="shape"),
            ValueError,
            ["determinism_check should be one of", "'shape'"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(
                m, checkpoint_fn=lambda f, *a: f(*a), policy=remat.policies.save_matmuls()
            ),
            ValueError,
            ["custom checkpoint_fn", "context_fn=functools.partial"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(m, checkpoint_fn="checkpoint"),
            TypeError,
            ["checkpoint_fn must be a checkpoint function", "got str"],
        ),
        (
            lambda m: remat.checkpoint_wrapper(
                m, context_fn=remat.create_selective_checkpoint_contexts([])
            ),
            TypeError,
            ["context_fn must be a function", "got tuple"],
        ),
        (
            lambda m: remat.apply_activation_checkpointing(
                m, check_fn=is_block, auto_wrap_policy=ModuleWrapPolicy({ScaledBlock})
            ),
            ValueError,
            ["check_fn or auto_wrap_policy, not both"],
        ),
        (
            lambda m: remat.apply_activation_checkpointing(
                m, checkpoint_wrapper_fn=remat.checkpoint_wrapper, use_reentrant=True
            ),
            ValueError,
            ["either in checkpoint_wrapper_fn", "use_reentrant"],
        ),
        (
            lambda m: remat.apply_activation_checkpointing(m, check_fn=lambda a, b, c: True),
            TypeError,
            ["(name, module)", "3 required positional arguments"],
        ),
        (
            lambda m: remat.apply_activation_checkpointing(m, auto_wrap_policy=42),
            TypeError,
            ["auto_wrap_policy must be a callable", "got int"],
        ),
    ],
    ids=[
        "positional-int",
        "offload-twice",
        "impl-twice",
        "fn-after-bool",
        "impl-string",
        "use-reentrant-contradicts-impl",
        "debug-with-reentrant-impl",
        "policy-with-reentrant",
        "unknown-keyword",
        "bad-determinism-check",
        "policy-with-custom-fn",
        "checkpoint-fn-not-callable",
        "contexts-instead-of-context-fn",
        "check-fn-and-auto-wrap-policy",
        "wrapper-fn-and-wrapper-kwargs",
        "check-fn-three-arguments",
        "auto-wrap-policy-not-callable",
    ],
)
def test_bad_call_forms_name_the_argument_value_and_fix(call, error, pieces):
    m = copy.deepcopy(BASE)
    with pytest.raises(error) as info:
        call(m)
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))
    assert not any(remat.modules.wrap.is_wrapped(x) for x in m.modules())  # nothing half-done
