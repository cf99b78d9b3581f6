"""``checkpoint()``: argument checks and dispatch to a variant."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint as _tuc

from . import _config
from ._nonreentrant import run_nonreentrant
from ._reentrant import run_reentrant

_CHECKS = ("default", "none", "values")


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


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = False,
    preserve_rng_state: bool = True,
    context_fn: Callable[
        [], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]
    ] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint``: the activations the
    function would save for backward are dropped and recomputed when backward
    needs them, under the forward's RNG and autocast state, so gradients are
    those of the plain call. Only the inputs are kept.

    Args:
        function: the callable to checkpoint.
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
        **kwargs: keyword arguments of ``function`` (non-reentrant only).

    Returns:
        Whatever ``function`` returns.

    Raises:
        TypeError: when ``function`` is not callable, ``use_reentrant`` is not
            a bool or ``None``, or ``context_fn`` is not a context function (a
            policy passed by mistake is named as such).
        ValueError: for options the chosen variant does not take, or an
            unknown ``determinism_check``.
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
    """
    if use_reentrant is None:
        use_reentrant = False
    elif use_reentrant is not True and use_reentrant is not False:
        raise TypeError(
            f"remat.checkpoint: use_reentrant must be True, False or None, got {use_reentrant!r}. "
            "Pass use_reentrant=False (the default) or True for the reentrant variant."
        )
    if not callable(function):
        raise _not_callable(function)
    if context_fn is not noop_context_fn:
        if context_fn is _torch_noop:  # torch's default passed explicitly: the same as ours
            context_fn = noop_context_fn
        elif not callable(context_fn):
            raise TypeError(
                f"remat.checkpoint: context_fn must be a function returning two context "
                f"managers, got {type(context_fn).__name__}. For selective checkpointing pass "
                "context_fn=functools.partial(remat.create_selective_checkpoint_contexts, policy) "
                "(the function, not the pair it returns)."
            )
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
        if context_fn is not noop_context_fn or debug is not False:
            raise ValueError(
                "remat.checkpoint: Passing `context_fn` or `debug` is only supported when "
                "use_reentrant=False. Drop them or pass use_reentrant=False (the default)."
            )
    if determinism_check not in _CHECKS:
        raise ValueError(
            f"remat.checkpoint: determinism_check should be one of {list(_CHECKS)}, but got "
            f"{determinism_check!r}."
        )
    if not torch.is_grad_enabled() or _config.checkpointing_disabled():
        return function(*args, **kwargs)
    if use_reentrant:
        return run_reentrant(function, args, preserve_rng_state=preserve_rng_state)
    dbg = _config.debug_override()
    stop = _config.early_stop_override()
    return run_nonreentrant(
        function,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=None if context_fn is noop_context_fn else context_fn,
        determinism_check=determinism_check,
        debug=debug if dbg is None else dbg,
        early_stop=early_stop if stop is None else stop,
    )


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
