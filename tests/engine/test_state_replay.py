"""Global state a recompute sees, differentially: plain code, remat, torch's checkpoint.

Each case runs the same program without checkpointing, with remat (non-reentrant,
reentrant, selective with ``save_matmuls``) and, where torch is right, with
``torch.utils.checkpoint``; outputs, gradients and the RNG state after backward
are compared bitwise. Complements ``test_state.py`` (dropout, the
forward's autocast, the default device) with the state that breaks less often:
explicit generators, the autocast cast cache, the default dtype, grad-mode
blocks, and every flag restored when the recompute raises.

Documented decisions (remat differs from torch here, on purpose):

* a ``torch.Generator`` passed as an argument is replayed like the global one
  (torch draws new numbers in recompute: silently wrong gradients, and the
  generator ends backward advanced twice);
* ``torch.set_default_dtype`` between forward and backward is replayed (torch
  raises a metadata ``CheckpointError`` or computes in the new dtype);
* ``torch.use_deterministic_algorithms`` is not replayed (kernel selection only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._device as device_mod
import torch.utils.checkpoint as tuc
from torch.overrides import _get_current_function_mode_stack

import remat
import remat.engine.state
from tests.support.differential import Outcome, assert_matches_reference
from tests.support.tensors import assert_all_equal

Call = Callable[..., Any]


def _selective() -> Any:
    return functools.partial(
        remat.create_selective_checkpoint_contexts, remat.policies.save_matmuls()
    )


def _torch_selective() -> Any:
    return functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])


def plain(f: Call, *a: Any) -> Any:
    return f(*a)


REMAT: dict[str, Call] = {
    "non-reentrant": lambda f, *a: remat.checkpoint(f, *a, use_reentrant=False),
    "reentrant": lambda f, *a: remat.checkpoint(f, *a, use_reentrant=True),
    "selective": lambda f, *a: remat.checkpoint(f, *a, context_fn=_selective()),
}
TORCH: dict[str, Call] = {
    "non-reentrant": lambda f, *a: tuc.checkpoint(f, *a, use_reentrant=False),
    "reentrant": lambda f, *a: tuc.checkpoint(f, *a, use_reentrant=True),
    "selective": lambda f, *a: tuc.checkpoint(
        f, *a, use_reentrant=False, context_fn=_torch_selective()
    ),
}
VARIANTS = list(REMAT)


def leaves() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).requires_grad_()
    w = (torch.randn(8, 8, generator=g) * 0.5).requires_grad_()
    return x, w


def outcome(
    program: Callable[[Call, torch.Tensor, torch.Tensor], torch.Tensor], call: Call
) -> Outcome:
    """Run ``program`` from seed 1; record output, gradients of x and w, and the RNG after."""
    x, w = leaves()
    torch.manual_seed(1)
    try:
        out = program(call, x, w)
    except Exception as e:  # noqa: BLE001  # compared by the caller
        return Outcome(error=e)
    return Outcome(out=out.detach().float(), grads=[x.grad, w.grad], rng=torch.get_rng_state())


# ------------------------------------------------------------- programs: random ops


def random_ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.dropout(x @ w, 0.5, training=True) + torch.rand_like(x) + torch.randn(4, 8)
    h = h * torch.bernoulli(torch.full_like(h, 0.7))
    cols = torch.multinomial(torch.ones(8), 8, replacement=True)
    return (h[:, cols] @ w[torch.randperm(8)]).tanh()


def seeds_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(42)  # the region reseeds: the global generator leaves it reseeded
    return random_ops(x, w)


def backward_then_draw(call: Call, f: Call) -> Callable[..., torch.Tensor]:
    def program(_call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = call(f, x, w)
        y.square().sum().backward()
        return y + torch.rand(1)  # what the global generator gives after backward

    return program


def nested_random(call: Call) -> Call:
    def outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return random_ops(call(random_ops, random_ops(x, w), w), w)

    return outer


def grad_mode_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        scale = (x @ w).abs().mean()  # a constant for autograd
    h = x @ w
    with torch.set_grad_enabled(False):
        frozen = h.exp()  # around part of the region
    with torch.enable_grad():
        h = (h * scale).tanh()
    return h @ w + frozen


RANDOM_PROGRAMS = {
    "dropout-rand-randn-bernoulli-multinomial-randperm": random_ops,
    "manual-seed-inside-the-region": seeds_inside,
    "grad-mode-blocks-inside-the-region": grad_mode_blocks,
}


@pytest.mark.parametrize("program", list(RANDOM_PROGRAMS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_random_ops_and_grad_mode_blocks_match_plain_and_torch(variant, program):
    f = RANDOM_PROGRAMS[program]
    ref = outcome(backward_then_draw(plain, f), plain)
    got = outcome(backward_then_draw(REMAT[variant], f), plain)
    tor = outcome(backward_then_draw(TORCH[variant], f), plain)
    assert_matches_reference(ref, got, f"{variant}/{program}")
    assert_matches_reference(tor, got, f"{variant}/{program} vs torch")


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_ops_in_nested_regions_match_plain(variant):
    call = REMAT[variant]
    ref = outcome(backward_then_draw(plain, nested_random(plain)), plain)
    got = outcome(backward_then_draw(call, nested_random(call)), plain)
    if variant != "reentrant":
        assert_matches_reference(ref, got, variant)
        return
    # Nested reentrant regions hand w's gradient contributions back separately: they
    # are summed in another order than without checkpointing (rounding only), as torch.
    tor = outcome(backward_then_draw(TORCH[variant], nested_random(TORCH[variant])), plain)
    assert_matches_reference(tor, got, "reentrant vs torch")
    assert torch.equal(ref.out, got.out) and torch.equal(ref.rng, got.rng)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(ref.grads, got.grads))


# ------------------------------------------------------------- explicit generators


def draws_from(x: torch.Tensor, w: torch.Tensor, gens: Any) -> torch.Tensor:
    g1, g2 = gens["a"], gens["b"][0]
    noise = torch.rand(4, 8, generator=g1) + torch.randn(8, generator=g2)
    return ((x @ w) * noise).tanh() @ w


@pytest.mark.parametrize("variant", VARIANTS)
def test_generator_arguments_are_replayed_and_end_backward_as_plain(variant):
    # torch replays only the global generators: its recompute draws new noise from
    # g1 and g2 (wrong gradients, no error) and leaves them advanced twice.
    def program(call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
        if variant == "reentrant":  # positional arguments only
            y = call(lambda x, w, g1, g2: draws_from(x, w, {"a": g1, "b": [g2]}), x, w, g1, g2)
        else:  # nested in a dict and a list
            y = call(draws_from, x, w, {"a": g1, "b": [g2]})
        y.square().sum().backward()
        return y + torch.rand(1, generator=g1) + torch.rand(1, generator=g2)

    ref = outcome(program, plain)
    got = outcome(program, REMAT[variant])
    assert_matches_reference(ref, got, variant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_generator_argument_not_replayed_without_preserve_rng_state(use_reentrant):
    gen = torch.Generator().manual_seed(3)
    x, _ = leaves()
    seen = []

    def f(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        noise = torch.rand(3, generator=g)
        seen.append(noise)
        return t.sin() * noise.sum()

    out = remat.checkpoint(f, x, gen, use_reentrant=use_reentrant, preserve_rng_state=False)
    out.sum().backward()
    assert not torch.equal(seen[0], seen[1])  # fresh draws, as for the global generator


# ---------------------------------------------------------------------- autocast


def mixed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x @ w).relu() @ w).float().tanh()


def autocast_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = mixed(x, w)
        with torch.autocast("cpu", enabled=False):
            h = h @ w  # float32 inside the region's bf16 region
    return h


AUTOCAST_PROGRAMS = {
    # autocast entered inside the region, with a disabled one nested in it
    "inside-with-nested-disabled": (autocast_inside, None, None),
    # entered outside, with cache_enabled=False; backward outside
    "outside-cache-disabled": (
        mixed,
        lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
        None,
    ),
    # forward without autocast, backward inside one
    "toggled-on-for-backward": (mixed, None, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("program", list(AUTOCAST_PROGRAMS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_autocast_inside_uncached_and_toggled_match_plain(variant, program):
    f, fwd_ctx, bwd_ctx = AUTOCAST_PROGRAMS[program]

    def run(call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with fwd_ctx() if fwd_ctx else torch.enable_grad():
            y = call(f, x, w)
        with bwd_ctx() if bwd_ctx else torch.enable_grad():
            y.square().sum().backward()
        return y

    assert_matches_reference(outcome(run, plain), outcome(run, REMAT[variant]), variant)


@pytest.mark.parametrize("cast_before_backward", [False, True])
@pytest.mark.parametrize("weight_is_argument", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_inside_an_autocast_of_another_dtype_keeps_the_cast_caches_apart(
    variant, weight_is_argument, cast_before_backward
):
    # The autocast cast cache is keyed by tensor, not dtype. Before the fix the recompute
    # (bf16) read the float16 cast the open region had cached ("expected m1 and m2 to
    # have the same dtype"), or left its bf16 cast behind so that `x @ w` after backward,
    # in the float16 region, ran in bf16. torch 2.13 has both bugs.
    def run(call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if weight_is_argument:
                y = call(mixed, x, w)
            else:
                y = call(lambda t: mixed(t, w), x)
        with torch.autocast("cpu", dtype=torch.float16):
            before = x @ w if cast_before_backward else None
            y.square().sum().backward()
            after = x @ w
        assert after.dtype == torch.float16
        return after if before is None else after + before

    assert_matches_reference(outcome(run, plain), outcome(run, REMAT[variant]), variant)


# ------------------------------------------------------------------ default dtype


@pytest.mark.parametrize("variant", VARIANTS)
def test_default_dtype_changed_before_backward_is_replayed(variant):
    # torch raises a metadata CheckpointError (non-reentrant) or recomputes in float64.
    seen = []

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_default_dtype())
        return (x @ w).tanh() * torch.tensor([2.0, 1.0, 0.5, 1.0]).unsqueeze(1)

    def run(call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = call(f, x, w)
        torch.set_default_dtype(torch.float64)
        try:
            y.square().sum().backward()
            assert torch.get_default_dtype() == torch.float64  # the caller's, after backward
        finally:
            torch.set_default_dtype(torch.float32)
        return y

    ref = outcome(run, plain)
    got = outcome(run, REMAT[variant])
    assert_matches_reference(ref, got, variant)
    assert seen[1:] == [torch.float32, torch.float32]  # plain forward, forward, recompute


# ------------------------------------------------------- every exit path restores


def snapshot(gen: torch.Generator) -> tuple[Any, ...]:
    return (
        torch.get_rng_state(),
        gen.get_state(),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
        torch.get_default_dtype(),
        device_mod.CURRENT_DEVICE,
        tuple(_get_current_function_mode_stack()),
        remat.is_checkpointing(),
        remat.is_recomputing(),
        torch._C._autograd._top_saved_tensors_default_hooks(False),
    )


class Boom(Exception):
    pass


def _boom(*_: Any) -> int:
    raise Boom("while entering the forward's state")


@pytest.mark.parametrize(
    "where",
    [
        "function",  # the user function raises in recompute
        "entering-state",  # remat raises half-way through putting the forward's state in place
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_exception_in_recompute_restores_every_flag(variant, where, monkeypatch):
    x, w = leaves()
    gen = torch.Generator().manual_seed(5)
    recomputing = {"on": False}

    def f(x: torch.Tensor, w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        torch.rand(2, generator=g)
        torch.rand(2)
        if recomputing["on"] and where == "function":
            raise Boom("in recompute")
        return mixed(x, w) * torch.ones(8)

    with torch.device("cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = REMAT[variant](f, x, w, gen)
    recomputing["on"] = True
    if where == "entering-state":
        monkeypatch.setattr(remat.engine.state, "_outer_autocast_nesting", _boom)
    loss = y.sum()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
            before = snapshot(gen)
            with pytest.raises(Boom):
                loss.backward()
            after = snapshot(gen)
            assert (x @ w).dtype == torch.float16  # no bf16 cast left in the open cache
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2:] == after[2:]


def test_deterministic_algorithms_flag_is_left_to_the_backward():
    # Documented: not replayed (it chooses kernels; CPU values do not depend on it).
    seen = []

    def f(t: torch.Tensor) -> torch.Tensor:
        seen.append(torch.are_deterministic_algorithms_enabled())
        return t.sin()

    x, _ = leaves()
    torch.use_deterministic_algorithms(True)
    try:
        out = remat.checkpoint(f, x)
    finally:
        torch.use_deterministic_algorithms(False)
    out.sum().backward()
    assert seen == [True, False]
    assert_all_equal([x.grad], [x.detach().cos()])
