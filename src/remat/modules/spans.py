"""Regions below the per-block floor: spans over several blocks, and blocks split in parts.

Checkpointing every block keeps each block's input until backward. A *span*
is one checkpointed region over consecutive blocks of a chain (the model's
own forward calls them one after the other, ``for layer in self.layers:
x = layer(x, mask=mask)``; the model's code is not changed), so only the
span's input is kept. With ``inner="recompute"`` the span's recompute
checkpoints each of its blocks in turn, so backward holds the span's block
inputs and one block's working set at a time (Chen et al. 2016, "Training
Deep Nets with Sublinear Memory Cost": nested checkpoints). *Splitting* a
block makes its children with parameters (attention, MLP, norms) their own regions, so
the recompute of one block holds its children's inputs and one child's
working set.

How a span is entered and left
------------------------------
:func:`apply_span` puts an instance-level ``forward`` on each block (as
:func:`remat.checkpoint_wrapper` does: class, names, ``state_dict`` keys and
hooks unchanged). The first block's forward starts a *run*: a
:class:`remat.engine.nonreentrant.PiecewiseRegion`, the engine's region whose
forward is run in pieces. Each block's forward is one piece: the region's
saved-tensor hooks are pushed when the block starts and popped when it
returns, so what the blocks save for backward is dropped, and what the
model's own code between the blocks saves is not the span's business. The
last block's forward marks the forward complete and ends the run.

When a block starts, the span records what the recompute needs to run it
again: its arguments with each tensor either *linked* (the tensor is one the
previous block returned: the recompute passes the recomputed one) or *kept*
(a mask, rotary tables, the span's input: kept through autograd
``SavedTensor``\\ s, like a checkpoint's inputs, deduplicated), its RNG,
autocast and default-device state (:class:`~remat.engine.state.ForwardState`) and
its buffers and train flags (the wrapper's guard, so BatchNorm statistics
are updated once).

How the recompute runs the chain
--------------------------------
When backward first needs a tensor the span dropped, the engine calls the
run's ``replay``: for each block in order it rebuilds the arguments (linked
tensors from the previous block's recomputed output, kept ones unpacked),
puts that block's recorded state in place, runs the block as in forward
(plain, or itself checkpointed with ``inner="recompute"``) and restores the
state. The engine hands the ``i``-th tensor saved to the ``i``-th slot and
stops early once the last one is filled, as for any checkpoint.

With ``inner="recompute"`` each block also runs as a checkpoint *inside* the
span, in forward and in recompute: the span's slots then hold only the
blocks' inputs, and each block's own checkpoint recomputes its activations
from them when backward reaches it (so each block runs three times a step).
``inner="keep"`` runs the blocks plainly inside the span (one checkpoint
over the whole span), ``inner="split"`` checkpoints each block and splits it.
``inner="selective"`` runs each block as a selective region: the outputs its
policy saves are handed to the span (:func:`remat.engine.nonreentrant.enclosing_region`),
so in forward the span keeps only its input, and its recompute brings each block's
input *and* saved outputs back, from which the blocks' own recomputes are served
(each saved operator runs twice a step, the others three times).

Region-input offload (``offload_inputs=True``, device only) keeps the span's
input (the tensors among its first block's positional arguments; keyword
arguments such as masks, shared by every block, stay) in pinned host memory
through the offload engine's shared stash, so backward prefetches the
previous spans' inputs while it recomputes this one.

What makes a chain, and what is refused
---------------------------------------
A :class:`~remat.PlanError` naming the blocks and the fix is raised, in the
forward that shows it, when

* a block runs out of order: a block other than the first runs when the
  block before it did not just run (a skipped or repeated block, a block
  called on its own);
* no tensor argument of a block is a tensor the previous block returned
  (the model changes the hidden state between the blocks: a norm, a
  dropout, a residual outside the blocks), or that tensor was changed in
  place between them;
* a block receives a tensor an earlier block of the span returned (a skip
  connection inside the span);
* a block's output that the next block received is still referenced once
  the span has moved past it (a list of hidden states, an auxiliary head):
  the span could not free it;
* backward needs the recompute of a run whose forward never reached its
  last block (an early exit): raised from backward;
* the span runs under ``torch.compile`` (spans are eager only).

The planner's calls
-------------------
``apply_span(model, names, inner=..., policy=..., offload_inputs=...)`` and
``remove_span(model, name)``; ``split_block(model, name, children=None)``
and ``unsplit_block(model, name)`` (in :mod:`remat.modules.split`); ``spans_in(model)``
and ``span_of(module)`` to read back what is applied. All change the model in place and keep its
names and ``state_dict`` keys; wrapping a span's block with
:func:`remat.checkpoint_wrapper` is not supported (remove the span first).

Limits: the check for outputs kept elsewhere cannot see the output of the
second-to-last block (it is the last block's argument while the span ends);
kept elsewhere it stays alive, gradients are still right. Gradients are
always those of the plain model: the autograd graph is the model's own, only
what it saves is recomputed. Spans run the non-reentrant engine only; the
determinism check is the default one (shapes, dtypes, devices) and
operator traces (``set_checkpoint_debug_enabled(True)``) are recorded for
the blocks' own checkpoints inside a span, not for the span itself. A span does not support
``nn.DataParallel`` (use DDP).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..engine import config
from ..engine.bytes import same_storage
from ..engine.errors import PlanError
from ..engine.nonreentrant import PiecewiseRegion, SavedInputs, run_nonreentrant
from ..engine.offload import moves_to_host, offload_shared
from ..engine.selective import create_selective_checkpoint_contexts
from ..engine.state import ForwardState, generators_in
from ..engine.tree import SLOT, replace_tensors, tensors_in
from .split import choose_children, is_split, resolve, unsplit_block, wrap_children
from .wrap import guarded_forward, is_wrapped

INNER = ("keep", "recompute", "selective", "split")


@dataclasses.dataclass(frozen=True)
class _Options:
    names: tuple[str, ...]
    inner: str
    policy: Any
    offload_inputs: bool
    preserve_rng_state: bool
    split: tuple[str, ...]  # blocks this span split (inner="split"), undone with the span
    prefetch: bool = True  # offload_inputs: prefetched by later backward (see apply_span)


def _label(names: Sequence[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} blocks)"


class _Piece:
    """What one block's forward recorded for the replay."""

    __slots__ = ("fn", "state", "template", "sources", "ctx")

    def __init__(self, fn: Callable[..., Any], state: ForwardState, template: Any) -> None:
        self.fn = fn  # the block's forward with the wrapper's side-effect guards
        self.state = state
        self.template = template  # (args, kwargs) with SLOT for each tensor
        self.sources: list[int] = []  # >= 0: kept tensor; < 0: -(j+1), the j-th tensor linked


class _Run:
    """One forward of a span: the region, what each block recorded, the links."""

    def __init__(self, span: _Span) -> None:
        self.opts = span.opts
        self.region: PiecewiseRegion | None = PiecewiseRegion(
            self.replay, early_stop=config.early_stop_override() is not False
        )
        self.kept = SavedInputs()
        self.kept_ids: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        self.pieces: list[_Piece] = []
        self.prev: list[weakref.ref[torch.Tensor]] = []  # tensors the last block returned
        self.prev_versions: list[int] = []
        self.earlier: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}  # older outputs
        self.carriers: list[tuple[int, weakref.ref[torch.Tensor]]] = []  # linked, by block
        self.complete = False

    # -- forward -----------------------------------------------------------------------
    def piece(
        self, i: int, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        opts = self.opts
        names = opts.names
        tensors: list[torch.Tensor] = []
        tensors_in(args, tensors)
        positional = len(tensors)
        tensors_in(kwargs, tensors)
        piece_sources: list[int] = []
        linked = False
        for n, t in enumerate(tensors):
            j = self._link(t)
            if j is not None:
                if t._version != self.prev_versions[j]:
                    raise PlanError(
                        f"remat span [{_label(names)}]: the output of {names[i - 1]} was "
                        f"changed in place before {names[i]} received it (version "
                        f"{self.prev_versions[j]} -> {t._version}); the span's recompute "
                        "runs the blocks back to back and would miss the change. Make the "
                        "change out of place inside a block, or checkpoint these blocks one "
                        "by one."
                    )
                piece_sources.append(-(j + 1))
                # by the last block that passed it on (a block may return its input)
                self.carriers = [(b, r) for b, r in self.carriers if r() is not t]
                self.carriers.append((i - 1, weakref.ref(t)))
                linked = True
                continue
            old = self.earlier.get(id(t))
            if old is not None and old[1]() is t:
                raise PlanError(
                    f"remat span [{_label(names)}]: {names[i]} received a tensor that "
                    f"{names[old[0]]} returned, not the block just before it: a skip "
                    "connection inside the span, whose recompute can only pass each block's "
                    f"output to the next. End the span before {names[old[0] + 1]} or "
                    "checkpoint these blocks one by one."
                )
            offload = i == 0 and opts.offload_inputs and n < positional
            piece_sources.append(self._keep(t, offload))
        if i > 0 and not linked:
            raise PlanError(
                f"remat span [{_label(names)}]: {names[i]} did not receive the output of "
                f"{names[i - 1]}: none of its tensor arguments is a tensor {names[i - 1]} "
                "returned (the model's code between them changes it: a norm, dropout or "
                "residual outside the blocks). A span's recompute runs the blocks back to "
                "back, so it cannot include code between them. End the span at "
                f"{names[i - 1]}, or checkpoint these blocks one by one."
            )
        generators: list[torch.Generator] = []
        if opts.preserve_rng_state:
            generators_in((args, kwargs), generators)
        state = ForwardState(tensors, opts.preserve_rng_state, generators)
        piece = _Piece(guarded_forward(module, forward, args, kwargs), state, None)
        piece.template = replace_tensors((args, kwargs), [SLOT] * len(tensors), [0])
        piece.sources = piece_sources
        self.pieces.append(piece)
        region = self.region
        assert region is not None
        with region.piece():
            out = self.run_block(piece, args, kwargs)
        for r in self.prev:
            done = r()
            if done is not None:
                self.earlier[id(done)] = (i - 1, r)
        outs: list[torch.Tensor] = []
        tensors_in(out, outs)
        self.prev = [weakref.ref(t) for t in outs]
        self.prev_versions = [t._version for t in outs]
        return out

    def _link(self, t: torch.Tensor) -> int | None:
        for j, r in enumerate(self.prev):
            if r() is t:
                return j
        return None

    def _keep(self, t: torch.Tensor, offload: bool) -> int:
        known = self.kept_ids.get(id(t))
        if known is not None and known[1]() is t:
            return known[0]
        if offload:
            if not moves_to_host(t):
                names = self.opts.names
                raise PlanError(
                    f"remat span [{_label(names)}]: offload_inputs=True, but the span's input "
                    f"(shape {tuple(t.shape)}) is on {t.device}, already in host memory: "
                    "region-input offload moves device tensors to pinned host memory and has "
                    "nothing to do on CPU. Apply the span with offload_inputs=False."
                )
            with offload_shared(min_bytes=0, prefetch=self.opts.prefetch):
                k = self.kept.add(t)
        else:
            k = self.kept.add(t)
        self.kept_ids[id(t)] = (k, weakref.ref(t))
        return k

    def run_block(self, piece: _Piece, args: Any, kwargs: Any) -> Any:
        """Run one block as the span's ``inner`` says (the same in forward and recompute)."""
        opts = self.opts
        if opts.inner == "keep":
            return piece.fn(*args, **kwargs)
        context_fn = None
        if opts.inner == "selective":
            context_fn = functools.partial(create_selective_checkpoint_contexts, opts.policy)
        return run_nonreentrant(
            piece.fn,
            args,
            kwargs,
            preserve_rng_state=opts.preserve_rng_state,
            context_fn=context_fn,
            determinism_check="default",
            debug=bool(config.debug_override()),
            early_stop=config.early_stop_override() is not False,
            state=piece.state,
        )

    def finish(self) -> None:
        region = self.region
        assert region is not None
        region.complete()
        self.complete = True
        self.region = None  # the region's frame holds this run: no cycle
        names = self.opts.names
        alive = [(i, t) for i, r in self.carriers if (t := r()) is not None]
        for i, t in alive:
            # a later block's output may be a view of it (a reshape): that keeps no more
            shared = any(same_storage(t, u) for k, u in alive if k > i)
            if i < len(names) - 2 and not shared:
                raise PlanError(
                    f"remat span [{_label(names)}]: the output of {names[i]} is still "
                    f"referenced after {names[i + 1]} used it: something outside the next "
                    "block keeps it (a list of hidden states, an auxiliary loss, a forward "
                    "hook), so the span cannot free it. Stop keeping it (for example "
                    f"output_hidden_states=False), or end the span at {names[i]}."
                )

    def abandon(self) -> None:
        self.region = None

    # -- backward ------------------------------------------------------------------------
    def replay(self) -> None:
        """Run the blocks again, in order, each under the state its forward saw."""
        names = self.opts.names
        if not self.complete:
            ran = len(self.pieces)
            raise PlanError(
                f"remat span [{_label(names)}]: backward needs the span's recompute, but its "
                f"forward stopped after {names[ran - 1]} ({names[ran]} never ran in that "
                "forward: an early exit, a skipped block or an exception). A span's blocks "
                "must all run, in order, once per forward. Checkpoint these blocks one by one."
            )
        kept = self.kept.values()
        prev: list[torch.Tensor] = []
        for piece in self.pieces:
            new = [kept[s] if s >= 0 else prev[-s - 1] for s in piece.sources]
            args, kwargs = replace_tensors(piece.template, new, [0])
            token = piece.state.enter()
            try:
                out = self.run_block(piece, args, kwargs)
            finally:
                piece.state.exit(token)
            prev = []
            tensors_in(out, prev)


class _Span:
    """One span: its options and, per thread, the forward run in progress."""

    __slots__ = ("opts", "runs", "__weakref__")

    def __init__(self, opts: _Options) -> None:
        self.opts = opts
        self.runs: dict[int, _Run] = {}

    def call(
        self, i: int, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        tid = threading.get_ident()
        run = self.runs.get(tid)
        names = self.opts.names
        if i == 0:
            if run is not None:  # a forward that stopped part way
                run.abandon()
            run = self.runs[tid] = _Run(self)
        elif run is None or len(run.pieces) != i:
            if run is not None:
                self.runs.pop(tid, None)
                run.abandon()
            last = (
                "no block of the span ran before it in this forward"
                if run is None
                else f"the last block of the span to run was {names[len(run.pieces) - 1]}"
            )
            raise PlanError(
                f"remat span [{_label(names)}]: {names[i]} was called, but {names[i - 1]} did "
                f"not run just before it ({last}). A span's blocks must be called in the "
                "order given, each once per forward, the output of one passed to the next (a "
                "skipped, repeated or separately called block breaks this). Give the blocks "
                "in the order the model calls them, or checkpoint them one by one."
            )
        try:
            out = run.piece(i, module, forward, args, kwargs)
            if i == len(names) - 1:
                self.runs.pop(tid, None)
                run.finish()
        except BaseException:
            if self.runs.get(tid) is run:
                del self.runs[tid]
            run.abandon()
            raise
        return out

    def __reduce__(self) -> Any:
        return (_Span, (self.opts,))


class _SpanForward:
    """The instance-level ``forward`` of a block in a span (holds the block weakly)."""

    __slots__ = ("ref", "span", "index", "previous", "__weakref__")

    def __init__(
        self, module: nn.Module, span: _Span, index: int, previous: Callable[..., Any] | None
    ) -> None:
        self.ref = weakref.ref(module)
        self.span = span
        self.index = index
        self.previous = previous  # an instance-level forward that was there before, if any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        if module is None:
            raise RuntimeError("remat span: the block no longer exists.")
        forward = (
            self.previous
            if self.previous is not None
            else functools.partial(type(module).forward, module)
        )
        if not torch.is_grad_enabled() or config.checkpointing_disabled():
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            raise PlanError(
                f"remat span [{_label(self.span.opts.names)}]: spans run in eager mode only; "
                "torch.compile cannot trace a region that starts in one module's forward and "
                "ends in another's. Use a plan without spans (blocks checkpointed one by one) "
                "under torch.compile."
            )
        return self.span.call(self.index, module, forward, args, kwargs)

    def __reduce__(self) -> Any:
        # Pickle/deepcopy: point at the copy of the block (pickle memoizes it first).
        return (_SpanForward, (self.ref(), self.span, self.index, self.previous))


class _SpanRepr:
    """Instance-level ``extra_repr`` that marks the block's place in its span."""

    __slots__ = ("ref", "span", "index", "__weakref__")

    def __init__(self, module: nn.Module, span: _Span, index: int) -> None:
        self.ref = weakref.ref(module)
        self.span = span
        self.index = index

    def __call__(self) -> str:
        module = self.ref()
        if module is None:
            return ""
        base = type(module).extra_repr(module)
        opts = self.span.opts
        note = (
            f"[remat: span {self.index + 1}/{len(opts.names)} of {_label(opts.names)}, "
            f"inner={opts.inner}" + (", offload_inputs" if opts.offload_inputs else "") + "]"
        )
        return f"{base}, {note}" if base else note

    def __reduce__(self) -> Any:
        return (_SpanRepr, (self.ref(), self.span, self.index))


class _NoReplicate:
    """Instance-level ``_replicate_for_data_parallel``: spans do not support DataParallel."""

    __slots__ = ("names",)

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def __call__(self) -> nn.Module:
        raise PlanError(
            f"remat span [{_label(self.names)}]: nn.DataParallel replicates blocks one by one, "
            "which cannot keep a span over several of them. Use DistributedDataParallel, or "
            "remove the span."
        )

    def __reduce__(self) -> Any:
        return (_NoReplicate, (self.names,))


def span_of(module: nn.Module) -> tuple[str, ...] | None:
    """The names of the span ``module`` is a block of (as given to :func:`apply_span`), or None."""
    fwd = module.__dict__.get("forward")
    return fwd.span.opts.names if isinstance(fwd, _SpanForward) else None


def apply_span(
    model: nn.Module,
    names: Sequence[str],
    *,
    inner: str = "recompute",
    policy: Any = None,
    offload_inputs: bool = False,
    preserve_rng_state: bool = True,
    prefetch: bool = True,
) -> None:
    """Make the blocks ``names`` of ``model`` one checkpointed span, in place.

    The model's forward must call the blocks one after the other, in this
    order, each once per forward, each receiving (as some tensor argument)
    a tensor the previous one returned; a forward that does not raises a
    :class:`~remat.PlanError` (see the module docstring).

    Args:
        model: the model (changed in place; names and ``state_dict`` keys unchanged).
        names: the blocks, in the order the model calls them (submodule names).
        inner: how each block runs inside the span: ``"recompute"`` (each block
            also checkpointed: backward holds the span's block inputs and one
            block's activations), ``"keep"`` (plain: one checkpoint over the
            span), ``"selective"`` (each block with ``policy``), ``"split"``
            (each block checkpointed and split, see :func:`remat.modules.split.split_block`).
        policy: the selective policy for ``inner="selective"`` (a
            :class:`~remat.CheckpointPolicy`-returning function or an op list).
        offload_inputs: keep the span's input in pinned host memory until
            backward, prefetched (device only; on CPU it raises).
        preserve_rng_state: replay RNG state in recompute, as in :func:`remat.checkpoint`.
        prefetch: with ``offload_inputs``: backward brings the input back while it
            reaches the span (the copy overlaps the backward of the blocks after it),
            or, ``False``, when the span's own backward asks for it (one copy the
            backward waits for; the device holds it only from then on, whatever the
            other spans do: how :func:`remat.plan` models it).

    Raises:
        PlanError: for names that are not blocks of the model, nested or repeated
            blocks, blocks already wrapped or in a span, bad options, or
            ``offload_inputs`` for blocks whose parameters are in host memory.

    Example:
        >>> import torch
        >>> from remat.modules.spans import apply_span, remove_span
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> apply_span(model, ["0", "1", "2", "3"])
        >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> remove_span(model, "0")
        ['0', '1', '2', '3']
    """
    what = "apply_span"
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise PlanError(
            f"{what}: names must be a non-empty list of block names in call order, got {names!r}."
        )
    names = tuple(names)
    if inner not in INNER:
        raise PlanError(f"{what}: inner must be one of {list(INNER)}, got {inner!r}.")
    if (policy is None) == (inner == "selective"):
        raise PlanError(
            f"{what}: policy goes with inner='selective' and only with it (got inner={inner!r}, "
            f"policy={policy!r}). Pass both or neither."
        )
    if len(set(names)) != len(names):
        raise PlanError(f"{what}: a block is named twice in {list(names)}.")
    blocks = [resolve(model, n, what) for n in names]
    for a, (na, ma) in enumerate(zip(names, blocks)):
        for nb, mb in zip(names[a + 1 :], blocks[a + 1 :]):
            if ma is mb:
                raise PlanError(
                    f"{what}: {na!r} and {nb!r} are the same module; a span's blocks must be "
                    "different modules, each called once per forward."
                )
            if any(m is mb for m in ma.modules()) or any(m is ma for m in mb.modules()):
                raise PlanError(f"{what}: {na!r} and {nb!r} are nested; list sibling blocks.")
    for n, m in zip(names, blocks):
        if is_wrapped(m):
            raise PlanError(
                f"{what}: {n!r} is checkpoint_wrapper-ed; call remat.unwrap on it first (a "
                "span decides how its blocks run)."
            )
        if span_of(m) is not None:
            raise PlanError(f"{what}: {n!r} is already in a span; remove_span it first.")
    if offload_inputs:
        first = next(blocks[0].parameters(), None)
        if first is not None and not moves_to_host(first):
            raise PlanError(
                f"{what}: offload_inputs=True, but {names[0]!r} is on {first.device}: "
                "region-input offload moves device tensors to pinned host memory and has "
                "nothing to do on CPU. Pass offload_inputs=False, or move the model to its "
                "device first."
            )
    split: list[tuple[str, nn.Module, list[str]]] = []
    if inner == "split":  # choose (and validate) every block's children before wrapping any
        for n, m in zip(names, blocks):
            if not is_split(m):
                split.append((n, m, choose_children(m, n, None)))
        for n, m, chosen in split:
            wrap_children(m, n, chosen)
    opts = _Options(
        names,
        inner,
        policy,
        bool(offload_inputs),
        bool(preserve_rng_state),
        tuple(n for n, _, _ in split),
        bool(prefetch),
    )
    span = _Span(opts)
    for i, m in enumerate(blocks):
        previous = m.__dict__.get("forward")
        m.__dict__["forward"] = _SpanForward(m, span, i, previous)
        m.__dict__["extra_repr"] = _SpanRepr(m, span, i)
        m.__dict__["_replicate_for_data_parallel"] = _NoReplicate(names)


def remove_span(model: nn.Module, name: str) -> list[str]:
    """Undo :func:`apply_span` for the span that block ``name`` is in; return its blocks.

    Blocks that ``inner="split"`` split are unsplit.
    """
    block = resolve(model, name, "remove_span")
    fwd = block.__dict__.get("forward")
    if not isinstance(fwd, _SpanForward):
        raise PlanError(f"remove_span: {name!r} is not a block of a span.")
    span = fwd.span
    for m in model.modules():
        f = m.__dict__.get("forward")
        if isinstance(f, _SpanForward) and f.span is span:
            if f.previous is not None:
                m.__dict__["forward"] = f.previous
            else:
                del m.__dict__["forward"]
            m.__dict__.pop("extra_repr", None)
            m.__dict__.pop("_replicate_for_data_parallel", None)
    for n in span.opts.split:
        unsplit_block(model, n)
    return list(span.opts.names)


def spans_in(model: nn.Module) -> list[tuple[str, ...]]:
    """The spans applied to ``model``'s blocks, each as its block names."""
    out: list[tuple[str, ...]] = []
    for m in model.modules():
        f = m.__dict__.get("forward")
        if isinstance(f, _SpanForward) and f.index == 0:
            out.append(f.span.opts.names)
    return out
