"""``checkpoint()``: argument checks and dispatch to a variant; its curried form.

``checkpoint(function, *args, **options)`` runs the function checkpointed;
``checkpoint(**options)`` (no function, as in torch 2.14) returns a decorator that
makes ``function`` a :class:`CheckpointedFunction`, which runs it checkpointed on each
call with those options, and binds to an instance when it decorates a method.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, ParamSpec, TypeVar, overload

import torch
import torch.utils.checkpoint as _tuc

from . import config
from .nonreentrant import run_nonreentrant
from .reentrant import run_reentrant

_CHECKS = ("default", "none", "values")
_T = TypeVar("_T")
_P = ParamSpec("_P")
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


_torch_noop = _tuc.noop_context_fn


def noop_context_fn() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The default ``context_fn``: two null contexts (forward, recompute).

    Example:
        >>> import remat
        >>> fwd, rec = remat.noop_context_fn()
        >>> with fwd, rec:
        ...     pass
    """
    return contextlib.nullcontext(), contextlib.nullcontext()


@overload
def checkpoint(
    function: Callable[..., _T],
    *args: Any,
    use_reentrant: bool | None = False,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = ...,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> _T: ...


@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = False,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = ...,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = False,
    preserve_rng_state: bool = True,
    context_fn: ContextFn = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint``: the activations the
    function would save for backward are dropped and recomputed when backward
    needs them, under the forward's RNG and autocast state, so gradients are
    those of the plain call. Only the inputs are kept.

    Without a function (``checkpoint(use_reentrant=False)``, torch 2.14's curried
    form, on every supported torch) it returns a decorator: ``checkpoint(**options)(fn)``
    is ``fn`` run checkpointed with those options on each call, keeping ``fn``'s name
    and docstring (``functools.wraps``); on a method it binds to the instance, so
    ``@remat.checkpoint(use_reentrant=False)`` can decorate a module's ``forward``.
    The options are checked when the decorator is made.

    Args:
        function: the callable to checkpoint; omitted (or ``None`` with no
            ``args``) for the curried form.
        *args: its positional arguments; tensors may sit in lists, tuples,
            dicts and dataclasses (non-reentrant variant). The recompute gets
            those containers rebuilt as they were when the forward started
            (a list the caller appends to afterwards is replayed without the
            append); other objects are passed as they are, by reference.
        use_reentrant: ``False`` (default, no warning; ``None`` means the
            same) for the saved-tensor-hooks variant that supports nesting,
            ``torch.autograd.grad``, ``backward(inputs=...)``, double
            backward and keyword arguments; ``True`` for the
            ``autograd.Function`` variant with torch's restrictions, except
            that parameters inside get gradients even when no input requires
            grad.
        preserve_rng_state: replay the CPU RNG and the RNG of the device
            holding the tensor arguments in recompute (CUDA first when
            arguments are on several device types, else the first found).
        context_fn: returns two context managers; the forward runs in the
            first, the recompute in the second (selective checkpointing uses
            this). Non-reentrant only.
        determinism_check: ``"default"`` compares shape, dtype and device of
            every recomputed tensor with the forward's; ``"values"`` also
            compares a checksum of its values (costs one reduction per saved
            tensor in forward); ``"none"`` skips the check. Non-reentrant only.
        debug: on a mismatch, list the operators run in forward and in
            recompute side by side, first divergence marked, each with the
            source line that called it. Non-reentrant only.
        early_stop: stop recomputing once every needed tensor is recomputed;
            overridden by :func:`set_checkpoint_early_stop`.
        respect_saved_tensors_hooks: whether what selective checkpointing
            saves (a ``context_fn`` of :func:`create_selective_checkpoint_contexts`)
            goes through the saved-tensor hooks active around the call
            (``torch.autograd.graph.save_on_cpu``, :func:`remat.offload`, your own
            ``saved_tensors_hooks``), as every other saved tensor does. ``None``
            (default, as torch 2.14): it does not, and the first output the policy
            saves under such hooks warns with a ``FutureWarning`` (torch's words: a
            future torch will route them); ``True``: it does (under ``save_on_cpu``
            the saved outputs wait for backward in host memory); ``False``: it does
            not, silently. Inside an enclosing remat region (a nested checkpoint, a
            span) saved outputs go to that region whatever this says. No effect
            without a selective policy. Non-reentrant only. With the contexts of
            torch's own ``create_selective_checkpoint_contexts``, ``True`` needs
            torch >= 2.14.
        **kwargs: keyword arguments of ``function`` (non-reentrant only).

    Returns:
        Whatever ``function`` returns; without a function, a decorator.

    Raises:
        TypeError: when ``function`` is not callable, ``use_reentrant`` or
            ``respect_saved_tensors_hooks`` is not a bool or ``None``, or
            ``context_fn`` is not a context function (a policy passed by mistake
            is named as such).
        ValueError: for options the chosen variant does not take, an unknown
            ``determinism_check``, keyword arguments in the curried form (they
            belong to the decorated function's calls), or
            ``respect_saved_tensors_hooks=True`` with torch's selective contexts
            on a torch before 2.14.
        CheckpointError: in backward, when recompute does not reproduce the forward.

    Under ``torch.no_grad()``, ``torch.inference_mode()`` or
    :func:`disable_checkpointing` the function is simply called. Inside
    ``torch.compile`` the call is handed to torch's own checkpoint, which
    the compiler traces without a graph break (``"values"`` then acts as
    ``"default"``).

    Example:
        >>> import torch, remat
        >>> layer = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: layer(t).relu(), x)
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])

        The curried form, as a decorator:

        >>> @remat.checkpoint(use_reentrant=False, preserve_rng_state=False)
        ... def block(t):
        ...     return layer(t).relu()
        >>> block(x).sum().backward()
        >>> block.__name__
        'block'
    """
    if function is None and not args:
        return _decorator(
            kwargs,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve_rng_state,
            context_fn=context_fn,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks,
        )
    use_reentrant = _reentrant_flag(use_reentrant)
    if not callable(function):
        raise _not_callable(function)
    if context_fn is not noop_context_fn:
        context_fn = _context_function(context_fn)
    if respect_saved_tensors_hooks is not None:
        _check_hooks_option(respect_saved_tensors_hooks)
    if torch.compiler.is_compiling():
        return _compiled(
            function,
            args,
            kwargs,
            use_reentrant,
            preserve_rng_state,
            context_fn,
            determinism_check,
            debug,
            early_stop,
        )
    if use_reentrant:
        if kwargs:
            raise ValueError(
                "Unexpected keyword arguments: "
                + ",".join(kwargs)
                + ". remat.checkpoint with use_reentrant=True passes only positional arguments "
                "to the function; pass use_reentrant=False to use keyword arguments."
            )
        _check_reentrant_options(context_fn, debug, respect_saved_tensors_hooks)
    if determinism_check not in _CHECKS:
        raise _bad_check(determinism_check)
    if not torch.is_grad_enabled() or config.checkpointing_disabled():
        return function(*args, **kwargs)
    if use_reentrant:
        return run_reentrant(function, args, preserve_rng_state=preserve_rng_state)
    dbg = config.debug_override()
    stop = config.early_stop_override()
    return run_nonreentrant(
        function,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=None if context_fn is noop_context_fn else context_fn,
        determinism_check=determinism_check,
        debug=debug if dbg is None else dbg,
        early_stop=early_stop if stop is None else stop,
        respect_saved_tensors_hooks=respect_saved_tensors_hooks,
    )


def _reentrant_flag(use_reentrant: Any) -> bool:
    if use_reentrant is None:
        return False
    if use_reentrant is not True and use_reentrant is not False:
        raise TypeError(
            f"remat.checkpoint: use_reentrant must be True, False or None, got {use_reentrant!r}. "
            "Pass use_reentrant=False (the default) or True for the reentrant variant."
        )
    return bool(use_reentrant)


def _context_function(context_fn: Any) -> ContextFn:
    if context_fn is _torch_noop:  # torch's default passed explicitly: the same as ours
        return noop_context_fn
    if not callable(context_fn):
        raise TypeError(
            f"remat.checkpoint: context_fn must be a function returning two context "
            f"managers, got {type(context_fn).__name__}. For selective checkpointing pass "
            "context_fn=functools.partial(remat.create_selective_checkpoint_contexts, policy) "
            "(the function, not the pair it returns)."
        )
    return context_fn  # type: ignore[no-any-return]


def _check_hooks_option(value: Any) -> None:
    if value is not True and value is not False:
        raise TypeError(
            "remat.checkpoint: respect_saved_tensors_hooks must be True, False or None, got "
            f"{value!r}. Pass True to route what selective checkpointing saves through the "
            "saved-tensor hooks around the region (save_on_cpu, remat.offload), False to keep "
            "it out of them without a warning, or leave it out (None: out of them, with a "
            "FutureWarning when such hooks are active)."
        )


def _check_reentrant_options(context_fn: Any, debug: Any, respect: Any) -> None:
    if context_fn is not noop_context_fn or debug is not False or respect is not None:
        raise ValueError(
            "remat.checkpoint: Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` "
            "is only supported when use_reentrant=False. Drop them or pass "
            "use_reentrant=False (the default)."
        )


def _bad_check(determinism_check: Any) -> ValueError:
    return ValueError(
        f"remat.checkpoint: determinism_check should be one of {list(_CHECKS)}, but got "
        f"{determinism_check!r}."
    )


def _decorator(unexpected: dict[str, Any], **options: Any) -> Callable[..., Any]:
    """``checkpoint(**options)`` without a function: the options checked now, a decorator."""
    if unexpected:
        raise ValueError(
            "Unexpected keyword arguments: "
            + ",".join(unexpected)
            + ". checkpoint() without a function returns a decorator and takes only "
            "checkpoint's options; pass the function's own arguments when calling the "
            "decorated function."
        )
    reentrant = _reentrant_flag(options["use_reentrant"])
    context_fn = options["context_fn"]
    if context_fn is not noop_context_fn:
        options["context_fn"] = context_fn = _context_function(context_fn)
    respect = options["respect_saved_tensors_hooks"]
    if respect is not None:
        _check_hooks_option(respect)
    if reentrant:
        _check_reentrant_options(context_fn, options["debug"], respect)
    if options["determinism_check"] not in _CHECKS:
        raise _bad_check(options["determinism_check"])
    return functools.partial(CheckpointedFunction, **options)


class CheckpointedFunction(Generic[_P, _T]):
    """A function run through :func:`checkpoint` on every call, with fixed options.

    Made by the curried form ``checkpoint(**options)(function)`` (torch 2.14's), also
    as a decorator. It carries ``function``'s name, docstring and signature
    (``functools.wraps``; ``__wrapped__`` is the function) and, when it decorates a
    method, binds to the instance it is read from, so ``self`` is passed on.

    Attributes:
        function: the function it runs.
        checkpoint_kwargs: the options passed to :func:`checkpoint` (a copy).

    Example:
        >>> import torch, remat
        >>> class Block(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(4, 4)
        ...
        ...     @remat.checkpoint(use_reentrant=False)
        ...     def forward(self, x):
        ...         return self.lin(x).relu()
        >>> Block.forward.__qualname__
        'Block.forward'
        >>> Block()(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """

    def __init__(self, function: Callable[_P, _T], **checkpoint_kwargs: Any) -> None:
        if not callable(function) and not hasattr(function, "__get__"):
            raise _not_callable(function)
        self.function = function
        self.checkpoint_kwargs = dict(checkpoint_kwargs)
        functools.update_wrapper(self, function, updated=())  # type: ignore[arg-type]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        run: Callable[..., Any] = checkpoint
        return run(self.function, *args, **self.checkpoint_kwargs, **kwargs)  # type: ignore[no-any-return]

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        bind = getattr(self.function, "__get__", None)
        if bind is None:
            return self
        return type(self)(bind(instance, owner), **self.checkpoint_kwargs)

    def __repr__(self) -> str:
        return f"<remat.checkpoint of {self.function!r}>"


def _not_callable(function: Any) -> TypeError:
    text = repr(function)
    if len(text) > 60:
        text = text[:57] + "..."
    return TypeError(
        f"remat.checkpoint: function must be callable, got {type(function).__name__} {text}. "
        "Pass the function or module to run first and its arguments after it: "
        "checkpoint(function, *args)."
    )


def _compiled(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    use_reentrant: bool,
    preserve_rng_state: bool,
    context_fn: Any,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
) -> Any:
    """Inside torch.compile: torch's checkpoint is what the compiler knows how to trace."""
    # Dynamo accepts context_fn only as a plain or functools.partial function and
    # not even torch's own noop default passed explicitly: leave it out then.
    if context_fn is not noop_context_fn:
        kwargs = {**kwargs, "context_fn": context_fn}
    return _tuc.checkpoint(
        function,
        *args,
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        determinism_check="none" if determinism_check == "none" else "default",
        debug=debug,
        early_stop=early_stop,
        **kwargs,
    )
