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

Side effects in recompute are guarded by :mod:`remat.engine.region`; the call forms of
torch's and fairscale's wrappers are mapped to remat's options by :mod:`remat.engine.forms`.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engine import config
from ..engine.checkpoint import checkpoint
from ..engine.forms import InSet, auto_wrap_targets, name_filter, wrapper_options
from ..engine.reentrant import run_reentrant
from ..engine.region import Region
from .blocks import default_blocks

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
        "respect_saved_tensors_hooks",
    )
)


@dataclasses.dataclass(frozen=True)
class _Options:
    policy: Any = None
    offload_to_cpu: bool = False
    preserve_rng_state: bool = True
    use_reentrant: bool = False
    context_fn: Any = None
    offload_only: bool = False  # offload_wrapper / the planner's "offload": no recompute
    checkpoint_fn: Any = None  # a custom checkpoint function (torch's wrapper's checkpoint_fn)
    fn_kwargs: tuple[tuple[str, Any], ...] = ()  # keyword arguments for the checkpoint function

    def describe(self) -> str:
        """The options that differ from the defaults, as the user would pass them."""
        if self.offload_only:
            return "offload_wrapper"
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in ("offload_only", "fn_kwargs") and getattr(self, f.name) != f.default
        ]
        parts += [f"{k}={v!r}" for k, v in self.fn_kwargs]
        return ", ".join(parts) or "default options"


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
            if opts.checkpoint_fn is not None:
                packed = _KeywordsAsPositional(forward, len(args), tuple(kwargs))
                return opts.checkpoint_fn(packed, *args, *kwargs.values(), **dict(opts.fn_kwargs))
            return checkpoint(
                forward,
                *args,
                use_reentrant=opts.use_reentrant,
                preserve_rng_state=opts.preserve_rng_state,
                **dict(opts.fn_kwargs),
                **kwargs,
            )
        if not torch.is_grad_enabled() or config.checkpointing_disabled():
            return forward(*args, **kwargs)
        if opts.offload_only:
            from ..engine.offload import offload

            with offload():
                return forward(*args, **kwargs)
        region = Region(module, forward, args, kwargs, copied=not opts.use_reentrant)
        context_fn = opts.context_fn
        if opts.policy is not None:
            from ..engine.selective import create_selective_checkpoint_contexts

            context_fn = functools.partial(create_selective_checkpoint_contexts, opts.policy)
        extra: dict[str, Any] = dict(opts.fn_kwargs) if opts.fn_kwargs else {}
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
            from ..engine.offload import offload

            if context_fn is not None and opts.checkpoint_fn is None:
                # offload_to_cpu moves the region's inputs: the wrapper's own hooks, which
                # what the policy saves stays out of unless asked (and without a warning)
                extra.setdefault("respect_saved_tensors_hooks", False)
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
        if opts.checkpoint_fn is not None:
            # torch's wrapper: checkpoint_fn(function, *args, **checkpoint_fn_kwargs); the
            # forward's keywords arrive positionally, which every checkpoint function takes.
            return opts.checkpoint_fn(fn, *args, **extra, **kwargs)
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
        if opts.checkpoint_fn is not None:
            fn = opts.checkpoint_fn
            tags.append(f"checkpoint_fn={getattr(fn, '__qualname__', type(fn).__name__)}")
        note = "[remat: " + ", ".join(tags) + "]"
        return f"{base}, {note}" if base else note

    def __reduce__(self) -> Any:
        return (_ExtraRepr, (self.ref(),))


def is_wrapped(module: nn.Module) -> bool:
    """True when ``module`` was wrapped by :func:`checkpoint_wrapper`."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def checkpoint_wrapper(
    module: nn.Module,
    offload_or_impl: Any = None,
    fn: Callable[..., Any] | None = None,
    /,
    *,
    policy: Any = None,
    offload_to_cpu: bool = False,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    context_fn: Any = None,
    checkpoint_impl: Any = None,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
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

    The call forms of fairscale's and torch's wrappers work too:
    ``checkpoint_wrapper(module, True)`` (fairscale's ``offload_to_cpu``),
    ``checkpoint_wrapper(module, CheckpointImpl.REENTRANT, fn)`` and the
    keywords ``checkpoint_impl=``, ``checkpoint_fn=`` and
    ``**checkpoint_fn_kwargs`` of torch's distributed wrapper, with torch's
    ``CheckpointImpl`` or :class:`remat.CheckpointImpl`.

    Args:
        module: the module to checkpoint (changed in place).
        offload_or_impl: positional only: fairscale's ``offload_to_cpu`` (a
            bool) or torch's ``checkpoint_impl``.
        fn: positional only, after ``checkpoint_impl``: torch's ``checkpoint_fn``
            (a bool there is older torch's ``offload_to_cpu``).
        policy: selective checkpointing: a :class:`CheckpointPolicy`-returning
            function or a list of ATen ops to save (see
            :func:`create_selective_checkpoint_contexts`).
        offload_to_cpu: also keep the region's inputs in host memory until backward.
        preserve_rng_state: as in :func:`checkpoint`.
        use_reentrant: as in :func:`checkpoint`; keyword arguments still work.
            ``None`` (not given) means ``False`` unless ``checkpoint_impl`` says
            ``REENTRANT``.
        context_fn: as in :func:`checkpoint` (not together with ``policy``).
        checkpoint_impl: torch's spelling of ``use_reentrant``:
            ``CheckpointImpl.REENTRANT`` or ``NO_REENTRANT``.
        checkpoint_fn: the checkpoint function to call, as in torch's wrapper:
            ``checkpoint_fn(function, *args, **checkpoint_fn_kwargs)``, the
            forward's keyword arguments passed positionally. torch's and
            remat's ``checkpoint`` (or a ``functools.partial`` of either) run
            remat's checkpoint with the partial's options; any other function
            gets the keywords given here (``preserve_rng_state`` only when
            ``False``) and replaces remat's engine.
        **checkpoint_fn_kwargs: options of :func:`checkpoint`
            (``determinism_check``, ``debug``, ``early_stop``,
            ``respect_saved_tensors_hooks``), or anything a custom
            ``checkpoint_fn`` takes. With ``offload_to_cpu=True`` and a policy,
            ``respect_saved_tensors_hooks`` is ``False`` unless given: the
            wrapper's own offload moves the region's inputs, not what the
            policy saves.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; an argument of the
            wrong kind, given twice, or a keyword remat's checkpoint does not take.
        ValueError: options that contradict each other (``policy`` with
            ``context_fn``, ``use_reentrant`` against ``checkpoint_impl``,
            ``policy``/``context_fn``/``debug`` with the reentrant variant), or
            other options for a module wrapped before.

    Example:
        >>> import torch, remat
        >>> block = torch.nn.Linear(8, 8)
        >>> remat.checkpoint_wrapper(block) is block
        True
        >>> block
        Linear(in_features=8, out_features=8, bias=True, [remat: checkpointed])
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> remat.checkpoint_wrapper(torch.nn.Linear(2, 2), True)  # fairscale's form
        Linear(in_features=2, out_features=2, bias=True, [remat: checkpointed, offload_to_cpu])
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
    if policy is not None and not (callable(policy) or isinstance(policy, (list, tuple))):
        raise TypeError(
            f"checkpoint_wrapper: policy must be a policy function or a list of ATen ops, got "
            f"{type(policy).__name__}."
        )
    if context_fn is not None and not callable(context_fn):
        raise TypeError(
            "checkpoint_wrapper: context_fn must be a function returning two context managers, "
            f"got {type(context_fn).__name__}; for selective checkpointing pass policy=... instead."
        )
    opts = _Options(
        **wrapper_options(
            offload_or_impl,
            fn,
            policy=policy,
            offload_to_cpu=offload_to_cpu,
            preserve_rng_state=preserve_rng_state,
            use_reentrant=use_reentrant,
            context_fn=context_fn,
            checkpoint_impl=checkpoint_impl,
            checkpoint_fn=checkpoint_fn,
            extra=checkpoint_fn_kwargs,
        )
    )
    if is_wrapped(module):
        now: _Options = getattr(module, _ATTR)
        if now == opts:
            return module
        raise ValueError(
            f"checkpoint_wrapper: {type(module).__name__} is already wrapped with other options "
            f"({now.describe()}; asked for {opts.describe()}); call remat.unwrap(module) first "
            "to change them."
        )
    object.__setattr__(module, _ATTR, opts)
    _install(module, module.__dict__.get("forward"))
    return module


def offload_wrapper(module: nn.Module) -> nn.Module:
    """Keep the tensors ``module`` saves for backward in host memory, in place; torch's name.

    Nothing is recomputed: every later call runs under :func:`remat.offload`
    (pinned host buffers, copies on a side stream, prefetched in backward; on
    CPU-only setups the tensors are kept as they are), so the module keeps its
    class, names and ``state_dict`` keys. Tensors smaller than 1 KiB stay where
    they are (torch's ``save_on_cpu`` moves them too). As with torch's
    wrappers, ``offload_wrapper`` on a module already checkpointed by
    :func:`checkpoint_wrapper` moves the checkpoint's inputs (all it keeps) to
    host memory, the same as ``offload_to_cpu=True``. :func:`unwrap` undoes it.

    Args:
        module: the module whose saved tensors to offload (changed in place).

    Returns:
        ``module`` itself.

    Example:
        >>> import torch, remat
        >>> lin = remat.offload_wrapper(torch.nn.Linear(4, 4))
        >>> lin
        Linear(in_features=4, out_features=4, bias=True, [remat: offloaded])
        >>> lin(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"offload_wrapper: module must be an nn.Module, got {type(module).__name__}."
        )
    if is_wrapped(module):
        opts: _Options = getattr(module, _ATTR)
        if not opts.offload_only and not opts.offload_to_cpu:
            object.__setattr__(module, _ATTR, dataclasses.replace(opts, offload_to_cpu=True))
        return module
    object.__setattr__(module, _ATTR, _Options(offload_only=True))
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


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] | None = None,
    check_fn: Callable[..., Any] | None = None,
    auto_wrap_policy: Any = None,
    *,
    every: int = 1,
    **wrapper_kwargs: Any,
) -> list[str]:
    """Wrap, in place, the submodules to checkpoint; return their names.

    The first three options are torch's (same order, so torch's calls work
    unchanged); the default is remat's: the model's repeated blocks.

    Args:
        model: the model (changed in place).
        checkpoint_wrapper_fn: what wraps each selected module, as in torch:
            :func:`checkpoint_wrapper` with ``**wrapper_kwargs`` by default;
            :func:`offload_wrapper`, a ``functools.partial`` of either, or
            torch's own wrappers (whose result replaces the module in its
            parent) work too.
        check_fn: ``check_fn(name, module)`` selects the submodules to wrap;
            torch's one-argument ``check_fn(module)`` works too (told apart by
            its number of required positional parameters). Default: the
            repeated blocks of every stack and stage of the model, the
            blocks :func:`remat.profile` plans (README: "Which blocks are
            planned"). Submodules of a selected
            module, or of one wrapped before (an earlier call), are not wrapped
            (torch wraps them as well, nesting checkpoints; the gradients are
            the same).
        auto_wrap_policy: torch's alternative to ``check_fn``: an FSDP-style
            policy ``policy(module, recurse, nonwrapped_numel)`` (for example
            ``functools.partial(transformer_auto_wrap_policy, ...)``) or a
            policy object such as ``ModuleWrapPolicy({Block})``; the modules it
            selects are wrapped (the outermost ones, as for ``check_fn``).
        every: wrap every ``every``-th selected module (the 1st, the
            ``every+1``-th, ...).
        **wrapper_kwargs: options of :func:`checkpoint_wrapper` (not with
            ``checkpoint_wrapper_fn``).

    Returns:
        The names of the wrapped submodules (torch's returns ``None``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or an option is not callable.
        ValueError: ``every`` < 1, ``check_fn`` together with
            ``auto_wrap_policy``, or ``checkpoint_wrapper_fn`` together with
            ``**wrapper_kwargs``.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> remat.apply_activation_checkpointing(model, every=2)
        ['0', '2']
        >>> other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> remat.apply_activation_checkpointing(  # torch's form
        ...     other, check_fn=lambda m: isinstance(m, torch.nn.Linear))
        ['0']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply_activation_checkpointing: model must be an nn.Module, got "
            f"{type(model).__name__}. Pass the model whose submodules to checkpoint "
            "(remat.checkpoint_wrapper wraps a single module)."
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"apply_activation_checkpointing: every must be an int >= 1, got {every!r}. "
            "Pass 2 to checkpoint every second block."
        )
    if checkpoint_wrapper_fn is not None:
        if not callable(checkpoint_wrapper_fn):
            raise TypeError(
                "apply_activation_checkpointing: checkpoint_wrapper_fn must be a function that "
                f"wraps a module, got {type(checkpoint_wrapper_fn).__name__}."
            )
        if wrapper_kwargs:
            raise ValueError(
                "apply_activation_checkpointing: pass the wrapper's options either in "
                "checkpoint_wrapper_fn (functools.partial(remat.checkpoint_wrapper, ...)) or as "
                f"keywords ({', '.join(wrapper_kwargs)}), not both."
            )
    if check_fn is not None and auto_wrap_policy is not None:
        raise ValueError(
            "apply_activation_checkpointing: pass check_fn or auto_wrap_policy, not both "
            "(torch would silently ignore check_fn)."
        )
    select: Callable[[str, nn.Module], Any] | None = None
    if auto_wrap_policy is not None:
        select = InSet(auto_wrap_targets(model, auto_wrap_policy))
    elif check_fn is not None:
        select = name_filter(check_fn)
    if select is None:
        names = default_blocks(model)
    else:
        names = []
        inside: list[str] = []  # selected or already wrapped: their submodules are skipped
        for name, m in model.named_modules():
            if not name or any(name.startswith(p + ".") for p in inside):
                continue
            if select(name, m):
                names.append(name)
                inside.append(name)
            elif is_wrapped(m):  # wrapped by an earlier call
                inside.append(name)
    chosen = names[::every]
    for name in chosen:
        module = model.get_submodule(name)
        if checkpoint_wrapper_fn is None:
            checkpoint_wrapper(module, **wrapper_kwargs)
            continue
        wrapped = checkpoint_wrapper_fn(module)
        if wrapped is not module:  # torch's wrappers return a new module: put it in place
            if not isinstance(wrapped, nn.Module):
                raise TypeError(
                    "apply_activation_checkpointing: checkpoint_wrapper_fn must return an "
                    f"nn.Module, got {type(wrapped).__name__} for {name!r}."
                )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, wrapped)
    return chosen


# What the planner needs to put decisions on modules and take them off again.
WRAP_KEYS = ("forward", "extra_repr", "_replicate_for_data_parallel", _ATTR)


def offload_only(module: nn.Module) -> nn.Module:
    """Keep ``module``'s saved tensors in host memory, recompute nothing (the planner's
    ``offload`` decision); returns the module. Unlike :func:`offload_wrapper` on a
    checkpointed module, a wrapping already there is replaced. Undo with :func:`unwrap`."""
    unwrap(module)
    return offload_wrapper(module)


def wrapping_state(module: nn.Module) -> dict[str, Any]:
    """The instance attributes that hold ``module``'s wrapping, for :func:`set_wrapping_state`."""
    return {k: module.__dict__[k] for k in WRAP_KEYS if k in module.__dict__}


def set_wrapping_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Put back a wrapping recorded by :func:`wrapping_state` (none when it was empty)."""
    for k in WRAP_KEYS:
        module.__dict__.pop(k, None)
    module.__dict__.update(state)


def guarded_forward(
    module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """``forward`` of ``module`` with the wrapper's side-effect guards, for one call.

    Made when the forward starts (it records buffers, train flags and Python
    arguments then); called again in recompute it runs with the buffers and
    flags the forward started with (see the module docstring). Used by
    :mod:`remat.modules.spans` for the blocks of a span.
    """
    return Region(module, forward, args, kwargs)
