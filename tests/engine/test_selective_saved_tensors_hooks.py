"""``respect_saved_tensors_hooks``: what a selective policy saves and the user's saved-tensor hooks.

torch 2.14's option, on remat for every supported torch: ``None`` (default) keeps what
the policy saves out of the hooks around the region and warns (``FutureWarning``) when
there are such hooks; ``True`` routes it through them; ``False`` keeps it out silently.
Where the installed torch has the option (2.14) every case runs on torch's checkpoint
with the same inputs too: the same gradients, hook calls, warnings and phrases.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from remat import CheckpointPolicy as P
from remat.engine import torch_compat
from remat.engine.torch_compat import (
    SAC_HOOKS_OPTION_SINCE,
    SAC_MODE_TAKES_HOOKS_OPTION,
    installed_torch,
)

needs_torch_option = pytest.mark.skipif(
    not SAC_MODE_TAKES_HOOKS_OPTION,
    reason=f"torch.utils.checkpoint's respect_saved_tensors_hooks is torch >= "
    f"{SAC_HOOKS_OPTION_SINCE}'s (installed: {installed_torch()}); remat's is tested on its own",
)
BYPASS = "Tensors that SAC saves currently bypass these hooks"
# (checkpoint, its selective contexts): remat's always, torch's where torch has the option
SIDES = [
    pytest.param((remat.checkpoint, remat.create_selective_checkpoint_contexts), id="remat"),
    pytest.param(
        (
            functools.partial(tuc.checkpoint, use_reentrant=False),
            tuc.create_selective_checkpoint_contexts,
        ),
        id="torch",
        marks=needs_torch_option,
    ),
]


def save_sin(ctx, op, *args, **kwargs):
    return P.MUST_SAVE if op == torch.ops.aten.sin.default else P.PREFER_RECOMPUTE


def fn(x):
    return x.sin().cos().exp()


class Counting(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that count and keep a clone (as ``save_on_cpu`` keeps a copy)."""

    def __init__(self):
        self.packed: list[tuple[int, ...]] = []
        self.unpacked = 0

        def pack(t):
            self.packed.append(tuple(t.shape))
            return t.clone()

        def unpack(t):
            self.unpacked += 1
            return t

        super().__init__(pack, unpack)


def run(side, respect, hooks, *, contexts=None):
    """Forward under ``hooks`` (or none), backward: (x.grad, packs, unpacks, warnings)."""
    ck, create = side
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    options = {} if respect == "omit" else {"respect_saved_tensors_hooks": respect}
    ctx = functools.partial(contexts or create, save_sin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if hooks is None:
            out = ck(fn, x, context_fn=ctx, **options)
        else:
            with hooks:
                out = ck(fn, x, context_fn=ctx, **options)
        out.sum().backward()
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    packs = None if hooks is None else (len(hooks.packed), hooks.unpacked)
    return x.grad, packs, future


def plain_grad():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    fn(x).sum().backward()
    return x.grad


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("respect", ["omit", None, True, False])
def test_without_outer_hooks_the_option_changes_nothing(side, respect):
    grad, _, future = run(side, respect, None)
    assert torch.equal(grad, plain_grad())
    assert future == []


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("respect", ["omit", None])
def test_by_default_saved_outputs_bypass_outer_hooks_with_a_future_warning(side, respect):
    hooks = Counting()
    grad, (packs, unpacks), future = run(side, respect, hooks)
    assert torch.equal(grad, plain_grad())
    assert future and all(BYPASS in text for text in future)
    assert (packs, unpacks) == (1, 1)  # the region's input only


@pytest.mark.parametrize("side", SIDES)
def test_true_routes_saved_outputs_through_outer_hooks(side):
    hooks = Counting()
    grad, (packs, unpacks), future = run(side, True, hooks)
    assert torch.equal(grad, plain_grad())
    assert future == []
    assert (packs, unpacks) == (2, 2)  # the region's input and sin's saved output


@pytest.mark.parametrize("side", SIDES)
def test_false_bypasses_outer_hooks_silently(side):
    hooks = Counting()
    grad, (packs, unpacks), future = run(side, False, hooks)
    assert torch.equal(grad, plain_grad())
    assert future == []
    assert (packs, unpacks) == (1, 1)


@needs_torch_option
@pytest.mark.parametrize("respect", ["omit", None, True, False])
@pytest.mark.parametrize("with_hooks", [False, True])
def test_remat_and_torch_agree_on_grads_hook_calls_and_warnings(respect, with_hooks):
    results = []
    for side in (
        (remat.checkpoint, remat.create_selective_checkpoint_contexts),
        (
            functools.partial(tuc.checkpoint, use_reentrant=False),
            tuc.create_selective_checkpoint_contexts,
        ),
    ):
        grad, packs, future = run(side, respect, Counting() if with_hooks else None)
        results.append((grad, packs, bool(future)))
    (g1, p1, w1), (g2, p2, w2) = results
    assert torch.equal(g1, g2) and p1 == p2 and w1 == w2


def test_true_under_save_on_cpu_gives_the_plain_grads():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, save_sin)
    with torch.autograd.graph.save_on_cpu():
        out = remat.checkpoint(fn, x, context_fn=ctx, respect_saved_tensors_hooks=True)
    out.sum().backward()
    assert torch.equal(x.grad, plain_grad())


def test_true_under_remat_offload_moves_saved_outputs_too():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, save_sin)
    counts = []
    for respect in (False, True):
        with remat.offload(min_bytes=0) as stats:
            out = remat.checkpoint(fn, x, context_fn=ctx, respect_saved_tensors_hooks=respect)
        out.sum().backward()
        counts.append(stats.offloaded_tensors)
    assert counts[1] == counts[0] + 1  # sin's saved output, beside the region's input


@pytest.mark.parametrize("side", SIDES)
def test_a_saved_output_changed_after_the_region_raises_through_hooks_that_keep_it(side):
    # hooks that keep the tensor itself: its version counter still tells (torch alike)
    ck, create = side
    x = torch.randn(3, 4, requires_grad=True)
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    ctx = functools.partial(create, save_sin)
    with keep:
        holder = {}

        def region(t):
            s = t.sin()
            holder["s"] = s
            return s.cos()

        out = ck(region, x, context_fn=ctx, respect_saved_tensors_hooks=True)
    with torch.no_grad():
        holder["s"].mul_(2)
    with pytest.raises(RuntimeError, match="has been mutated"):
        out.sum().backward()


def test_the_option_is_refused_for_the_reentrant_variant_in_torchs_words():
    x = torch.randn(3, requires_grad=True)
    phrase = "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported"
    with pytest.raises(ValueError, match=phrase):
        remat.checkpoint(fn, x, use_reentrant=True, respect_saved_tensors_hooks=False)
    if SAC_MODE_TAKES_HOOKS_OPTION:
        with pytest.raises(ValueError, match=phrase):
            tuc.checkpoint(fn, x, use_reentrant=True, respect_saved_tensors_hooks=False)


def test_a_value_that_is_not_a_bool_names_the_argument():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be True, False or None"):
        remat.checkpoint(fn, x, respect_saved_tensors_hooks=1)


@pytest.mark.parametrize("respect", [None, True])
def test_inside_an_enclosing_remat_region_saved_outputs_go_to_it_without_warning(respect):
    # the enclosing region drops them in forward and brings them back: nothing bypasses
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, save_sin)
    hooks = Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hooks:
            out = remat.checkpoint(
                lambda t: remat.checkpoint(
                    fn, t * 1.0, context_fn=ctx, respect_saved_tensors_hooks=respect
                ),
                x,
            )
        out.sum().backward()
    assert torch.equal(x.grad, plain_grad())
    assert len(hooks.packed) == 1  # the outer region's input only


@needs_torch_option
def test_torchs_contexts_under_remats_checkpoint_see_past_remats_hooks():
    # remat's region hooks are marked as checkpoint's own: torch 2.14's selective mode
    # warns only for the user's hooks, and routes through those
    side = (remat.checkpoint, remat.create_selective_checkpoint_contexts)
    _, _, future = run(side, "omit", None, contexts=tuc.create_selective_checkpoint_contexts)
    assert future == []
    grad, (packs, unpacks), future = run(
        side, True, Counting(), contexts=tuc.create_selective_checkpoint_contexts
    )
    assert torch.equal(grad, plain_grad()) and future == [] and (packs, unpacks) == (2, 2)


def test_true_with_torchs_contexts_on_a_torch_without_the_option_names_the_version(monkeypatch):
    # torch's selective mode before 2.14 cannot route through hooks: a clear error
    def old_torch_contexts(policy):
        fwd, rec = tuc.create_selective_checkpoint_contexts(policy)
        if hasattr(fwd, "respect_saved_tensors_hooks"):  # as torch < 2.14's mode
            del fwd.respect_saved_tensors_hooks
        return fwd, rec

    x = torch.randn(3, requires_grad=True)
    ctx = functools.partial(old_torch_contexts, save_sin)
    with pytest.raises(ValueError, match=r"needs torch >= 2\.14 \(installed: "):
        remat.checkpoint(fn, x, context_fn=ctx, respect_saved_tensors_hooks=True)
    remat.checkpoint(fn, x, context_fn=ctx, respect_saved_tensors_hooks=False).sum().backward()


def test_user_saved_tensors_hooks_looks_past_checkpoints_own_hooks():
    assert torch_compat.user_saved_tensors_hooks() is None
    seen = []

    def probe(t):
        seen.append(torch_compat.user_saved_tensors_hooks())
        return t.sin().cos()

    x = torch.randn(3, requires_grad=True)
    remat.checkpoint(probe, x)  # remat's region hooks only
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with hooks:
        remat.checkpoint(probe, x)
        tuc.checkpoint(probe, x, use_reentrant=False)
    assert seen[0] is None
    assert seen[1] is not None and seen[1][0] is hooks.pack_hook
    # torch 2.14 marks its checkpoint's hooks (the user's seen past them); older torch does
    # not, and nothing under them is visible
    if SAC_MODE_TAKES_HOOKS_OPTION:
        assert seen[2][0] is hooks.pack_hook
    else:
        assert seen[2] is None


def test_checkpoint_wrapper_with_a_policy_and_offload_to_cpu_does_not_warn():
    # the wrapper's own offload hooks move the region's inputs; the policy's saves stay
    # out of them unless asked (respect_saved_tensors_hooks=True through the wrapper)
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    remat.checkpoint_wrapper(lin, policy=remat.policies.save_matmuls(), offload_to_cpu=True)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin(x).sum().backward()
    other = torch.nn.Linear(8, 8)
    remat.checkpoint_wrapper(
        other,
        policy=remat.policies.save_matmuls(),
        offload_to_cpu=True,
        respect_saved_tensors_hooks=True,
    )
    other(x).sum().backward()


def test_checkpoint_sequential_passes_the_option_on():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    ctx = functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.save_matmuls()
    )
    x = torch.randn(2, 4, requires_grad=True)
    packed, grads = [], []
    for respect in (False, True):
        hooks = Counting()
        with hooks:
            out = remat.checkpoint_sequential(
                model, 2, x, context_fn=ctx, respect_saved_tensors_hooks=respect
            )
        out.sum().backward()
        packed.append(len(hooks.packed))
        grads.append(x.grad)
        x.grad = None
    assert packed[1] > packed[0]  # the saved matmuls went through the hooks too
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    "options, error, phrase",
    [
        # not a bool: named with its value
        (
            {"respect_saved_tensors_hooks": "yes"},
            TypeError,
            "must be True, False or None, got 'yes'",
        ),
        # the reentrant variant saves nothing selectively: torch 2.14's words
        (
            {"respect_saved_tensors_hooks": True, "use_reentrant": True},
            ValueError,
            "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported",
        ),
    ],
)
def test_checkpoint_wrapper_checks_the_option(options, error, phrase):
    with pytest.raises(error, match=phrase):
        remat.checkpoint_wrapper(torch.nn.Linear(2, 2), **options)
