"""The call forms users copy from torch's and fairscale's wrappers, mapped to remat's options.

* fairscale: ``checkpoint_wrapper(module, offload_to_cpu)``, the flag positionally.
* older torch versions' wrapper: ``checkpoint_wrapper(module, checkpoint_impl, offload_to_cpu)``.
* torch's distributed wrapper
  (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``):
  ``checkpoint_wrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)``,
  positionally or by keyword, with torch's ``CheckpointImpl`` or remat's
  :class:`CheckpointImpl`; ``apply_activation_checkpointing(model,
  checkpoint_wrapper_fn, check_fn, auto_wrap_policy)`` with the one-argument
  ``check_fn(module)`` and FSDP-style ``auto_wrap_policy`` callables or policy
  objects.

Nothing here imports ``torch.distributed``: torch's enum is recognised through
``sys.modules`` (a value of it exists only once its module was imported).
"""

from __future__ import annotations

import enum
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint as _tuc
from torch import nn

from .checkpoint import checkpoint

_TORCH_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
#: Options of :func:`remat.checkpoint` that the wrapper takes through ``**checkpoint_fn_kwargs``.
CHECKPOINT_OPTIONS = ("determinism_check", "debug", "early_stop", "respect_saved_tensors_hooks")
_CHECKS = ("default", "none", "values")


class CheckpointImpl(enum.Enum):
    """torch's ``CheckpointImpl`` under remat's name, for ``checkpoint_wrapper(checkpoint_impl=...)``.

    ``REENTRANT`` means ``use_reentrant=True``, ``NO_REENTRANT`` (the default)
    ``use_reentrant=False``. :func:`remat.checkpoint_wrapper` accepts these and
    the members of torch's enum of the same name alike, so code that still
    imports torch's ``CheckpointImpl`` works unchanged; remat defines its own so
    that ``import remat`` does not import ``torch.distributed``.

    Example:
        >>> import torch, remat
        >>> lin = remat.checkpoint_wrapper(torch.nn.Linear(2, 2),
        ...                                checkpoint_impl=remat.CheckpointImpl.REENTRANT)
        >>> lin
        Linear(in_features=2, out_features=2, bias=True, [remat: checkpointed, reentrant])
    """

    REENTRANT = 1
    NO_REENTRANT = 2


def impl_is_reentrant(value: Any) -> bool | None:
    """``True``/``False`` for a member of remat's or torch's ``CheckpointImpl``, else ``None``."""
    if isinstance(value, CheckpointImpl):
        return value is CheckpointImpl.REENTRANT
    torch_wrapper = sys.modules.get(_TORCH_WRAPPER_MODULE)
    torch_impl = getattr(torch_wrapper, "CheckpointImpl", None)
    if torch_impl is not None and isinstance(value, torch_impl):
        return value.name == "REENTRANT"
    return None


def _is_checkpoint(fn: Any) -> bool:
    return fn is checkpoint or fn is _tuc.checkpoint


def _plain_checkpoint(fn: Any) -> dict[str, Any] | None:
    """The keywords of ``fn`` when it is remat's or torch's checkpoint (or a partial of one)."""
    if _is_checkpoint(fn):
        return {}
    if isinstance(fn, functools.partial) and not fn.args:
        inner = _plain_checkpoint(fn.func)
        if inner is not None:
            return {**inner, **fn.keywords}
    return None


def _given_twice(name: str, positional: Any) -> TypeError:
    return TypeError(
        f"checkpoint_wrapper: {name} given positionally ({positional!r}) and by keyword; "
        "pass it once."
    )


def wrapper_options(
    positional: Any,
    positional_fn: Any,
    *,
    policy: Any,
    offload_to_cpu: bool,
    preserve_rng_state: bool,
    use_reentrant: bool | None,
    context_fn: Any,
    checkpoint_impl: Any,
    checkpoint_fn: Any,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Resolve every accepted call form into the fields of the wrapper's options.

    Returns ``policy``, ``offload_to_cpu``, ``preserve_rng_state``,
    ``use_reentrant``, ``context_fn``, ``checkpoint_fn`` (a custom checkpoint
    function, ``None`` for remat's) and ``fn_kwargs`` (sorted keyword pairs for
    the checkpoint function).
    """
    if positional is not None:
        if isinstance(positional, bool):  # fairscale: checkpoint_wrapper(module, offload_to_cpu)
            if offload_to_cpu:
                raise _given_twice("offload_to_cpu", positional)
            offload_to_cpu = positional
        elif impl_is_reentrant(positional) is not None:  # torch: (module, checkpoint_impl, ...)
            if checkpoint_impl is not None:
                raise _given_twice("checkpoint_impl", positional)
            checkpoint_impl = positional
        else:
            raise TypeError(
                "checkpoint_wrapper: the second positional argument must be fairscale's "
                "offload_to_cpu (a bool) or torch's checkpoint_impl (CheckpointImpl.REENTRANT "
                f"or NO_REENTRANT), got {type(positional).__name__} {positional!r}. Pass "
                "remat's options by keyword: checkpoint_wrapper(module, policy=..., "
                "use_reentrant=...)."
            )
    if isinstance(positional_fn, bool) and checkpoint_impl is not None:
        # older torch: checkpoint_wrapper(module, checkpoint_impl, offload_to_cpu)
        if offload_to_cpu:
            raise _given_twice("offload_to_cpu", positional_fn)
        offload_to_cpu, positional_fn = positional_fn, None
    if positional_fn is not None:
        if checkpoint_impl is None:
            raise TypeError(
                "checkpoint_wrapper: a third positional argument (torch's checkpoint_fn) follows "
                f"torch's checkpoint_impl, but the second one was {positional!r}. Pass "
                "checkpoint_fn=... by keyword."
            )
        if checkpoint_fn is not None:
            raise _given_twice("checkpoint_fn", positional_fn)
        checkpoint_fn = positional_fn
    reentrant: bool | None = None
    if checkpoint_impl is not None:
        reentrant = impl_is_reentrant(checkpoint_impl)
        if reentrant is None:
            raise TypeError(
                "checkpoint_wrapper: checkpoint_impl must be CheckpointImpl.REENTRANT or "
                f"CheckpointImpl.NO_REENTRANT (remat's or torch's), got {checkpoint_impl!r}."
            )
    if checkpoint_fn is not None:
        if not callable(checkpoint_fn):
            raise TypeError(
                "checkpoint_wrapper: checkpoint_fn must be a checkpoint function called as "
                f"checkpoint_fn(function, *args, **kwargs), got {type(checkpoint_fn).__name__}."
            )
        preset = _plain_checkpoint(checkpoint_fn)
        if preset is None:
            return _custom_options(
                checkpoint_fn,
                policy=policy,
                offload_to_cpu=offload_to_cpu,
                preserve_rng_state=preserve_rng_state,
                use_reentrant=use_reentrant,
                context_fn=context_fn,
                extra=extra,
            )
        # torch's or remat's checkpoint: run remat's with the same options (explicit wins).
        # As in torch, checkpoint_impl does not override the function's use_reentrant.
        if use_reentrant is None:
            use_reentrant = preset.pop("use_reentrant", None)
        preset.pop("use_reentrant", None)
        if use_reentrant is not None:
            reentrant = None
        preserve_rng_state = preserve_rng_state and bool(preset.pop("preserve_rng_state", True))
        preset_context = preset.pop("context_fn", None)
        if context_fn is None and preset_context is not _tuc.noop_context_fn:
            context_fn = preset_context
        extra = {**preset, **extra}
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(
            f"checkpoint_wrapper: use_reentrant must be True or False, got {use_reentrant!r}."
        )
    if use_reentrant is not None and reentrant is not None and use_reentrant != reentrant:
        raise ValueError(
            f"checkpoint_wrapper: use_reentrant={use_reentrant} contradicts "
            f"checkpoint_impl={checkpoint_impl!r}; pass one of them."
        )
    reentrant = bool(use_reentrant if use_reentrant is not None else reentrant)
    _check_extra(extra, reentrant)
    if reentrant and (policy is not None or context_fn is not None):
        raise ValueError(
            "checkpoint_wrapper: policy and context_fn are only supported when "
            "use_reentrant=False (selective checkpointing runs on the saved-tensor hooks of the "
            "non-reentrant variant). Drop use_reentrant=True / CheckpointImpl.REENTRANT."
        )
    return {
        "policy": policy,
        "offload_to_cpu": bool(offload_to_cpu),
        "preserve_rng_state": bool(preserve_rng_state),
        "use_reentrant": reentrant,
        "context_fn": context_fn,
        "checkpoint_fn": None,
        "fn_kwargs": tuple(sorted(extra.items())),
    }


def _check_extra(extra: dict[str, Any], reentrant: bool) -> None:
    """``**checkpoint_fn_kwargs`` for remat's checkpoint: only its options, with valid values."""
    for key, value in extra.items():
        if key not in CHECKPOINT_OPTIONS:
            raise TypeError(
                f"checkpoint_wrapper: unexpected keyword argument {key!r}. Keyword arguments "
                "beyond the wrapper's own go to remat.checkpoint, which takes "
                f"{', '.join(CHECKPOINT_OPTIONS)}. (torch's wrapper would pass {key}= to the "
                "module's forward on every call; bind it there with functools.partial instead.)"
            )
        if key == "determinism_check" and value not in _CHECKS:
            raise ValueError(
                f"checkpoint_wrapper: determinism_check should be one of {list(_CHECKS)}, but "
                f"got {value!r}."
            )
        if key in ("debug", "early_stop") and not isinstance(value, bool):
            raise TypeError(f"checkpoint_wrapper: {key} must be True or False, got {value!r}.")
        if key == "respect_saved_tensors_hooks" and not (value is None or isinstance(value, bool)):
            raise TypeError(
                "checkpoint_wrapper: respect_saved_tensors_hooks must be True, False or None, "
                f"got {value!r} (see remat.checkpoint)."
            )
    if reentrant and extra.get("respect_saved_tensors_hooks") is not None:
        raise ValueError(
            "checkpoint_wrapper: Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` "
            "is only supported when use_reentrant=False. Drop respect_saved_tensors_hooks or use "
            "use_reentrant=False / CheckpointImpl.NO_REENTRANT."
        )
    if reentrant and extra.get("debug"):
        raise ValueError(
            "checkpoint_wrapper: Passing `context_fn` or `debug` is only supported when "
            "use_reentrant=False. Drop debug=True or use_reentrant=True / "
            "CheckpointImpl.REENTRANT."
        )


def _custom_options(
    checkpoint_fn: Callable[..., Any],
    *,
    policy: Any,
    offload_to_cpu: bool,
    preserve_rng_state: bool,
    use_reentrant: bool | None,
    context_fn: Any,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Options for a checkpoint function of the user's own: keywords go to it, as in torch."""
    if policy is not None:
        raise ValueError(
            "checkpoint_wrapper: policy selects what remat's checkpoint saves and cannot be "
            "handed to a custom checkpoint_fn. Pass context_fn=functools.partial("
            "remat.create_selective_checkpoint_contexts, policy) if checkpoint_fn takes one, "
            "or drop checkpoint_fn."
        )
    kwargs = dict(extra)
    if use_reentrant is not None:
        kwargs["use_reentrant"] = use_reentrant
    if not preserve_rng_state:  # True is every checkpoint function's default
        kwargs["preserve_rng_state"] = False
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return {
        "policy": None,
        "offload_to_cpu": bool(offload_to_cpu),
        "preserve_rng_state": bool(preserve_rng_state),
        "use_reentrant": False,
        "context_fn": None,
        "checkpoint_fn": checkpoint_fn,
        "fn_kwargs": tuple(sorted(kwargs.items())),
    }


# -- apply_activation_checkpointing ------------------------------------------------------


class _ModuleOnly:
    """torch's one-argument ``check_fn(module)`` as remat's ``(name, module)`` filter."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[nn.Module], Any]) -> None:
        self.fn = fn

    def __call__(self, name: str, module: nn.Module) -> bool:
        return bool(self.fn(module))


def name_filter(check_fn: Any) -> Callable[[str, nn.Module], Any]:
    """``check_fn`` as a ``(name, module)`` filter; torch's ``check_fn(module)`` is adapted.

    The form is told by the number of positional parameters without defaults:
    one means torch's ``check_fn(module)``, two remat's ``check_fn(name, module)``;
    with none (``*args``), ``(name, module)``.
    """
    if not callable(check_fn):
        raise TypeError(
            "apply_activation_checkpointing: check_fn must be a function check_fn(name, module) "
            f"(or torch's check_fn(module)) returning a bool, got {type(check_fn).__name__}."
        )
    try:
        params = list(inspect.signature(check_fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): remat's form
        return check_fn  # type: ignore[no-any-return]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) == 1 or (not required and len(positional) == 1 and not varargs):
        return _ModuleOnly(check_fn)
    if len(required) > 2 or (not positional and not varargs):
        raise TypeError(
            "apply_activation_checkpointing: check_fn must take (name, module) or, as torch's, "
            f"(module); {getattr(check_fn, '__qualname__', check_fn)!r} takes "
            f"{len(required)} required positional arguments."
        )
    return check_fn  # type: ignore[no-any-return]


def auto_wrap_targets(model: nn.Module, policy: Any) -> set[int]:
    """Ids of the submodules torch's ``apply_activation_checkpointing`` wraps for ``policy``.

    A callable is asked as FSDP's auto-wrap policies are, depth first:
    ``policy(module=m, recurse=True, nonwrapped_numel=n)`` whether to look
    inside ``m``, then, once its children are decided,
    ``policy(module=m, recurse=False, nonwrapped_numel=rest)`` whether to wrap
    it, ``rest`` being its parameters not inside a wrapped child. The model
    itself is never wrapped. A policy object that is not callable (torch's
    ``_Policy`` family) is asked for its targets directly.
    """
    if not callable(policy):
        run = getattr(policy, "_run_policy", None)
        if run is None:
            raise TypeError(
                "apply_activation_checkpointing: auto_wrap_policy must be a callable "
                "policy(module, recurse, nonwrapped_numel) or one of torch's wrap policies "
                f"(ModuleWrapPolicy, ...), got {type(policy).__name__}."
            )
        targets = run(model, ignored_modules=set(), root_kwargs={})
        return {id(m) for m in targets if m is not model}
    chosen: set[int] = set()

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in module.children())
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            chosen.add(id(module))
            return numel
        return wrapped

    visit(model, True)
    return chosen


class InSet:
    """A ``(name, module)`` filter: the module is one of ``ids``."""

    __slots__ = ("ids",)

    def __init__(self, ids: set[int]) -> None:
        self.ids = ids

    def __call__(self, name: str, module: nn.Module) -> bool:
        return id(module) in self.ids
