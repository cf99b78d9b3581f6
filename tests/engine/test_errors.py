"""Errors (remat.engine.errors and every raise): torch's phrase where torch raises too, then remat's help; clear errors where torch's are not.

Each case runs the same input through torch.utils.checkpoint and remat: both must raise
the same exception type with torch's key phrase, and remat's message must also say what
to do. Code (and tests) written against torch's messages keep working.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from tests.support.tensors import data
from tests.support.torch_checkpoint import checkpoint as torch_checkpoint
from tests.support.torch_checkpoint import rejects_a_suppressing_forward_context

MM = torch.ops.aten.mm.default


class Flag:
    """Global state that a function reads: changed between forward and backward."""

    on = False


def fewer_saves(x):
    y = x.sin()
    return y if Flag.on else y.exp()  # recompute (Flag.on) saves one tensor less


def more_saves(x):
    y = x.sin()
    return y.exp().exp() if Flag.on else y  # recompute saves more


def other_shape(x):
    return (x[:, :2] if Flag.on else x).sin()


def forward_then_flip(ckpt, fn, **kwargs):
    Flag.on = False
    out = ckpt(fn, data(4, 3, seed=0), use_reentrant=False, **kwargs)
    Flag.on = True
    return out.sum()


class ReadsSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        (b,) = ctx.saved_tensors
        return g * 2


class Swallow:
    """A context manager that suppresses exceptions (a bug in a user's context_fn)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


def swallowing_context_fn():
    return Swallow(), contextlib.nullcontext()


def boom(x):
    raise ValueError("boom")


def mutates_saved(x, w):
    h = torch.mm(x, w)
    h.mul_(2)  # changes the saved mm output in place
    return h.sin()


def mm_only_in_recompute(x, w):
    return torch.mm(x, w).sin() if Flag.on else (x * w[0]).sin()


def two_outputs(x, w):
    h = torch.mm(x, w)
    return h.sin(), h.cos()


def sac(create):
    return functools.partial(create, [MM])


#: torch 2.13 (pytorch/pytorch#184018) raises where a context_fn suppresses the forward's error
TORCH_REJECTS_SUPPRESSING_CONTEXT = rejects_a_suppressing_forward_context()


# Each case: (run(ckpt, create) -> None, which raises; the type; torch's phrase; remat's help)
def case_fewer(ckpt, create):
    forward_then_flip(ckpt, fewer_saves, early_stop=False).backward()


def case_more(ckpt, create):
    forward_then_flip(ckpt, more_saves, early_stop=False).backward()


def case_metadata(ckpt, create):
    forward_then_flip(ckpt, other_shape).backward()


def case_reentrant_grad(ckpt, create):
    x = data(3, seed=0)
    torch.autograd.grad(ckpt(torch.sin, x, use_reentrant=True).sum(), x)


def case_reentrant_backward_inputs(ckpt, create):
    x = data(3, seed=0)
    ckpt(torch.sin, x, use_reentrant=True).sum().backward(inputs=[x])


def case_not_necessary(ckpt, create):
    ckpt(lambda t: t.detach() * 2, data(3, seed=0), use_reentrant=True).sum().backward()


def case_unpacked_twice(ckpt, create):
    ckpt(lambda t: ReadsSavedTwice.apply(t.sin()), data(3, seed=0), use_reentrant=False).sum().backward()


def case_debug_reentrant(ckpt, create):
    ckpt(torch.sin, data(3, seed=0), use_reentrant=True, debug=True)


def case_context_fn_reentrant(ckpt, create):
    ckpt(torch.sin, data(3, seed=0), use_reentrant=True, context_fn=sac(create))


def case_mutated(ckpt, create):
    out = ckpt(
        mutates_saved, data(4, 4, seed=0), data(4, 4, seed=1), use_reentrant=False, context_fn=sac(create)
    )
    out.sum().backward()


def case_not_in_storage(ckpt, create):
    Flag.on = False
    out = ckpt(
        mm_only_in_recompute,
        data(4, 4, seed=0),
        data(4, 4, seed=1),
        use_reentrant=False,
        context_fn=sac(create),
        determinism_check="none",
    )
    Flag.on = True
    out.sum().backward()


def case_backward_extra_time(ckpt, create):
    x, w = data(4, 4, seed=0), data(4, 4, seed=1)
    a, b = ckpt(two_outputs, x, w, use_reentrant=False, context_fn=sac(create))
    torch.autograd.grad(a.sum(), x)  # consumes the saved mm output
    torch.autograd.grad(b.sum(), x)  # needs it again


def case_swallowing_context(ckpt, create):
    ckpt(boom, data(3, seed=0), use_reentrant=False, context_fn=swallowing_context_fn)


def case_bad_determinism_check(ckpt, create):
    ckpt(torch.sin, data(3, seed=0), use_reentrant=False, determinism_check="shapes")


def case_detach_variable(ckpt, create):
    (remat.detach_variable if ckpt is remat.checkpoint else tuc.detach_variable)([data(3, seed=0)])


CASES = [
    # name, run, type, torch's phrase, a piece of remat's help
    (
        "fewer-saved",
        case_fewer,
        tuc.CheckpointError,
        "A different number of tensors was saved",
        "(forward: 2, recompute: 1)",
    ),
    (
        "more-saved",
        case_more,
        tuc.CheckpointError,
        "trying to save more tensors during recomputation than during the original forward pass",
        "debug=True",
    ),
    (
        "metadata",
        case_metadata,
        tuc.CheckpointError,
        "Recomputed values for the following tensors have different metadata",
        r"shape=(4, 3)",
    ),
    (
        "reentrant-grad",
        case_reentrant_grad,
        RuntimeError,
        "torch.utils.checkpoint is incompatible",
        "use_reentrant=False (the default)",
    ),
    (
        "reentrant-backward-inputs",
        case_reentrant_backward_inputs,
        RuntimeError,
        "torch.utils.checkpoint is incompatible",
        "without the inputs argument",
    ),
    (
        "not-necessary",
        case_not_necessary,
        RuntimeError,
        "none of output has requires_grad=True",
        "Remove the checkpoint",
    ),
    (
        "unpacked-twice",
        case_unpacked_twice,
        tuc.CheckpointError,
        "Unpack is being triggered for a tensor that was already unpacked once",
        "read it once and keep the result",
    ),
    (
        "debug-reentrant",
        case_debug_reentrant,
        ValueError,
        "only supported when use_reentrant=False",
        "Drop them",
    ),
    (
        "context-fn-reentrant",
        case_context_fn_reentrant,
        ValueError,
        "only supported when use_reentrant=False",
        "Drop them",
    ),
    (
        "cache-mutated",
        case_mutated,
        RuntimeError,
        "has been mutated",
        "gradients computed from them are wrong",
    ),
    (
        "not-in-storage",
        case_not_in_storage,
        RuntimeError,
        # torch 2.13: "{op} encountered during backward but not found in storage"; 2.11 has
        # a comma before "but"
        "but not found in storage",
        "time(s) in forward",
    ),
    (
        "backward-extra-time",
        case_backward_extra_time,
        RuntimeError,
        "Trying to backward an extra time",
        "retain_graph=True",
    ),
    (
        "context-swallows-exception",
        case_swallowing_context,
        RuntimeError,
        "the forward context provided by context_fn suppressed an exception raised during the "
        "checkpointed forward",
        "__exit__ return False",
    ),
    (
        "bad-determinism-check",
        case_bad_determinism_check,
        ValueError,
        "determinism_check should be one of",
        "'values'",
    ),
    (
        "detach-variable-list",
        case_detach_variable,
        RuntimeError,
        "Only tuple of tensors is supported",
        "Wrap the inputs in a tuple",
    ),
]


@pytest.mark.parametrize(
    "run, error, phrase, help_text", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_error_has_torchs_type_and_phrase_then_remats_help(run, error, phrase, help_text):
    try:
        if run is case_swallowing_context and not TORCH_REJECTS_SUPPRESSING_CONTEXT:
            # torch before 2.13 lets the forward's own exception through; remat raises as
            # torch 2.13 does, in its words, on every torch
            with pytest.raises(ValueError, match="boom"):
                run(torch_checkpoint, tuc.create_selective_checkpoint_contexts)
        else:
            with pytest.raises(error) as torch_info:
                run(torch_checkpoint, tuc.create_selective_checkpoint_contexts)
            assert phrase in str(torch_info.value)  # the phrase really is torch's
        with pytest.raises(error) as info:
            run(remat.checkpoint, remat.create_selective_checkpoint_contexts)
    finally:
        Flag.on = False
    message = str(info.value)
    assert phrase in message
    assert help_text in message
    assert message.index(phrase) < message.index(help_text)  # torch's words first, then help
    assert not remat.is_checkpointing() and not remat.is_recomputing()


# -- clear errors where torch's are unclear ------------------------------------------------


def policy_fn(ctx, op, *args, **kwargs):
    return remat.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize(
    "call, error, pieces",
    [
        # not a function: torch fails inside its engine with "'int' object is not callable"
        (lambda x: remat.checkpoint(5, x), TypeError, ["function must be callable", "int 5"]),
        # arguments swapped: the tensor is named, shortened, and the order explained
        (
            lambda x: remat.checkpoint(x, torch.sin),
            TypeError,
            ["got Tensor tensor(", "checkpoint(function, *args)"],
        ),
        # a policy where a context function belongs: names the fix
        (
            lambda x: remat.checkpoint(torch.sin, x, context_fn=policy_fn),
            TypeError,
            ["context_fn", "policy_fn", "takes arguments", "create_selective_checkpoint_contexts"],
        ),
        (
            lambda x: remat.checkpoint(torch.sin, x, context_fn=remat.policies.save_matmuls()),
            TypeError,
            ["context_fn", "OpPolicy", "functools.partial(remat.create_selective"],
        ),
        # the pair of contexts instead of the function that makes it
        (
            lambda x: remat.checkpoint(
                torch.sin, x, context_fn=remat.create_selective_checkpoint_contexts([MM])
            ),
            TypeError,
            ["context_fn must be a function", "got tuple", "(the function, not the pair"],
        ),
        # a context function returning something else than a pair
        (
            lambda x: remat.checkpoint(torch.sin, x, context_fn=lambda: None),
            TypeError,
            ["context_fn must return two context managers", "NoneType"],
        ),
        # torch accepts any truthy value silently
        (
            lambda x: remat.checkpoint(torch.sin, x, use_reentrant="yes"),
            TypeError,
            ["use_reentrant must be True, False or None", "'yes'"],
        ),
        # torch: AttributeError: 'int' object has no attribute 'named_modules'
        (
            lambda x: remat.apply_activation_checkpointing(5),
            TypeError,
            ["model must be an nn.Module", "got int", "checkpoint_wrapper wraps a single"],
        ),
    ],
    ids=[
        "function-not-callable",
        "arguments-swapped",
        "policy-as-context-fn",
        "op-policy-as-context-fn",
        "contexts-instead-of-context-fn",
        "context-fn-returns-none",
        "use-reentrant-not-bool",
        "apply-to-non-module",
    ],
)
def test_unclear_inputs_get_errors_naming_argument_value_and_fix(call, error, pieces):
    x = data(3, seed=0)
    with pytest.raises(error) as info:
        call(x)
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))
    assert not remat.is_checkpointing()


def test_errors_do_not_print_private_class_names():
    lin = remat.checkpoint_wrapper(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError) as info:
        remat.checkpoint_wrapper(lin, use_reentrant=True)
    message = str(info.value)
    assert "_Options" not in message and "remat._" not in message
    assert "default options" in message and "use_reentrant=True" in message


# -- differences from torch, documented in the README ---------------------------------------


def test_double_backward_over_a_selective_region_works_where_torch_refuses():
    # a backward that builds a graph keeps what the policy saved for the next one; a plain
    # second backward after retain_graph=True raises in both (tests/engine/test_selective.py).
    # torch 2.13 and 2.14 raise "Trying to backward an extra time" here; 2.11 fails otherwise
    def grads(ckpt, create):
        x, w = data(4, 4, seed=0), data(4, 4, seed=1)
        out = ckpt(two_outputs, x, w, use_reentrant=False, context_fn=sac(create))
        loss = out[0].sum() + out[1].sum()
        (gw,) = torch.autograd.grad(loss, w, create_graph=True)
        gw.square().sum().backward()
        return x.grad, w.grad

    plain = grads(lambda f, *a, **k: f(*a), remat.create_selective_checkpoint_contexts)
    with pytest.raises(RuntimeError):
        grads(torch_checkpoint, tuc.create_selective_checkpoint_contexts)
    ours = grads(remat.checkpoint, remat.create_selective_checkpoint_contexts)
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])


def test_allow_cache_entry_mutation_gives_torchs_wrong_gradients():
    def grads(ckpt, create):
        x, w = data(4, 4, seed=0), data(4, 4, seed=1)
        if ckpt is None:
            mutates_saved(x, w).sum().backward()
        else:
            ctx_fn = functools.partial(create, [MM], allow_cache_entry_mutation=True)
            ckpt(mutates_saved, x, w, use_reentrant=False, context_fn=ctx_fn).sum().backward()
        return x.grad, w.grad

    plain = grads(None, None)
    theirs = grads(torch_checkpoint, tuc.create_selective_checkpoint_contexts)
    ours = grads(remat.checkpoint, remat.create_selective_checkpoint_contexts)
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    assert not torch.allclose(plain[0], ours[0])  # served the doubled value, doubled again
