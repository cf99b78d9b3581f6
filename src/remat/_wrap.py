"""Module-level checkpointing that keeps the module: ``checkpoint_wrapper`` and friends.

How the module stays the same object
------------------------------------
``checkpoint_wrapper(module)`` sets an instance attribute ``forward`` (a
:class:`_CheckpointedForward`) that shadows the class's ``forward``. The class,
``isinstance``, parameter, buffer and ``state_dict`` names and the parents'
names do not change. ``nn.Module.__call__`` still runs the module's hooks
once around the call; the checkpoint runs (and recomputes) the class's
``forward`` itself, so no hook runs again in recompute. The instance
attribute holds the module only through a weak reference, so wrapping adds
no reference cycle, and it pickles and deep-copies by pointing at the copy.

Side effects in recompute
-------------------------
* Buffers (BatchNorm's running statistics, step counters, any buffer the
  forward changes in place) are cloned when the forward starts. The
  recompute runs with those values and the buffers are then put back as the
  forward left them, so after a step every buffer equals the unchecked
  model's and a forward that reads its own buffers recomputes bitwise. This
  holds by name too: a forward that assigns a new tensor to a buffer
  (``self.step = self.step + 1``) recomputes with the buffer it started with.
* Train/eval flags are recorded when the forward starts and put in place for
  the recompute, so ``model.eval()`` between forward and backward changes
  nothing (BatchNorm, dropout). Other Python attributes the forward reads are
  not recorded: change them only after backward, or the recompute differs
  (a :class:`CheckpointError` when shapes change, else other gradients).
* Python objects passed in (a KV cache, lists, dicts, objects) are
  fingerprinted (their type, length and tensor shapes, a few levels deep)
  when the forward starts and again around the recompute. If the recompute
  changes one (a cache append done a second time), a :class:`CheckpointError`
  names the module and the argument, because the side effect happened twice.
  If the recompute fails while an argument differs from what the forward
  started with (the forward appended to a cache it then reads), the error is
  a :class:`CheckpointError` that says so, chained to the original one.
  Arguments changed by the caller after the forward, or by a forward that
  guards its side effect with ``if not remat.is_recomputing():``, are fine.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes as _no_modes

from . import _config
from ._checkpoint import checkpoint
from ._errors import CheckpointError
from ._reentrant import run_reentrant

_ATTR = "_remat_checkpoint"  # the config, kept on the module (picklable)
# Keywords that checkpoint() takes for itself (a forward's keyword must not reach it).
_CHECKPOINT_KEYWORDS = frozenset(
    (
        "function",
        "use_reentrant",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
    )
)


@dataclasses.dataclass(frozen=True)
class _Options:
    policy: Any = None
    offload_to_cpu: bool = False
    preserve_rng_state: bool = True
    use_reentrant: bool = False
    context_fn: Any = None
    offload_only: bool = False  # the planner's "offload" decision: no recompute


def _fingerprint(obj: Any, depth: int = 0) -> Any:
    """Type, length and tensor shapes of a container, a few levels deep."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape))
    if depth >= 4 or obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return None
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, len(obj), tuple(_fingerprint(v, depth + 1) for v in obj[:32]))
    if isinstance(obj, dict):
        items = list(obj.items())[:32]
        return ("dict", len(obj), tuple((str(k), _fingerprint(v, depth + 1)) for k, v in items))
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(obj, nn.Module):
        items = list(attrs.items())[:32]
        return (type(obj).__name__, tuple((k, _fingerprint(v, depth + 1)) for k, v in items))
    return None


class _Watched:
    """Python arguments that hold tensors, with their forward-time fingerprints."""

    __slots__ = ("items",)

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.items: list[tuple[str, Any, Any]] = []
        for i, a in enumerate(args):
            self._add(f"argument {i}", a)
        for k, v in kwargs.items():
            self._add(f"argument '{k}'", v)

    def _add(self, label: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            return
        fp = _fingerprint(obj)
        if fp is not None:  # a container or an object: it may gain tensors (an empty cache)
            self.items.append((label, obj, fp))

    def now(self) -> list[Any]:
        return [_fingerprint(obj) for _, obj, _ in self.items]

    def differing(self, fps: list[Any]) -> list[str]:
        """The arguments whose fingerprint now differs from ``fps``."""
        return [
            f"{label} ({type(obj).__name__})"
            for (label, obj, _), fp in zip(self.items, fps)
            if _fingerprint(obj) != fp
        ]

    def at_forward_start(self) -> list[Any]:
        return [fp for _, _, fp in self.items]


_CACHE_TIP = (
    "Pass use_cache=False while training with checkpointing, or guard the side effect with "
    "`if not remat.is_recomputing():`."
)


class _Region:
    """What one wrapped call runs: the class's forward with the side-effect guards."""

    __slots__ = ("module", "forward", "snapshot", "modes", "watched")

    def __init__(
        self, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        self.module = module
        self.forward = forward
        # Buffers by owner and name, with the tensor and a copy of its value: a forward
        # may change a buffer in place (BatchNorm) or assign a new tensor to its name
        # (``self.step = self.step + 1``); the recompute must see the buffer as it was.
        self.snapshot: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] | None = None
        # Train/eval flags: ``model.eval()`` between forward and backward must not
        # change what the recompute computes (BatchNorm, dropout).
        self.modes: list[tuple[nn.Module, bool]] = []
        snapshot = []
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for m in module.modules():
                self.modes.append((m, m.training))
                for name, b in m._buffers.items():
                    if b is not None:
                        value = copies.get(id(b))
                        if value is None:
                            value = copies[id(b)] = b.detach().clone()
                        snapshot.append((m, name, b, value))
        if snapshot:
            self.snapshot = snapshot
        self.watched = _Watched(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _config.is_recomputing():
            return self.forward(*args, **kwargs)
        watched = self.watched
        if not watched.items:
            return self._recompute(args, kwargs)
        before = watched.now()
        name = type(self.module).__name__
        try:
            out = self._recompute(args, kwargs)
        except BaseException as exc:
            again = watched.differing(before)
            if again:
                raise self._again(name, again) from exc
            since = watched.differing(watched.at_forward_start())
            if since and isinstance(exc, Exception) and not _is_stop(exc):
                raise CheckpointError(
                    f"remat.checkpoint_wrapper: {name}'s recompute failed while "
                    f"{', '.join(since)} differed from what its forward started with: the "
                    "forward changed it (for example a KV cache append) and the recompute read "
                    f"the changed value. {_CACHE_TIP}"
                ) from exc
            raise
        again = watched.differing(before)
        if again:
            raise self._again(name, again)
        return out

    @staticmethod
    def _again(name: str, changed: list[str]) -> CheckpointError:
        return CheckpointError(
            f"remat.checkpoint_wrapper: {name}'s recompute changed {', '.join(changed)} again "
            "after its forward had changed it: a side effect of the forward (for example a KV "
            f"cache append) ran twice. {_CACHE_TIP}"
        )

    def _recompute(self, args: Any, kwargs: Any) -> Any:
        modes_now = [(m, m.training) for m, _ in self.modes]
        changed_modes = any(was != now for (_, was), (_, now) in zip(self.modes, modes_now))
        if self.snapshot is None and not changed_modes:
            return self.forward(*args, **kwargs)
        # Outside any dispatch mode: selective checkpointing must not see these copies.
        # Through .data: putting a value back must not bump the version counter, or the
        # recompute's own saved buffers (batch_norm saves running stats) would look modified.
        after: list[tuple[nn.Module, str, Any]] = []
        values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad(), _no_modes():
            for m, name, _, _ in self.snapshot or ():
                if name not in m._buffers:
                    continue  # the forward deleted it: leave it deleted
                now = m._buffers[name]
                after.append((m, name, now))
                if now is not None and id(now) not in values:
                    values[id(now)] = (now, now.detach().clone())
            for m, name, b, before in self.snapshot or ():
                if name in m._buffers:
                    m._buffers[name] = b
                    b.data.copy_(before)
            if changed_modes:
                for m, mode in self.modes:
                    m.training = mode
        try:
            return self.forward(*args, **kwargs)
        finally:
            with torch.no_grad(), _no_modes():
                for m, name, now in after:
                    m._buffers[name] = now
                for now, value in values.values():
                    now.data.copy_(value)
                if changed_modes:
                    for m, mode in modes_now:
                        m.training = mode


def _is_stop(exc: BaseException) -> bool:
    """The engine's own early-stop signal, which is not a failure."""
    from ._nonreentrant import _StopRecompute

    return isinstance(exc, _StopRecompute)


class _KeywordsAsPositional:
    """Calls a forward that takes keywords with positional arguments only."""

    __slots__ = ("fn", "n", "keys")

    def __init__(self, fn: Callable[..., Any], n: int, keys: tuple[str, ...]) -> None:
        self.fn = fn
        self.n = n
        self.keys = keys

    def __call__(self, *flat: Any) -> Any:
        return self.fn(*flat[: self.n], **dict(zip(self.keys, flat[self.n :])))


class _CheckpointedForward:
    """The instance-level ``forward`` of a wrapped module (holds it weakly)."""

    __slots__ = ("ref", "inner", "__weakref__")

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.ref = weakref.ref(module)
        self.inner = inner  # an instance-level forward that was there before, if any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        if module is None:
            raise RuntimeError("remat.checkpoint_wrapper: the wrapped module no longer exists.")
        forward = (
            self.inner
            if self.inner is not None
            else functools.partial(type(module).forward, module)
        )
        opts: _Options = getattr(module, _ATTR)
        if torch.compiler.is_compiling():
            # torch's traced checkpoint; the eager side-effect guards are not traced
            clash = _CHECKPOINT_KEYWORDS.intersection(kwargs)
            if clash:  # the forward's own keywords named like checkpoint's options
                forward = functools.partial(forward, **{k: kwargs[k] for k in clash})
                kwargs = {k: v for k, v in kwargs.items() if k not in clash}
            return checkpoint(
                forward,
                *args,
                use_reentrant=opts.use_reentrant,
                preserve_rng_state=opts.preserve_rng_state,
                **kwargs,
            )
        if not torch.is_grad_enabled() or _config._disabled.get():
            return forward(*args, **kwargs)
        if opts.offload_only:
            from ._offload import offload

            with offload():
                return forward(*args, **kwargs)
        region = _Region(module, forward, args, kwargs)
        context_fn = opts.context_fn
        if opts.policy is not None:
            from ._selective import create_selective_checkpoint_contexts

            context_fn = functools.partial(create_selective_checkpoint_contexts, opts.policy)
        extra: dict[str, Any] = {}
        if context_fn is not None:
            extra["context_fn"] = context_fn
        fn: Callable[..., Any] = region
        call_args: tuple[Any, ...] = args
        call_kwargs = kwargs
        if kwargs:
            # Positional for checkpoint: the reentrant variant takes no keywords, and a
            # forward's own keyword named like an option of checkpoint (debug,
            # early_stop, context_fn, ...) must reach the forward, not checkpoint.
            fn = _KeywordsAsPositional(region, len(args), tuple(kwargs))
            call_args = (*args, *kwargs.values())
            call_kwargs = {}
        if opts.offload_to_cpu:
            from ._offload import offload

            with offload(min_bytes=0):
                return self._run(module, opts, fn, call_args, call_kwargs, extra)
        return self._run(module, opts, fn, call_args, call_kwargs, extra)

    @staticmethod
    def _run(
        module: nn.Module,
        opts: _Options,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extra: dict[str, Any],
    ) -> Any:
        if opts.use_reentrant:
            # The module's parameters are known: hand them to the reentrant region so their
            # gradients flow through the outer graph (DDP sees each one once).
            return run_reentrant(
                fn,
                args,
                preserve_rng_state=opts.preserve_rng_state,
                params=tuple(module.parameters()),
            )
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            preserve_rng_state=opts.preserve_rng_state,
            **extra,
            **kwargs,
        )

    def __reduce__(self) -> Any:
        # Pickle/deepcopy: point at the copy of the module (pickle memoizes it first).
        return (_rebuild_forward, (self.ref(), self.inner))


def _rebuild_forward(module: nn.Module, inner: Any) -> _CheckpointedForward:
    return _CheckpointedForward(module, inner)


class _ExtraRepr:
    """Instance-level ``extra_repr`` that adds the checkpointing options."""

    __slots__ = ("ref", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def __call__(self) -> str:
        module = self.ref()
        if module is None:
            return ""
        base = type(module).extra_repr(module)
        opts: _Options = getattr(module, _ATTR)
        tags = ["offloaded"] if opts.offload_only else ["checkpointed"]
        if opts.policy is not None:
            tags.append("selective")
        if opts.offload_to_cpu:
            tags.append("offload_to_cpu")
        if opts.use_reentrant:
            tags.append("reentrant")
        note = "[remat: " + ", ".join(tags) + "]"
        return f"{base}, {note}" if base else note

    def __reduce__(self) -> Any:
        return (_ExtraRepr, (self.ref(),))


def is_wrapped(module: nn.Module) -> bool:
    """True when ``module`` was wrapped by :func:`checkpoint_wrapper`."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def checkpoint_wrapper(
    module: nn.Module,
    *,
    policy: Any = None,
    offload_to_cpu: bool = False,
    preserve_rng_state: bool = True,
    use_reentrant: bool = False,
    context_fn: Any = None,
) -> nn.Module:
    """Checkpoint every later call of ``module``, in place; returns the same module.

    The module keeps its class, names, ``state_dict`` keys and hooks (they run
    once per call). Any positional and keyword arguments and any outputs work.
    Under ``no_grad`` or :func:`disable_checkpointing` it is the plain module.
    Buffers changed by the forward (BatchNorm statistics) are updated once per
    step; a Python argument changed by the forward (a cache append) raises a
    clear :class:`CheckpointError` in backward instead of recomputing wrongly.
    Wrapping again with the same options does nothing; with other options it
    raises (call :func:`unwrap` first).

    Args:
        module: the module to checkpoint (changed in place).
        policy: selective checkpointing: a :class:`CheckpointPolicy`-returning
            function or a list of ATen ops to save (see
            :func:`create_selective_checkpoint_contexts`).
        offload_to_cpu: also keep the region's inputs in host memory until backward.
        preserve_rng_state: as in :func:`checkpoint`.
        use_reentrant: as in :func:`checkpoint`; keyword arguments still work.
        context_fn: as in :func:`checkpoint` (not together with ``policy``).

    Returns:
        ``module`` itself.

    Example:
        >>> import torch, remat
        >>> block = torch.nn.Linear(8, 8)
        >>> remat.checkpoint_wrapper(block) is block
        True
        >>> block
        Linear(in_features=8, out_features=8, bias=True, [remat: checkpointed])
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"checkpoint_wrapper: module must be an nn.Module, got {type(module).__name__}."
        )
    if policy is not None and context_fn is not None:
        raise ValueError(
            "checkpoint_wrapper: pass either policy (selective checkpointing) or context_fn, not "
            "both; a policy is turned into a context_fn by remat."
        )
    if use_reentrant and (policy is not None or context_fn is not None):
        raise ValueError(
            "checkpoint_wrapper: policy and context_fn need use_reentrant=False (selective "
            "checkpointing runs on the saved-tensor hooks of the non-reentrant variant)."
        )
    if policy is not None and not (callable(policy) or isinstance(policy, (list, tuple))):
        raise TypeError(
            f"checkpoint_wrapper: policy must be a policy function or a list of ATen ops, got "
            f"{type(policy).__name__}."
        )
    opts = _Options(
        policy, bool(offload_to_cpu), bool(preserve_rng_state), bool(use_reentrant), context_fn
    )
    if is_wrapped(module):
        if getattr(module, _ATTR) == opts:
            return module
        raise ValueError(
            f"checkpoint_wrapper: {type(module).__name__} is already wrapped with other options "
            f"({getattr(module, _ATTR)}); call remat.unwrap(module) first to change them."
        )
    object.__setattr__(module, _ATTR, opts)
    _install(module, module.__dict__.get("forward"))
    return module


def _install(module: nn.Module, inner: Callable[..., Any] | None) -> None:
    """Put the instance-level attributes of a wrapped module in place (options set before)."""
    module.__dict__["forward"] = _CheckpointedForward(module, inner)
    module.__dict__["extra_repr"] = _ExtraRepr(module)
    module.__dict__["_replicate_for_data_parallel"] = _Replicate(module)


class _Replicate:
    """Instance-level ``_replicate_for_data_parallel`` (``nn.DataParallel``).

    A replica starts as a shallow copy of the module's ``__dict__``: without
    this, it would share the original's checkpointed forward, which runs the
    original module with the original's parameters.
    """

    __slots__ = ("ref", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def __call__(self) -> nn.Module:
        module = self.ref()
        if module is None:
            raise ReferenceError(
                "remat.checkpoint_wrapper: the module this replicate hook belongs to is gone; "
                "replicate the module itself (nn.DataParallel(module)), not a stale copy of it."
            )
        replica = type(module)._replicate_for_data_parallel(module)
        fwd = replica.__dict__.get("forward")
        _install(replica, fwd.inner if isinstance(fwd, _CheckpointedForward) else None)
        return replica

    def __reduce__(self) -> Any:
        return (_Replicate, (self.ref(),))


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint_wrapper` on ``module`` (no-op when not wrapped); returns it.

    Example:
        >>> import torch, remat
        >>> lin = remat.checkpoint_wrapper(torch.nn.Linear(2, 2))
        >>> remat.unwrap(lin)
        Linear(in_features=2, out_features=2, bias=True)
    """
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, _CheckpointedForward):
        if fwd.inner is not None:
            module.__dict__["forward"] = fwd.inner
        else:
            del module.__dict__["forward"]
        module.__dict__.pop("extra_repr", None)
        module.__dict__.pop("_replicate_for_data_parallel", None)
        module.__dict__.pop(_ATTR, None)
    return module


def _default_blocks(model: nn.Module) -> list[str]:
    """Names of the children of the model's largest ModuleList/Sequential."""
    best: tuple[int, str] | None = None
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0:
            if best is None or len(m) > best[0]:
                best = (len(m), name)
    if best is None:
        return []
    prefix = best[1] + "." if best[1] else ""
    container = model.get_submodule(best[1]) if best[1] else model
    return [prefix + child for child, _ in container.named_children()]


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    every: int = 1,
    **wrapper_kwargs: Any,
) -> list[str]:
    """Wrap, in place, the submodules to checkpoint; return their names.

    Args:
        model: the model (changed in place).
        check_fn: ``check_fn(name, module)`` selects the submodules to wrap;
            default: the children of the model's largest ``nn.ModuleList`` /
            ``nn.Sequential`` (its repeated blocks). Submodules of a selected
            module, or of one wrapped before (an earlier call), are not wrapped.
        every: wrap every ``every``-th selected module (the 1st, the
            ``every+1``-th, ...).
        **wrapper_kwargs: options of :func:`checkpoint_wrapper`.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> remat.apply_activation_checkpointing(model, every=2)
        ['0', '2']
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"apply_activation_checkpointing: every must be an int >= 1, got {every!r}. "
            "Pass 2 to checkpoint every second block."
        )
    if check_fn is None:
        names = _default_blocks(model)
    else:
        names = []
        inside: list[str] = []  # selected or already wrapped: their submodules are skipped
        for name, m in model.named_modules():
            if not name or any(name.startswith(p + ".") for p in inside):
                continue
            if check_fn(name, m):
                names.append(name)
                inside.append(name)
            elif is_wrapped(m):  # wrapped by an earlier call
                inside.append(name)
    chosen = names[::every]
    for name in chosen:
        checkpoint_wrapper(model.get_submodule(name), **wrapper_kwargs)
    return chosen


def guarded_forward(
    module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """``forward`` of ``module`` with the wrapper's side-effect guards, for one call.

    Made when the forward starts (it records buffers, train flags and Python
    arguments then); called again in recompute it runs with the buffers and
    flags the forward started with (see the module docstring). Used by
    :mod:`remat._spans` for the blocks of a span.
    """
    return _Region(module, forward, args, kwargs)
