"""``remat.checkpoint``, both variants, on random programs: against no checkpointing and torch.

Many small random programs are generated (seeded: every failure names a
reproducible ``seed``). A program is a body of ops (``nn.Linear``, matmul,
elementwise, dropout and ``rand_like``, in-place ops on intermediates, views of
the region's inputs, a non-tensor scale) in which checkpointed regions are
called, nested up to three deep, siblings side by side. A region takes its
tensors flat, in a list, dict, tuple or dataclass, or as keyword arguments
(non-reentrant only), plus a non-tensor; it returns a tensor, a tuple with a
second tensor (used by the loss or not), one that does not require grad and an
``int``, or a dict (non-reentrant only). The top input may be frozen (no grad)
with parameters inside. Each region draws ``set_checkpoint_early_stop``
(unset, ``False``, ``True``) and, in remat, ``determinism_check`` (``"default"``
or ``"values"``). Backward is one of: ``loss.backward()``,
``torch.autograd.grad`` of a subset of the leaves, ``backward(inputs=subset)``,
``retain_graph=True`` and a second backward, and a double backward through
``create_graph=True`` (non-reentrant).

Each program runs three ways from the same RNG state: without checkpointing
(the reference), with ``remat.checkpoint`` and with
``torch.utils.checkpoint.checkpoint``, both with the same ``use_reentrant``.
remat must give the reference's outputs and gradients bit for bit and leave
the global CPU RNG where the reference leaves it; where torch raises, remat
raises the same exception type; after forward a program under remat keeps no
more tensor bytes than under torch (``remat.memory.track``, exact bytes).

Where torch is wrong or stricter (torch 2.13), only the reference equality is
asserted for remat:

* reentrant, a region none of whose tensor inputs requires grad (frozen input,
  parameters inside): torch warns and its parameters get no gradient; remat
  gives them the reference gradients (API.md, section 1).
* reentrant, ``torch.autograd.grad`` / ``backward(inputs=...)`` where the
  requested leaves are parameters used inside a region but no region input
  leads to them: the engine prunes the region's node, so its share of their
  gradient is silently missing, without the "does not work with grad()" error
  (the node never runs to raise it). remat does the same (not fixed); only the
  leaves torch gets right are asserted.
* reentrant gradients are summed in another order (a nested backward fills the
  region's leaves): equal to the reference up to rounding, to torch bit for bit.

Found and fixed in remat: a reentrant region that reads the output of a region
over frozen inputs (which requires grad in remat only, through its anchor) and
does not use it raised torch's "checkpoint() is not necessary", where torch and
the uncheckpointed run do not (the two focused tests at the end).


Property: any ``nn.Sequential``, checkpointed in any segments, gives the plain gradients.
Hypothesis draws a chain of random layers (dropout included, so RNG replay is
exercised), random cut points, which segments are checkpointed, the variant,
early stop and an optional outer region around everything. Loss and every
gradient must be bitwise equal to the plain run from the same seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from tests.support.differential import Outcome, assert_matches_reference, seeded_linear
from tests.support.tensors import assert_all_equal

B, D = 4, 8
OPS = ("linear", "mm", "unary", "binary", "dropout", "rand", "inplace", "input_view", "scale")
PACKS = ("flat", "list", "dict", "tuple", "dataclass", "kwargs")
OUTS = ("tensor", "tuple", "dict")
BACKWARDS = ("backward", "grad_subset", "inputs_subset", "retain_twice", "double")


@dataclasses.dataclass
class Pair:
    """A dataclass argument holding two tensors."""

    a: torch.Tensor
    b: torch.Tensor


# -- programs --------------------------------------------------------------------------
class Params:
    """The leaves a program reads besides its inputs, and a frozen matrix."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lin = seeded_linear(g, D)
        self.w = (torch.randn(D, D, generator=g) * 0.3).requires_grad_()
        self.frozen = torch.randn(D, D, generator=g) * 0.3

    def leaves(self) -> list[torch.Tensor]:
        return [self.lin.weight, self.lin.bias, self.w]


@dataclasses.dataclass
class Region:
    """A body of steps: ``("op", kind, seed)`` or ``("call", Region, seed)``."""

    steps: list[tuple[str, Any, int]]
    pack: str = "flat"
    out: str = "tensor"
    use_aux: bool = False  # whether the caller uses the region's second output
    early_stop: bool | None = None
    check: str = "default"


def gen_region(rng: random.Random, depth: int, reentrant: bool, top: bool = False) -> Region:
    steps: list[tuple[str, Any, int]] = []
    for _ in range(rng.randint(1, 4)):
        if depth > 0 and rng.random() < 0.45:
            steps.append(("call", gen_region(rng, depth - 1, reentrant), rng.randrange(10**6)))
        else:
            steps.append(("op", rng.choice(OPS), rng.randrange(10**6)))
    if top and depth > 0 and not any(s[0] == "call" for s in steps):
        steps.insert(
            rng.randrange(len(steps) + 1), ("call", gen_region(rng, depth - 1, reentrant), 1)
        )
    # Reentrant: torch's variant takes positional tensors and returns a tensor or a tuple.
    pack = "flat" if reentrant else rng.choice(PACKS)
    out = rng.choice(OUTS[:2] if reentrant else OUTS)
    return Region(
        steps,
        pack=pack,
        out=out,
        use_aux=rng.random() < 0.5,
        early_stop=rng.choice((None, None, False, True)),
        check="values" if rng.random() < 0.2 else "default",
    )


def op(kind: str, seed: int, vals: list[torch.Tensor], scale: float, p: Params) -> torch.Tensor:
    """One op of the vocabulary; every result has shape (B, D)."""
    r = random.Random(seed)
    a = vals[-1] if r.random() < 0.6 else r.choice(vals)
    b = r.choice(vals)
    c = r.randrange(4)
    if kind == "linear":
        return p.lin(a)
    if kind == "mm":
        return a @ (p.w if c else p.frozen)
    if kind == "unary":
        return (torch.sin, torch.tanh, F.relu, torch.sigmoid)[c](a * 0.5)
    if kind == "binary":
        return a * b if c % 2 else a + b
    if kind == "dropout":
        return F.dropout(a, p=0.3, training=True)
    if kind == "rand":
        return a * torch.rand_like(a) if c % 2 else a + torch.randn(B, D)
    if kind == "inplace":  # on intermediates
        t = a * 1.5
        if c == 0:
            t.add_(b)
        elif c == 1:
            t.mul_(b)
        elif c == 2:
            t.relu_()
        else:  # through a view
            t[:, :2].mul_(3)
        return t
    if kind == "input_view":  # views of the body's first input
        x = vals[0]
        if c == 0:
            return x.t().t() * b
        if c == 1:
            return torch.cat([x[:, : D // 2], b[:, D // 2 :]], dim=1)
        if c == 2:
            return x.reshape(D, B).t().reshape(B, D) + b
        return x[:1].expand(B, D) * b
    if kind == "scale":
        return a * scale
    raise AssertionError(kind)


class Wrap:
    """Calls a region: plainly (``kind="none"``), with remat's or with torch's checkpoint."""

    def __init__(self, kind: str, reentrant: bool) -> None:
        self.kind = kind
        self.reentrant = reentrant
        self.torch_frozen_warned = False
        self.repeated_args = False

    def call(
        self, region: Region, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        if self.kind == "none":
            return fn(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.repeated_args |= len({id(a) for a in tensors}) < len(tensors)
        if self.kind == "remat":
            stop: Any = contextlib.nullcontext()
            if region.early_stop is not None:
                stop = remat.set_checkpoint_early_stop(region.early_stop)
            with stop:
                opts: dict[str, Any] = {"use_reentrant": self.reentrant}
                if not self.reentrant:
                    opts["determinism_check"] = region.check
                return remat.checkpoint(fn, *args, **opts, **kwargs)
        stop = contextlib.nullcontext()
        if region.early_stop is not None:
            stop = tuc.set_checkpoint_early_stop(region.early_stop)
        with stop, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = tuc.checkpoint(fn, *args, use_reentrant=self.reentrant, **kwargs)
        for w in seen:
            if "None of the inputs have requires_grad" in str(w.message):
                self.torch_frozen_warned = True  # torch's known reentrant bug (docstring)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out


def pack_args(pack: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[tuple, dict]:
    if pack == "flat":
        return (a, scale, b), {}
    if pack == "list":
        return ([a, b], scale), {}
    if pack == "dict":
        return ({"a": a, "s": scale, "b": b},), {}
    if pack == "tuple":
        return ((a, b), scale), {}
    if pack == "dataclass":
        return (Pair(a, b), scale), {}
    return (a,), {"b": b, "scale": scale}


def unpack_args(pack: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    if pack == "flat":
        return args[0], args[2], args[1]
    if pack in ("list", "tuple"):
        return args[0][0], args[0][1], args[1]
    if pack == "dict":
        return args[0]["a"], args[0]["b"], args[0]["s"]
    if pack == "dataclass":
        return args[0].a, args[0].b, args[1]
    return args[0], kwargs["b"], kwargs["scale"]


def run_body(region: Region, vals: list[torch.Tensor], scale: float, p: Params, wrap: Wrap) -> list:
    """Run ``region.steps`` on ``vals``; returns the values (inputs first)."""
    vals = list(vals)
    for kind, what, seed in region.steps:
        if kind == "op":
            vals.append(op(what, seed, vals, scale, p))
            continue
        r = random.Random(seed)
        sub: Region = what
        a, b = r.choice(vals), r.choice(vals)
        args, kwargs = pack_args(sub.pack, a, b, r.choice((0.5, 2.0)))
        res = wrap.call(sub, functools.partial(region_fn, sub, p, wrap), args, kwargs)
        if sub.out == "tensor":
            vals.append(res)
        elif sub.out == "tuple":
            # An autograd.Function (reentrant) makes every tensor output require grad.
            assert res[3] == 3 and (wrap.reentrant or not res[2].requires_grad)
            vals.append(res[0])
            if sub.use_aux:
                vals.append(res[1])
        else:
            assert res["n"] == 3 and not res["mask"].requires_grad
            vals.append(res["y"] * res["mask"])
            if sub.use_aux:
                vals.append(res["aux"])
    return vals


def region_fn(region: Region, p: Params, wrap: Wrap, *args: Any, **kwargs: Any) -> Any:
    a, b, scale = unpack_args(region.pack, args, kwargs)
    vals = run_body(region, [a, b], scale, p, wrap)
    y = vals[-1] + 0.5 * vals[-2]
    if region.out == "tensor":
        return y
    if region.out == "tuple":  # a second output, one that needs no grad, a non-tensor
        return y, vals[-2].cos(), (y > 0).float(), 3
    return {"y": y, "aux": vals[-1].sin(), "mask": (y > 0).float(), "n": 3}


@dataclasses.dataclass
class Program:
    body: Region
    frozen_x: bool
    backward: str
    subset: list[int]  # indices into [x, *params] for grad / backward(inputs=)
    reentrant: bool


def gen_program(seed: int, reentrant: bool) -> Program:
    rng = random.Random(seed)
    depth = rng.choice((0, 1, 1, 2, 2, 3))
    body = gen_region(rng, depth, reentrant, top=True)
    backward = rng.choice(BACKWARDS if not reentrant else BACKWARDS[:4])
    frozen_x = rng.random() < 0.25
    subset = sorted(rng.sample(range(4), rng.randint(1, 3)))
    return Program(body, frozen_x, backward, subset, reentrant)


# -- running ---------------------------------------------------------------------------
def run_once(prog: Program, kind: str, *, track: bool = False) -> Outcome:
    """Forward and backward of ``prog`` from a fixed RNG state, regions run by ``kind``."""
    p = Params(7)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, D, generator=g).requires_grad_(not prog.frozen_x)
    c = torch.randn(B, D, generator=g)  # a constant input: never requires grad
    gout = torch.randn(B, D, generator=g)
    leaves = [x, *p.leaves()]
    wrap = Wrap(kind, prog.reentrant)
    torch.manual_seed(1234)
    res = Outcome()
    try:
        tracker: Any = remat.memory.track() if track else contextlib.nullcontext()
        with tracker as t:
            vals = run_body(prog.body, [x, c], 1.5, p, wrap)
            out = p.lin(vals[-1]) + 0.5 * vals[-2]  # always requires grad
        if track:
            res.fwd_bytes = t.current_bytes
        res.out = out.detach().clone()
        loss = (out * gout).sum()
        subset = [leaves[i] for i in prog.subset if leaves[i].requires_grad] or [p.w]
        if prog.backward == "backward":
            loss.backward()
        elif prog.backward == "grad_subset":
            got = torch.autograd.grad(loss, subset, allow_unused=True)
            for leaf, gr in zip(subset, got):
                leaf.grad = gr
        elif prog.backward == "inputs_subset":
            loss.backward(inputs=subset)
        elif prog.backward == "retain_twice":
            loss.backward(retain_graph=True)
            res.grads_again = [leaf.grad for leaf in leaves]
            for leaf in leaves:
                leaf.grad = None
            loss.backward()
        else:  # double backward
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            got = torch.autograd.grad(loss, wanted, create_graph=True, allow_unused=True)
            gg = sum((gr * gr).sum() for gr in got if gr is not None)
            if isinstance(gg, torch.Tensor) and gg.requires_grad:
                gg.backward()
        res.grads = [leaf.grad for leaf in leaves]
        res.rng = torch.get_rng_state()
    except RuntimeError as e:  # CheckpointError derives from RuntimeError
        res.error = e
    res.torch_frozen_warned = wrap.torch_frozen_warned
    res.repeated_args = wrap.repeated_args
    return res


def uses_values_check(region: Region) -> bool:
    return any(
        s[0] == "call" and (s[1].check == "values" or uses_values_check(s[1])) for s in region.steps
    )


def close_grads(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[bool]:
    """Per leaf: close, ``None`` counting as zeros.

    Reentrant sums gradients in another order, and an autograd.Function hands zeros,
    not ``None``, to the nested backward for outputs that got no gradient.
    """
    out = []
    for u, v in zip(a, b):
        if u is None or v is None:
            w = u if v is None else v
            out.append(w is None or not bool(w.any()))
        else:
            out.append(bool(torch.allclose(u, v, rtol=1e-5, atol=1e-6)))
    return out


def check_reentrant(prog: Program, ref: Outcome, ours: Outcome, theirs: Outcome) -> None:
    """Reentrant: a region's parameters get their gradient from a nested backward, so
    gradients are summed in another order than without checkpointing (torch alike):
    equal to the reference up to rounding, and to torch bit for bit."""
    assert ours.error is None, f"remat raised where torch did not: {ours.error!r}"
    assert torch.equal(ref.out, ours.out), "remat: outputs differ"
    assert torch.equal(ref.rng, ours.rng), "remat: RNG state after backward differs"
    assert ref.grads is not None and ours.grads is not None
    near = close_grads(ref.grads, ours.grads)
    if prog.backward in ("grad_subset", "inputs_subset"):
        # A region off the path to the requested leaves is pruned by the engine: its
        # parameters miss the region's share (torch alike, see the module docstring).
        # Where torch is right, remat must be too.
        assert theirs.grads is not None
        torch_near = close_grads(ref.grads, theirs.grads)
        assert all(n for n, t in zip(near, torch_near) if t), "remat: gradients differ"
        return
    assert all(near), "remat: gradients differ"
    if ours.grads_again is not None:
        assert all(close_grads(ref.grads_again, ours.grads_again)), "remat: first backward differs"
    if not theirs.torch_frozen_warned and not ours.repeated_args:
        # One tensor passed as two arguments: torch detaches it twice and sums the two
        # gradients outside; remat detaches it once (identity kept), so the sums round
        # differently from torch's (both close to the reference, checked above).
        assert theirs.grads is not None and ours.grads is not None
        assert_all_equal(theirs.grads, ours.grads, "remat: gradients differ from torch's")


def differential_case(seed: int, reentrant: bool) -> None:
    prog = gen_program(seed, reentrant)
    ref = run_once(prog, "none")
    assert ref.error is None, f"the uncheckpointed run raised: {ref.error!r}"
    ours = run_once(prog, "remat", track=True)
    theirs = run_once(prog, "torch", track=True)
    if theirs.error is not None and (ours.error is not None or not theirs.torch_frozen_warned):
        assert ours.error is not None, f"torch raised, remat did not: {theirs.error!r}"
        assert type(ours.error) is type(theirs.error), (ours.error, theirs.error)
        return
    if reentrant and prog.backward in ("grad_subset", "inputs_subset") and ours.error is not None:
        # A frozen region that torch leaves out of the graph: remat's is in it, and
        # raises the reentrant variant's error for grad() / backward(inputs=).
        assert theirs.torch_frozen_warned and "does not work with" in str(ours.error)
        return
    if reentrant:
        check_reentrant(prog, ref, ours, theirs)
    else:
        assert_matches_reference(ref, ours, "remat")
        assert_matches_reference(ref, theirs, "torch")
    if theirs.error is None and not theirs.torch_frozen_warned and not uses_values_check(prog.body):
        # "values" keeps a 16-byte checksum per saved tensor: compared only without it;
        # where torch drops a frozen region from the graph, it keeps less (and is wrong).
        assert ours.fwd_bytes is not None and theirs.fwd_bytes is not None
        assert ours.fwd_bytes <= theirs.fwd_bytes, (ours.fwd_bytes, theirs.fwd_bytes)


# -- tests -----------------------------------------------------------------------------
N_CHUNKS, PER_CHUNK = 8, 25  # per variant: 200 programs, seeds 0..199


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("chunk", range(N_CHUNKS))
def test_random_programs_match_uncheckpointed_and_torch(chunk, reentrant):
    for seed in range(chunk * PER_CHUNK, (chunk + 1) * PER_CHUNK):
        try:
            differential_case(seed, reentrant)
        except AssertionError as e:
            raise AssertionError(f"seed={seed} {gen_program(seed, reentrant)}: {e}") from None


def test_reentrant_region_reading_a_frozen_region_output_does_not_raise():
    # Minimised from seed 65: a reentrant region over frozen inputs gets remat's anchor,
    # so its output requires grad (in torch it does not). A second region that takes that
    # output and does not use it must not raise torch's "checkpoint() is not necessary":
    # torch does not raise there, and the uncheckpointed run has nothing to complain about.
    def run(ck):
        w = torch.ones(4, requires_grad=True)
        c = torch.arange(4.0)
        y = ck(lambda a: a * 2, c)
        z = ck(lambda a, b: a.sin(), c, y)
        (z * w).sum().backward()
        return w.grad

    ref = run(lambda f, *a: f(*a))
    assert torch.equal(run(lambda f, *a: remat.checkpoint(f, *a, use_reentrant=True)), ref)


def test_reentrant_region_nested_in_a_recompute_reading_a_frozen_region_output():
    # Minimised from seed 1560: the same, with the second region nested inside another,
    # so that it sees the frozen region's output through the outer recompute's detached
    # copy of it.
    def run(ck):
        w = torch.ones(4, requires_grad=True)
        c = torch.arange(4.0)
        y = ck(lambda a: a * 2, c)
        z = ck(lambda a, b: ck(lambda p, q: p.sin(), a, b) * 1.0, c, y)
        (z * w).sum().backward()
        return w.grad

    ref = run(lambda f, *a: f(*a))
    assert torch.equal(run(lambda f, *a: remat.checkpoint(f, *a, use_reentrant=True)), ref)


def test_reentrant_region_whose_input_requires_grad_still_raises_not_necessary():
    # The anchor exemption above must not hide torch's error where torch raises it.
    w = torch.ones(4, requires_grad=True)
    x = torch.arange(4.0, requires_grad=True)
    z = remat.checkpoint(lambda a, b: b.sin(), x, torch.arange(4.0), use_reentrant=True)
    with pytest.raises(RuntimeError, match="not necessary"):
        (z * w).sum().backward()


# ---------------------------------------------------------------- property: random segments


WIDTH = 6
LAYERS = {
    "linear": lambda: torch.nn.Linear(WIDTH, WIDTH),
    "tanh": torch.nn.Tanh,
    "gelu": torch.nn.GELU,
    "relu": torch.nn.ReLU,
    "silu": torch.nn.SiLU,
    "layernorm": lambda: torch.nn.LayerNorm(WIDTH),
    "dropout": lambda: torch.nn.Dropout(0.3),
}


class Segment(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module], how: str, early_stop: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*layers)
        self.how = how
        self.early_stop = early_stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "plain":
            return self.body(x)
        if self.how == "reentrant":
            return remat.checkpoint(self.body, x, use_reentrant=True)
        return remat.checkpoint(self.body, x, early_stop=self.early_stop)


@st.composite
def chains(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=8))
    cuts = sorted(draw(st.sets(st.integers(1, len(kinds)), max_size=len(kinds))))
    bounds = [0, *[c for c in cuts if c < len(kinds)], len(kinds)]
    hows = draw(
        st.lists(
            st.sampled_from(["plain", "nonreentrant", "reentrant"]),
            min_size=len(bounds) - 1,
            max_size=len(bounds) - 1,
        )
    )
    return kinds, bounds, hows, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 99))


def run(model: torch.nn.Module, x: torch.Tensor, outer: bool, seed: int):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = remat.checkpoint(model, x) if outer else model(x)
    loss = (out * torch.linspace(-1, 1, WIDTH)).square().sum()
    loss.backward()
    return (
        [loss.detach(), x.grad] + [p.grad for p in model.parameters()],
        torch.get_rng_state(),
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(chains())
def test_random_sequential_random_segments_grads_equal_plain(chain):
    kinds, bounds, hows, early_stop, outer, seed = chain
    torch.manual_seed(seed)
    layers = [LAYERS[k]() for k in kinds]
    plain = torch.nn.Sequential(*layers)
    segmented = torch.nn.Sequential(
        *[Segment(layers[a:b], how, early_stop) for a, b, how in zip(bounds[:-1], bounds[1:], hows)]
    )
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    ref, ref_rng = run(plain, x, False, seed)
    got, rng = run(segmented, x, outer, seed)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert (r is None and g is None) or torch.equal(r, g)
    assert torch.equal(rng, ref_rng)
