"""``checkpoint(**options)(function)``: torch 2.14's curried form, also as a method decorator.

Each behaviour is checked on remat (every supported torch) and, where the installed torch
has the curried form (2.14), on ``torch.utils.checkpoint.checkpoint`` with the same
inputs: the same gradients (bitwise), metadata, errors and phrases.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import remat
from remat.engine.torch_compat import SAC_HOOKS_OPTION_SINCE, installed_torch

TORCH_CURRIES = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters
needs_torch_curried = pytest.mark.skipif(
    not TORCH_CURRIES,
    reason=f"torch.utils.checkpoint's curried form is torch >= {SAC_HOOKS_OPTION_SINCE}'s "
    f"(installed: {installed_torch()}); remat's is tested on its own",
)
# remat's checkpoint always; torch's where it has the curried form
CHECKPOINTS = [
    pytest.param(remat.checkpoint, id="remat"),
    pytest.param(tuc.checkpoint, id="torch", marks=needs_torch_curried),
]


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g).requires_grad_()
    w = torch.randn(6, 6, generator=g).requires_grad_()
    return x, w


def block(x, w, *, scale=1.0):
    """A block with dropout (the RNG is replayed in recompute)."""
    return F.dropout(torch.tanh(x @ w), 0.3, training=True).exp() * scale


def grads(run, x, w):
    x.grad = w.grad = None
    torch.manual_seed(7)
    run(x, w).sum().backward()
    return [x.grad.clone(), w.grad.clone(), torch.get_rng_state()]


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("ck", CHECKPOINTS)
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("preserve", [True, False])
def test_curried_form_gives_the_grads_of_the_direct_call(ck, use_reentrant, preserve):
    x, w = data()
    direct = grads(
        lambda a, b: ck(block, a, b, use_reentrant=use_reentrant, preserve_rng_state=preserve),
        x,
        w,
    )
    curried = ck(use_reentrant=use_reentrant, preserve_rng_state=preserve)(block)
    assert_same(grads(curried, x, w), direct)
    if preserve:  # dropout replayed: the plain run's gradients, and remat's
        assert_same(direct, grads(block, x, w))


@needs_torch_curried
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_curried_form_gives_torchs_grads_bitwise(use_reentrant):
    x, w = data()
    ours = grads(remat.checkpoint(use_reentrant=use_reentrant)(block), x, w)
    theirs = grads(tuc.checkpoint(use_reentrant=use_reentrant)(block), x, w)
    assert_same(ours, theirs)


@pytest.mark.parametrize("ck", CHECKPOINTS)
def test_curried_form_passes_keyword_arguments_to_the_function(ck):
    x, w = data()
    run = ck(use_reentrant=False)(block)
    want = grads(lambda a, b: block(a, b, scale=3.0), x, w)
    assert_same(grads(lambda a, b: run(a, b, scale=3.0), x, w), want)


@pytest.mark.parametrize("ck", CHECKPOINTS)
def test_curried_form_keeps_the_functions_metadata(ck):
    wrapped = ck(use_reentrant=False)(block)
    assert wrapped.__name__ == "block"
    assert wrapped.__qualname__ == block.__qualname__
    assert wrapped.__doc__ == block.__doc__
    assert wrapped.__module__ == block.__module__
    assert wrapped.__wrapped__ is block
    assert inspect.signature(wrapped) == inspect.signature(block)


@needs_torch_curried
def test_curried_form_keeps_the_same_metadata_as_torchs():
    ours = remat.checkpoint(use_reentrant=False)(block)
    theirs = tuc.checkpoint(use_reentrant=False)(block)
    for name in ("__name__", "__qualname__", "__doc__", "__module__", "__wrapped__"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.function is theirs.function is block
    assert ours.checkpoint_kwargs["use_reentrant"] is theirs.checkpoint_kwargs["use_reentrant"]


def make_module(ck, use_reentrant):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.w = torch.nn.Parameter(torch.randn(6, 6, generator=g))

        @ck(use_reentrant=use_reentrant)
        def forward(self, x):
            """Block.forward's docstring."""
            return block(x, self.w)

    return Block()


@pytest.mark.parametrize("ck", CHECKPOINTS)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_method_decorator_checkpoints_a_modules_forward(ck, use_reentrant):
    module = make_module(ck, use_reentrant)
    x, _ = data()
    got = grads(lambda a, _w: module(a), x, module.w)
    want = grads(lambda a, b: block(a, b), x, module.w)
    assert_same(got, want)
    # the checkpoint did run: the forward's activations are not kept
    torch.manual_seed(7)
    out = module(x)
    assert out.grad_fn is not None
    assert type(module).forward.__name__ == "forward"
    assert type(module).forward.__doc__ == "Block.forward's docstring."


@pytest.mark.parametrize("ck", CHECKPOINTS)
def test_method_decorator_binds_to_the_instance_it_is_read_from(ck):
    class Scaled:
        def __init__(self, k):
            self.k = k

        @ck(use_reentrant=False)
        def run(self, x):
            return (x * self.k).sin()

    x = torch.randn(5, requires_grad=True)
    two, three = Scaled(2.0), Scaled(3.0)
    assert Scaled.__dict__["run"] is Scaled.run  # read from the class: the wrapper itself
    bound = three.run
    assert bound.__name__ == "run"
    bound(x).sum().backward()
    assert torch.equal(x.grad, (3.0 * torch.cos(x * 3.0)).detach())
    x.grad = None
    two.run(x).sum().backward()
    assert torch.equal(x.grad, (2.0 * torch.cos(x * 2.0)).detach())


@needs_torch_curried
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_method_decorator_gives_torchs_grads_bitwise(use_reentrant):
    x, _ = data()
    results = []
    for ck in (remat.checkpoint, tuc.checkpoint):
        module = make_module(ck, use_reentrant)
        results.append(grads(lambda a, _w, m=module: m(a), x, module.w))
    assert_same(*results)


@pytest.mark.parametrize("ck", CHECKPOINTS)
def test_curried_form_refuses_keyword_arguments_for_the_function(ck):
    # torch 2.14's words: "Unexpected keyword arguments: scale"
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        ck(use_reentrant=False, scale=2.0)


def test_curried_form_says_where_the_functions_keywords_go():
    with pytest.raises(ValueError, match="when calling the decorated function"):
        remat.checkpoint(use_reentrant=False, scale=2.0)


@pytest.mark.parametrize(
    "options, error, phrase",
    [
        # use_reentrant must be a bool or None: named with its value
        (
            {"use_reentrant": "yes"},
            TypeError,
            "use_reentrant must be True, False or None, got 'yes'",
        ),
        # an unknown determinism check: torch's words
        ({"determinism_check": "shapes"}, ValueError, "determinism_check should be one of"),
        # reentrant takes no context_fn or debug: torch 2.14's words
        (
            {"use_reentrant": True, "debug": True},
            ValueError,
            "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported",
        ),
        # a selective policy passed where the context function goes
        ({"context_fn": 3}, TypeError, "context_fn must be a function returning two context"),
        # the hooks option must be a bool or None
        (
            {"respect_saved_tensors_hooks": "yes"},
            TypeError,
            "respect_saved_tensors_hooks must be True, False or None, got 'yes'",
        ),
    ],
)
def test_curried_form_checks_its_options_when_made(options, error, phrase):
    with pytest.raises(error, match=phrase):
        remat.checkpoint(**options)


def test_decorating_something_not_callable_names_the_argument():
    with pytest.raises(TypeError, match="function must be callable, got int 5"):
        remat.checkpoint(use_reentrant=False)(5)


def test_no_function_with_arguments_names_the_argument():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="function must be callable, got NoneType None"):
        remat.checkpoint(None, x)


def test_curried_form_of_reentrant_refuses_keyword_arguments_at_the_call():
    run = remat.checkpoint(use_reentrant=True)(block)
    x, w = data()
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        run(x, w, scale=2.0)


def test_curried_form_under_no_grad_calls_the_function():
    calls = []

    @remat.checkpoint(use_reentrant=False)
    def fn(t):
        calls.append(remat.is_checkpointing())
        return t * 2

    with torch.no_grad():
        fn(torch.ones(2, requires_grad=True))
    assert calls == [False]


def test_curried_form_recomputes_once_per_backward():
    calls = []

    @remat.checkpoint(use_reentrant=False)
    def fn(t):
        calls.append(remat.is_recomputing())
        return t.sin().cos()

    fn(torch.randn(3, requires_grad=True)).sum().backward()
    assert calls == [False, True]


def test_curried_form_works_on_a_staticmethod_and_a_partial():
    class Holder:
        @remat.checkpoint(use_reentrant=False)
        @staticmethod
        def run(t):
            return t.exp()

    x = torch.randn(3, requires_grad=True)
    Holder().run(x).sum().backward()
    assert torch.equal(x.grad, x.detach().exp())
    x.grad = None
    scaled = remat.checkpoint(use_reentrant=False)(functools.partial(block, scale=2.0))
    w = torch.eye(3, requires_grad=True)
    torch.manual_seed(0)
    scaled(x, w).sum().backward()
    assert x.grad is not None
