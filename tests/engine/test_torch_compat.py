"""remat.engine.torch_compat: each torch behaviour remat handles, on a torch that takes it.

The installed torch takes one side of each; the other side runs by patching the name
(tests/engine/test_nonreentrant_older_torch.py for ``make_saved_tensor``). Also here: what
torch 2.14's ``torch.autograd.graph.node_creation_hook`` sees of a recompute, remat's
against torch's.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
from remat import CheckpointPolicy as P
from remat.engine import nonreentrant, torch_compat

NODE_HOOK = getattr(torch.autograd.graph, "node_creation_hook", None)
needs_node_hook = pytest.mark.skipif(
    NODE_HOOK is None,
    reason="torch.autograd.graph.node_creation_hook is torch >= 2.14's (installed: "
    f"{torch_compat.installed_torch()})",
)


def test_installed_torch_is_the_version_without_its_build_tag():
    assert torch.__version__.startswith(torch_compat.installed_torch())
    assert "+" not in torch_compat.installed_torch()


def test_make_saved_tensor_is_torchs_where_torch_has_it():
    has = hasattr(torch._C._autograd, "_make_saved_tensor")
    assert (torch_compat.make_saved_tensor is not None) == has
    kept = nonreentrant._keep_input(torch.randn(2, requires_grad=True), "test")
    assert isinstance(kept, nonreentrant._KeptByHand) == (not has)


def test_sac_hooks_option_is_detected_from_torchs_checkpoint():
    takes = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters
    assert torch_compat.SAC_MODE_TAKES_HOOKS_OPTION == takes
    fwd, _ = tuc.create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
    assert hasattr(fwd, "respect_saved_tensors_hooks") == takes


def test_remats_region_hooks_are_marked_as_checkpoints_own():
    marks = []

    def probe(t):
        pack, _ = torch._C._autograd._top_saved_tensors_default_hooks(False)
        marks.append(getattr(pack, "_checkpoint_internal", False))
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    remat.checkpoint(probe, x).sum().backward()  # forward, then the recompute's hook
    assert marks == [True, True]


def save_sin(ctx, op, *args, **kwargs):
    return P.MUST_SAVE if op == torch.ops.aten.sin.default else P.PREFER_RECOMPUTE


def nested(ck):
    def inner(t):
        return t.sin().cos()

    def outer(t):
        return ck(inner, t.exp()).tanh()

    return outer


# name -> (function, options): torch's and remat's checkpoint with the same options
CASES = {
    # the default: non-reentrant, early stop
    "plain": (lambda t: t.sin().cos().exp(), {"use_reentrant": False}),
    # the whole function recomputed
    "no_early_stop": (lambda t: t.sin().cos().exp(), {"use_reentrant": False, "early_stop": False}),
    # sin served from the cache, the rest recomputed
    "selective": (lambda t: t.sin().cos().exp(), {"use_reentrant": False, "selective": True}),
    # the autograd.Function variant: its recompute runs a nested backward
    "reentrant": (lambda t: t.sin().cos().exp(), {"use_reentrant": True}),
}


REENTRANT_NODES = {"_ReentrantCheckpointBackward": "CheckpointFunctionBackward"}


def node_names(ck, create, case):
    fn, options = CASES[case]
    options = dict(options)
    if options.pop("selective", False):
        options["context_fn"] = functools.partial(create, save_sin)
    names: list[str] = []
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    assert NODE_HOOK is not None
    with NODE_HOOK(lambda node: names.append(node.name())):
        out = ck(fn, x, **options)
        names.append("| backward")
        out.sum().backward()
    return names


@needs_node_hook
@pytest.mark.parametrize("case", list(CASES))
def test_node_creation_hook_sees_remats_recompute_as_torchs(case):
    ours = node_names(remat.checkpoint, remat.create_selective_checkpoint_contexts, case)
    theirs = node_names(tuc.checkpoint, tuc.create_selective_checkpoint_contexts, case)
    # the reentrant region's own node is remat's autograd.Function, under its own name
    ours = [REENTRANT_NODES.get(n, n) for n in ours]
    assert ours == theirs
    # the recompute made nodes in backward, and the hook saw them
    assert any(n.startswith("Sin") for n in ours[ours.index("| backward") :])


@needs_node_hook
def test_node_creation_hook_sees_a_nested_recompute_as_torchs():
    results = []
    for ck in (
        functools.partial(remat.checkpoint, use_reentrant=False),
        functools.partial(tuc.checkpoint, use_reentrant=False),
    ):
        names: list[str] = []
        x = torch.randn(3, generator=torch.Generator().manual_seed(0)).requires_grad_()
        assert NODE_HOOK is not None
        with NODE_HOOK(lambda node, names=names: names.append(node.name())):
            ck(nested(ck), x).sum().backward()
        results.append(names)
    assert results[0] == results[1]
