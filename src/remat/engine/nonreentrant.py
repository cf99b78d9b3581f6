"""The non-reentrant engine: saved-tensor hooks, recompute per backward, early stop.

How it works
------------
While the checkpointed function runs in forward, a pack hook replaces every
tensor autograd wants to save with a small :class:`_Holder`; the tensor itself
is not kept. The region's inputs are kept instead, as autograd ``SavedTensor``
objects made under the hooks that were active *outside* the region, so that

* an in-place change of an input after forward raises autograd's usual
  "modified by an inplace operation" error instead of a silently wrong gradient;
* a checkpoint nested in another one hands its inputs to the outer region,
  which recomputes them too (nesting keeps only the outermost inputs).

When backward first unpacks a holder of a region, the region is recomputed
under the forward's RNG and autocast state (:mod:`remat.engine.state`), with a
second pack hook that stores the ``i``-th saved tensor into the ``i``-th
holder, keyed by the autograd graph task. Unpacking pops the tensor, so each
recomputed tensor is freed as soon as its backward node has used it, also with
``retain_graph=True`` (a later backward is a new graph task and recomputes
again). What a backward never unpacks (``torch.autograd.grad`` of one output
of a region with several) is dropped by a final callback of its graph task; a
saved tensor read outside backward recomputes the region for itself alone. With early stop the recompute raises a private exception as soon as
the last holder is filled and the rest of the function never runs.

The frame holds weak references to its holders: a holder dies with its graph
node, and nothing recomputed for it is stored.

:class:`PiecewiseRegion` is the same frame for a forward its caller runs in
pieces, with other code between them (a span over several blocks, in
:mod:`remat.modules.spans`): the hooks are pushed for each piece only, and the
recompute calls a ``replay`` that reruns the pieces and replays their state
itself. :class:`SavedInputs` keeps tensors the way a frame keeps its inputs.

Under :func:`remat.explain` (an observer in :mod:`remat.engine.observe`) a region's frame is
an :class:`_ObservedFrame`, which reports what it drops and when it recomputes; the
choice is made once per region, so a plain run does no per-tensor work for it.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes as _no_modes

from . import config, observe, torch_compat
from .errors import CheckpointError
from .state import ForwardState, generators_in
from .torch_compat import mark_internal, user_saved_tensors_hooks
from .tree import SLOT, has_nested, replace_tensors, tensors_in

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks

_modes_on = torch._C._len_torch_dispatch_stack
_no_python_dispatch = torch._C._DisableTorchDispatch
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_graph_task_id = torch._C._current_graph_task_id
_engine = torch.autograd.Variable._execution_engine
_outside_backward_ids = itertools.count(-2, -1)

_TIP = (
    "Pass debug=True to checkpoint (or wrap the code in "
    "remat.set_checkpoint_debug_enabled(True)) to see the operators run in forward and in "
    "recompute side by side. Common causes: code that depends on global state changed "
    "between forward and backward (a flag, a counter, a cache), or randomness outside "
    "torch's RNG."
)


#: After the side-by-side table of ``debug=True``: torch's sentence (code matches on it),
#: then remat's advice.
_DEBUG_TIP = (
    "You are seeing this error because you passed `debug=True` to checkpoint and tensors to be "
    "saved during the original forward differ from those saved during recomputation. Where "
    "the two lists above first differ is the operator that ran differently, with the source "
    "line that called it (when they do not differ, a saved value did). Make that code take "
    "the same path in recompute (read remat.is_recomputing() to skip side effects, keep "
    "flags and counters unchanged until backward, draw random numbers from torch's RNG)."
)


class _Holder:
    """What autograd keeps in place of a saved tensor: recomputed values by graph task."""

    __slots__ = ("recomputed", "__weakref__")

    def __init__(self) -> None:
        # by graph task id, or by GraphExecGroup
        self.recomputed: dict[Any, torch.Tensor] = {}


def _checksum(x: torch.Tensor) -> torch.Tensor:
    # Outside any dispatch mode: selective checkpointing must not see these ops.
    with torch.no_grad(), _no_modes():
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.is_floating_point():
            d = x.detach().double()
            return torch.stack((d.sum(), d.abs().sum()))
        return x.detach().long().sum().double().reshape(1)


def _describe(meta: tuple[Any, ...]) -> str:
    shape, dtype, device = meta[:3]
    return f"shape={tuple(shape)}, dtype={dtype}, device={device}"


@mark_internal
class _Frame:
    """One call of a checkpointed function: its inputs, state and holders.

    The frame itself is the pack hook of its forward (``frame(x)`` is
    :meth:`pack`), marked as checkpoint's own (:mod:`remat.engine.torch_compat`): torch
    2.14's selective mode inside the region looks past it to the user's hooks.
    """

    __slots__ = (
        "_user_hooks",
        "fn",
        "args",
        "kwargs",
        "nested",
        "inputs",
        "where",
        "state",
        "recompute_ctx",
        "early_stop",
        "check",
        "debug",
        "holders",
        "metas",
        "done",
        "forward_completed",
        "fwd_ops",
        "__weakref__",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        nested: bool,
        tensors: list[torch.Tensor],
        state: ForwardState | None,
        recompute_ctx: Any,
        check: str,
        early_stop: bool,
        debug: bool,
    ) -> None:
        self.fn = fn
        self.state = state
        self.recompute_ctx = recompute_ctx
        self.check = check
        self.early_stop = early_stop
        self.debug = debug
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[Any] = []
        self.done: set[Any] = set()
        self.forward_completed = False
        self.fwd_ops: list[tuple[str, str]] | None = None
        self._user_hooks: Any = None
        self.nested = nested
        self.kwargs = kwargs
        self.args: Any = args
        self.inputs: list[Any] = tensors
        self.where: list[int] | None = None
        # Keep the inputs through autograd's SavedTensor (see module docstring; on an
        # older torch, _KeptByHand) and drop the direct references from the argument
        # template. A tensor passed twice (attention's query, key and value) is kept once
        # and is again one object in recompute: code that tests identity (``query is key``)
        # takes the same path.
        kept = tensors
        if len(tensors) > 1 and len({id(t) for t in tensors}) < len(tensors):
            kept, self.where = _unique(tensors)
        self.inputs = [_keep_input(t, "remat.checkpoint") for t in kept]
        if nested:
            self.args = replace_tensors((args, kwargs), [SLOT] * len(tensors), [0])
            self.kwargs = {}
        else:
            self.args = tuple(SLOT if isinstance(a, torch.Tensor) else a for a in args)

    # -- forward hooks ---------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> _Holder:
        h = _Holder()
        self.holders.append(weakref.ref(h))
        check = self.check
        if check == "default":
            self.metas.append((x.shape, x.dtype, x.device))
        elif check == "values":
            self.metas.append((x.shape, x.dtype, x.device, _checksum(x)))
        return h

    __call__ = pack

    def unpack(self, h: _Holder) -> torch.Tensor:
        gid: Any = _graph_task_id()
        if gid in self.done:
            # This backward has recomputed the region already, outside any GraphExecGroup
            # (inside one, ``done`` holds the group): no group lookup for each tensor.
            x = h.recomputed.pop(gid, None)
            if x is not None:
                return x
        group = config.current_graph_exec_group()
        if group is not None:  # one recompute for every backward inside the group
            gid, outside = group, False
        else:
            outside = gid == -1
            if outside:  # a saved tensor read outside backward: recompute just for it
                gid = next(_outside_backward_ids)
        if gid not in self.done:
            self.recompute(gid)
            if group is None and not outside:
                # Tensors this backward never unpacks (a partial backward) are dropped
                # when it ends, not kept until the graph dies.
                _engine.queue_callback(_DropTask(self, gid))
        try:
            return h.recomputed.pop(gid)
        except KeyError:
            overlap = (
                # torch's words first (code matches on them), then what remat adds
                "Performing two backward calls that overlap (i.e. require the same saved "
                "activation in order to compute gradients) is not allowed while under the "
                "torch.utils.checkpoint.GraphExecGroup context: run them in separate "
                "GraphExecGroup blocks, or pass retain_graph=True and leave the group. "
                if group is not None
                else ""
            )
            raise CheckpointError(
                "remat.checkpoint: Unpack is being triggered for a tensor that was already "
                f"unpacked once (a saved tensor of a checkpointed region). {overlap}If a custom "
                "autograd.Function reads ctx.saved_tensors more than once in backward, read it "
                "once and keep the result."
            ) from None
        finally:
            if outside:
                self.drop(gid)

    def drop(self, gid: Any) -> None:
        """Forget what was recomputed for graph task ``gid`` and not used."""
        self.done.discard(gid)
        for ref in self.holders:
            h = ref()
            if h is not None and h.recomputed:
                h.recomputed.pop(gid, None)

    # -- recompute -------------------------------------------------------------------
    def input_values(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tensors = [_unpack_input(s, i) for i, s in enumerate(self.inputs)]
        if self.where is not None:
            tensors = [tensors[j] for j in self.where]
        if self.nested:
            args, kwargs = replace_tensors(self.args, tensors, [0])
            return args, kwargs
        it = iter(tensors)
        return tuple(next(it) if a is SLOT else a for a in self.args), self.kwargs

    def recompute(self, gid: Any) -> None:
        args, kwargs = self.input_values()
        rec = _RecomputeHook(self, gid)
        log = None
        ctx = self.recompute_ctx
        if ctx is not None and hasattr(ctx, "backward_builds_graph"):
            # autograd runs backward in grad mode exactly when it builds a graph
            # (create_graph=True): selective checkpointing then keeps what it serves
            ctx.backward_builds_graph = torch.is_grad_enabled()
        state = self.state  # None: the function replays the state itself (PiecewiseRegion)
        token = state.enter() if state is not None else None
        try:
            with _UnderHooks(rec, _identity, recompute=True), torch.enable_grad():
                if self.debug:
                    from .debug import OpLog

                    log = OpLog()
                    with log:
                        self._run_recompute(ctx, args, kwargs)
                else:
                    self._run_recompute(ctx, args, kwargs)
        except config.StopRecompute as stop:
            if stop.frame is not self:
                self.drop(gid)
                raise
        except BaseException:
            self.drop(gid)  # nothing half-recomputed stays behind a failed recompute
            raise
        finally:
            if state is not None and token is not None:
                state.exit(token)
        try:
            rec.finish(log)
        except BaseException:
            self.drop(gid)
            raise
        self.done.add(gid)

    def _run_recompute(self, ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if ctx is None:
            self.fn(*args, **kwargs)
        else:
            with ctx:
                self.fn(*args, **kwargs)

    def mismatch(self, message: str, log: Any) -> CheckpointError:
        text = f"remat.checkpoint: {message}\n{_TIP}"
        if log is not None and self.fwd_ops is not None:
            from .debug import report

            text = (
                f"remat.checkpoint: {message}\nOperators run in forward and in recompute:\n"
                + report(self.fwd_ops, log.ops)
                + f"\n{_DEBUG_TIP}"
            )
        return CheckpointError(text)


class _ObservedFrame(_Frame):
    """A frame under :func:`remat.explain`: tells the probe what it drops and when it recomputes.

    A subclass picked once per region, so that the frame of a run without an
    observer does no per-tensor work for it.
    """

    __slots__ = ("probe",)
    probe: observe.RegionProbe

    def pack(self, x: torch.Tensor) -> _Holder:
        self.probe.saw(x)
        return super().pack(x)

    __call__ = pack

    def recompute(self, gid: Any) -> None:
        self.probe.recompute_start()
        try:
            super().recompute(gid)
        finally:
            self.probe.recompute_end()


def _new_frame(probe: observe.RegionProbe | None, *args: Any) -> _Frame:
    """A frame, observed when ``probe`` is given (the inputs it keeps are reported as such)."""
    if probe is None:
        return _Frame(*args)
    try:
        frame = _ObservedFrame(*args)  # saves the inputs: the probe is told they are inputs
    finally:
        probe.inputs_kept()
    frame.probe = probe
    return frame


def _unique(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors (by object), and for each position the index of its tensor."""
    seen: dict[int, int] = {}
    unique: list[torch.Tensor] = []
    where = []
    for t in tensors:
        j = seen.get(id(t))
        if j is None:
            j = seen[id(t)] = len(unique)
            unique.append(t)
        where.append(j)
    return unique, where


def _identity(x: Any) -> Any:
    return x


class _UnderHooks:
    """Inside: a region's depth raised (:mod:`remat.engine.config`) and its saved-tensor hooks
    pushed; both undone on exit, exceptions included (a push refused by autograd too).

    ``pack`` is a frame or a recompute hook: while pushed it records the user's hooks
    under it (``_user_hooks``, read by :func:`remat.engine.torch_compat.user_saved_tensors_hooks`);
    they are forgotten on exit, so that the graph, which keeps the pack hook, does not keep
    the user's hooks alive.
    """

    __slots__ = ("pack", "unpack", "depth")

    def __init__(
        self, pack: _Frame | _RecomputeHook, unpack: Callable[[Any], Any], recompute: bool = False
    ) -> None:
        self.pack = pack
        self.unpack = unpack
        self.depth = config.RegionDepth(recompute)

    def __enter__(self) -> None:
        depth = self.depth
        depth.__enter__()
        pack = self.pack
        try:
            pack._user_hooks = user_saved_tensors_hooks()
            _push_hooks(pack, self.unpack)
        except BaseException:
            pack._user_hooks = None
            depth.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        _pop_hooks()
        self.pack._user_hooks = None
        self.depth.__exit__(None, None, None)


class _DropTask:
    """Final callback of a graph task: drops the frame's unused recomputed tensors.

    It holds the frame weakly: a frame whose graph nodes backward has already
    freed must die then, with the region's inputs, not at the end of backward.
    """

    __slots__ = ("frame", "gid")

    def __init__(self, frame: _Frame, gid: Any) -> None:
        self.frame = weakref.ref(frame)
        self.gid = gid

    def __call__(self) -> None:
        frame = self.frame()
        if frame is not None:
            frame.drop(self.gid)


@mark_internal
class _RecomputeHook:
    """Pack hook of a recompute (``hook(x)``): hands the i-th saved tensor to the i-th holder."""

    __slots__ = ("frame", "gid", "count", "bad", "quiet", "_user_hooks")

    def __init__(self, frame: _Frame, gid: Any) -> None:
        self._user_hooks: Any = None
        self.frame = frame
        self.gid = gid
        self.count = 0
        self.bad: list[tuple[int, Any, Any]] = []
        # detach saved tensors below the dispatch modes, unless a context_fn put its own
        # recompute context around the recompute (remat's selective one is not watching)
        ctx = frame.recompute_ctx
        self.quiet = ctx is None or getattr(ctx, "remat_internal", False)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        frame = self.frame
        i = self.count
        self.count = i + 1
        n = len(frame.holders)
        if x.requires_grad:
            if self.quiet and type(x) is torch.Tensor and _modes_on():
                # Not through the dispatch modes (selective checkpointing's, a memory
                # tracker's): a Python mode costs tens of microseconds an operator, and a
                # plain tensor's detach is the same without it (an alias: no memory to
                # count). A context_fn's own recompute context sees it, as under torch.
                with _no_python_dispatch():
                    x = x.detach()
            else:
                x = x.detach()
        if i >= n:
            if not frame.forward_completed or frame.debug:
                # Backward ran inside the forward itself: nothing to compare. Or debug:
                # run to the end so that finish() lists every operator of the recompute.
                return x
            raise frame.mismatch(
                "trying to save more tensors during recomputation than during the original "
                f"forward pass (forward: {n}).",
                None,
            )
        h = frame.holders[i]()
        if h is not None:
            h.recomputed[self.gid] = x
            check = frame.check
            if check != "none":
                want = frame.metas[i]
                if check == "default":
                    got: Any = (x.shape, x.dtype, x.device)
                    if got != want:
                        self.bad.append((i, want, got))
                else:
                    got = (x.shape, x.dtype, x.device, _checksum(x))
                    if got[:3] != want[:3] or not _sums_close(want[3], got[3]):
                        self.bad.append((i, want, got))
        if frame.early_stop and i + 1 == n:
            raise config.StopRecompute(frame)
        return x

    __call__ = pack

    def finish(self, log: Any) -> None:
        frame = self.frame
        n = len(frame.holders)
        if self.count != n and frame.forward_completed:
            raise frame.mismatch(
                "A different number of tensors was saved during the original forward and "
                f"recomputation (forward: {n}, recompute: {self.count}).",
                log,
            )
        if self.bad:
            lines = []
            for i, want, got in self.bad[:10]:
                line = f"  saved tensor #{i}: forward {_describe(want)}; recompute {_describe(got)}"
                if len(want) > 3:
                    line += f"; checksum forward {want[3].tolist()} vs recompute {got[3].tolist()}"
                lines.append(line)
            more = f"\n  ... and {len(self.bad) - 10} more" if len(self.bad) > 10 else ""
            # "values" catches value drift too; metadata differences are torch's wording
            kind = "values (checksums)" if frame.check == "values" else "metadata"
            raise frame.mismatch(
                f"Recomputed values for the following tensors have different {kind} than "
                f"during the forward pass ({len(self.bad)} of {n}):\n" + "\n".join(lines) + more,
                log,
            )


def _sums_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    with _no_modes():
        return _close(a, b)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if bool(torch.equal(a, b)):
        return True
    # Non-deterministic kernels (atomics on GPU) reorder sums: allow rounding noise.
    return bool(torch.allclose(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6))


def run_nonreentrant(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
    | None,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    state: ForwardState | None = None,
    respect_saved_tensors_hooks: bool | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as a non-reentrant checkpointed region.

    ``state``: the forward state to replay, when the caller has just recorded it
    (a span's block shares one with its own region); by default it is recorded here.
    ``respect_saved_tensors_hooks``: handed to a selective ``context_fn``'s forward mode
    (remat's, or torch's where torch has the option).
    """
    nested = bool(kwargs) or has_nested(args)
    tensors: list[torch.Tensor]
    if nested:
        tensors = []
        tensors_in((args, kwargs), tensors)
    else:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if state is None:
        generators: list[torch.Generator] = []
        if preserve_rng_state:
            if nested:
                generators_in((args, kwargs), generators)
            elif len(tensors) != len(args):  # flat: any generator is a top-level argument
                generators_in(args, generators)
        state = ForwardState(tensors, preserve_rng_state, generators)
    fwd_ctx: Any = None
    rec_ctx: Any = None
    if context_fn is not None:
        fwd_ctx, rec_ctx = _contexts(context_fn)
    if fwd_ctx is not None:
        if hasattr(fwd_ctx, "enclosing"):
            fwd_ctx.enclosing = enclosing_region()
        torch_compat.set_hooks_option(fwd_ctx, respect_saved_tensors_hooks)
    obs = observe.current()
    probe = None if obs is None else obs.region_start("checkpoint", fn)
    try:
        frame = _new_frame(
            probe,
            fn,
            args,
            kwargs,
            nested,
            tensors,
            state,
            rec_ctx,
            determinism_check,
            early_stop,
            debug,
        )
    except BaseException:
        if probe is not None:
            probe.forward_end()
        raise
    log = None
    if debug:
        from .debug import OpLog

        log = OpLog()
    try:
        with _UnderHooks(frame, frame.unpack):
            if fwd_ctx is None and log is None:
                out = fn(*args, **kwargs)
            else:
                out = _run_in(fwd_ctx, log, fn, args, kwargs)
    finally:
        if probe is not None:
            probe.forward_end()
    if log is not None:
        frame.fwd_ops = log.ops
    frame.forward_completed = True
    return out


def enclosing_region() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The saved-tensor hooks of the remat region the code runs in (its forward or its
    recompute), or ``None`` outside one (or under other hooks, such as ``save_on_cpu``).

    A selective region nested in another hands what its policy saves to these hooks, as
    every region hands them its inputs: the enclosing region then drops it in forward and
    brings it back with its own recompute (:class:`remat.engine.selective._Passed`).
    """
    hooks = _top_hooks(False)
    if hooks is not None and isinstance(hooks[0], (_Frame, _RecomputeHook)):
        return hooks[0], hooks[1]
    return None


def _contexts(context_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Call ``context_fn``; say what is wrong when it is not a context function."""
    try:
        contexts = context_fn()
    except TypeError as e:
        if _takes_arguments(context_fn):
            raise TypeError(
                f"remat.checkpoint: context_fn must be a function of no arguments returning two "
                f"context managers, got {_name(context_fn)}, which takes arguments (a "
                "selective-checkpointing policy?). Pass "
                "context_fn=functools.partial(remat.create_selective_checkpoint_contexts, "
                "policy), or use remat.checkpoint_wrapper(module, policy=policy)."
            ) from e
        raise
    if not isinstance(contexts, (tuple, list)) or len(contexts) != 2:
        raise TypeError(
            f"remat.checkpoint: context_fn must return two context managers (forward, "
            f"recompute), but {_name(context_fn)} returned {type(contexts).__name__} "
            f"{_short(contexts)}. Return a pair, as remat.create_selective_checkpoint_contexts "
            "does."
        )
    return contexts[0], contexts[1]


def _takes_arguments(fn: Any) -> bool:
    """Whether ``fn`` needs positional arguments (only asked on an error path)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in params
    )


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class SavedInputs:
    """Tensors kept for a recompute the way a region keeps its inputs.

    Each is kept through an autograd ``SavedTensor`` made under the saved-tensor
    hooks active when it is added (see the module docstring): an in-place change
    before backward raises, an enclosing region recomputes it instead of keeping
    it, and :func:`remat.offload` around :meth:`add` moves it to host memory.
    """

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: list[Any] = []

    def add(self, t: torch.Tensor) -> int:
        """Keep ``t``; return its index in :meth:`values`."""
        obs = observe.current()
        if obs is None:
            self.saved.append(_keep_input(t, "remat"))
        else:
            obs.keeping_input(True)
            try:
                self.saved.append(_keep_input(t, "remat"))
            finally:
                obs.keeping_input(False)
        return len(self.saved) - 1

    def values(self) -> list[torch.Tensor]:
        """The kept tensors (raises if one was changed in place since it was added)."""
        return [_unpack_input(s, i) for i, s in enumerate(self.saved)]


class _KeptByHand:
    """A region's input on a torch whose autograd cannot make a ``SavedTensor`` from Python.

    Kept as a ``SavedTensor`` would keep it: through the saved-tensor hooks active
    where it is kept (so :func:`remat.offload`, ``offload_to_cpu`` and
    ``torch.autograd.graph.save_on_cpu`` move it off the device, and an enclosing
    region recomputes it), or, with no hooks active, by reference with its version
    checked by hand when it is read (an in-place change after forward raises).
    """

    __slots__ = ("value", "unpack_hook", "version", "who", "requires_grad")

    def __init__(self, t: torch.Tensor, who: str) -> None:
        hooks: Any = _top_hooks(False)
        self.value: Any
        self.unpack_hook: Callable[[Any], torch.Tensor] | None
        self.who = who
        self.version = t._version
        self.requires_grad = t.requires_grad
        if hooks is None:
            self.value, self.unpack_hook = t, None
        else:
            pack, self.unpack_hook = hooks
            self.value = pack(t)

    def unpack(self, i: int) -> torch.Tensor:
        if self.unpack_hook is not None:
            v: torch.Tensor = self.unpack_hook(self.value)
            if self.requires_grad and not v.requires_grad:
                # as a SavedTensor restores it: the recompute's operators must see an input
                # that requires grad to save what the forward's saved (an enclosing
                # region's recompute hands its tensors back detached)
                v = v.detach().requires_grad_()
            return v
        t: torch.Tensor = self.value
        if t._version != self.version:
            # autograd's words for a SavedTensor changed in place (code and tests match on
            # them, as on a torch that makes the SavedTensor), then what remat adds
            raise RuntimeError(
                f"{self.who}: one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: input {i} of a checkpointed region (shape "
                f"{tuple(t.shape)}) is at version {t._version}; expected version "
                f"{self.version} instead. Its recompute would be wrong: clone the input "
                "before changing it."
            )
        return t


def _keep_input(t: torch.Tensor, who: str) -> Any:
    """``t`` kept for a recompute under the saved-tensor hooks active now."""
    make = torch_compat.make_saved_tensor
    if make is not None:
        return make(t, is_output=False)
    return _KeptByHand(t, who)


def _unpack_input(kept: Any, i: int) -> torch.Tensor:
    if isinstance(kept, _KeptByHand):
        return kept.unpack(i)
    return kept.unpack()  # type: ignore[no-any-return]


class PiecewiseRegion:
    """A non-reentrant region whose forward the caller runs in pieces, other code between.

    What autograd saves inside a :meth:`piece` is dropped and recomputed in
    backward by ``replay()``, with early stop, shape checks and
    recompute-per-backward as for :func:`checkpoint`. Nothing
    saved between pieces belongs to the region. ``replay`` must rerun every
    piece in order and put in place the state (RNG, autocast, buffers) each
    piece ran under: the region replays none itself. The inputs ``replay``
    needs are the caller's to keep (:class:`SavedInputs`, added between pieces).
    A span of blocks (:mod:`remat.modules.spans`) is one such region.
    """

    __slots__ = ("frame",)

    def __init__(
        self, replay: Callable[[], Any], *, determinism_check: str = "default", early_stop: bool
    ) -> None:
        obs = observe.current()
        probe = None if obs is None else obs.region_start("span", replay)
        self.frame = _new_frame(
            probe, replay, (), {}, False, [], None, None, determinism_check, early_stop, False
        )

    def piece(self) -> AbstractContextManager[None]:
        """Context manager: one piece of the forward runs inside."""
        return _UnderHooks(self.frame, self.frame.unpack)

    def complete(self) -> None:
        """Mark the forward finished: from now on a recompute must save what it saved."""
        self.frame.forward_completed = True
        if isinstance(self.frame, _ObservedFrame):
            self.frame.probe.forward_end()


_NOT_RUN = object()


def _run_in(fwd_ctx: Any, log: Any, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    out: Any = _NOT_RUN
    if fwd_ctx is not None:
        with fwd_ctx:
            if log is not None:
                with log:
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
    else:
        with log:
            out = fn(*args, **kwargs)
    if out is _NOT_RUN:
        raise RuntimeError(
            "remat.checkpoint: the forward context provided by context_fn suppressed an "
            "exception raised during the checkpointed forward; checkpoint cannot return a value "
            "for a failed forward. Make the context manager's __exit__ return False."
        )
    return out
