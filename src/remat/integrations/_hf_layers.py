"""The model switch of :mod:`remat.integrations.hf`: select the layers, guard the cache,
wrap or plan them, undo."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import apply_activation_checkpointing, unwrap
from .. import auto_checkpoint as plan_and_apply
from ..modules.modelinfo import check_module
from ..planner.checks import check_options
from ._extras import require

require("transformers", "hf", "remat.integrations.hf")
from transformers import GradientCheckpointingLayer  # noqa: E402  (after the extra's check)

log = logging.getLogger("remat")

#: where the switch keeps its hooks on the model (an attribute: no module-level state)
_STATE = "_remat_hf_switch"
#: the options of remat.auto_checkpoint that hf.auto_checkpoint passes on (checked first)
_OPTIONS = (
    "optimizer", "set_to_none", "loss_fn", "timer", "distributed", "quiet", "diagnose",
    "shapes", "device",
)  # fmt: skip
#: layer arguments transformers' checkpointed layer clears (besides ``use_cache``)
_CACHE_ARGS = ("cache", "layer_past")


def is_layer(name: str, module: nn.Module) -> bool:
    """``check_fn`` for the layers transformers checkpoints (``GradientCheckpointingLayer``).

    Example:
        >>> import torch
        >>> is_layer("fc", torch.nn.Linear(2, 2))
        False
    """
    return isinstance(module, GradientCheckpointingLayer)


def layer_names(
    model: nn.Module, check_fn: Callable[[str, nn.Module], bool] | None = None
) -> list[str]:
    """Names of the layers to checkpoint: the outermost modules ``check_fn`` selects
    (default :func:`is_layer`), in ``named_modules`` order.

    Raises:
        ValueError: none is found (a model of remote code whose layers do not derive
            from ``GradientCheckpointingLayer``: pass ``check_fn``).
    """
    check_module(model, "remat.integrations.hf", "model")
    select = is_layer if check_fn is None else check_fn
    names: list[str] = []
    for name, module in model.named_modules():
        if name and not any(name.startswith(n + ".") for n in names) and select(name, module):
            names.append(name)
    if not names:
        raise ValueError(
            f"remat.integrations.hf: found no layers to checkpoint in {type(model).__name__} "
            f"({'no transformers.GradientCheckpointingLayer' if check_fn is None else 'check_fn selected none'}). "
            "Pass check_fn=lambda name, module: ... that selects its decoder/encoder layers."
        )
    return names


def _arg_index(module: nn.Module, name: str) -> int | None:
    """Position of parameter ``name`` among the positional arguments of the class's
    ``forward`` (not an instance's replacement: a checkpoint wrapper, accelerate's autocast
    wrapper); -1 when it can only come as a keyword; ``None`` when there is no such
    parameter."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # self
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == name:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                return i
            return -1 if p.kind is p.KEYWORD_ONLY else None
    return None


class _NoCache:
    """Forward pre-hook: in training with gradients, call the module with
    ``use_cache=False`` (and, on a layer, without the cache arguments)."""

    def __init__(self, switch: _Switch, use_cache_at: int | None, clear: tuple[str, ...]) -> None:
        self.switch = switch
        self.use_cache_at = use_cache_at
        self.clear = clear

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        dropped = []
        at = self.use_cache_at
        if at is not None:
            if 0 <= at < len(args):
                if args[at]:
                    dropped.append("use_cache=True")
                args = (*args[:at], False, *args[at + 1 :])
            else:
                if kwargs.get("use_cache"):
                    dropped.append("use_cache=True")
                kwargs["use_cache"] = False
        for name in self.clear:
            if kwargs.get(name) is not None:
                kwargs[name] = None
                dropped.append(f"{name}")
        if dropped and not self.switch.told:
            self.switch.told = True
            log.warning(
                "remat: caching is incompatible with checkpointing in training (the recompute "
                "would append to the cache again); %s: dropped %s.",
                type(module).__name__,
                ", ".join(dropped),
            )
        return args, kwargs


@dataclasses.dataclass
class _Switch:
    """What :func:`checkpoint_layers` / :func:`auto_checkpoint` put on a model."""

    layers: list[str]
    handles: list[RemovableHandle] = dataclasses.field(default_factory=list)
    plan: Any = None
    told: bool = False

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def transformers_switch_on(model: nn.Module) -> list[str]:
    """The modules whose transformers checkpointing is on (the ``gradient_checkpointing``
    flag that ``model.activation_checkpointing_enable()`` and
    ``TrainingArguments(activation_checkpointing=True)`` set), by name."""
    return [
        n or type(model).__name__
        for n, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]


def take_over_switch(model: nn.Module, layers: list[str], where: str, say: bool = True) -> bool:
    """Turn transformers' own checkpointing off where it is on, saying so once (logger
    ``"remat"``; not with ``say=False``): remat plans ``layers``, the layers it would have
    checkpointed, instead of checkpointing them twice. Returns whether it was on.

    transformers' switch is turned off as transformers does it
    (``model.activation_checkpointing_disable()``; a model outside ``PreTrainedModel``
    without it gets its flags cleared), which leaves the input gradients it enabled
    (``enable_input_require_grads``) as they are: values and gradients do not change."""
    on = transformers_switch_on(model)
    if not on:
        return False
    off = getattr(model, "activation_checkpointing_disable", None)
    if callable(off):
        off()
    for _, m in model.named_modules():  # remote code without the method, or a partial one
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False
    if not say:
        return True
    log.warning(
        "%s: transformers' own activation checkpointing was on (%s%s), set by "
        "TrainingArguments(activation_checkpointing=True) (its deprecated alias "
        "gradient_checkpointing=True) or model.activation_checkpointing_enable(). remat turned "
        "it off (model.activation_checkpointing_disable()) and plans the %d layers it would "
        "checkpoint instead (%s). Leave activation_checkpointing=False to silence this.",
        where,
        ", ".join(on[:3]),
        ", ..." if len(on) > 3 else "",
        len(layers),
        ", ".join(layers[:2]) + (", ..." if len(layers) > 2 else ""),
    )
    return True


def guard_cache(model: nn.Module, layers: list[str]) -> _Switch:
    """Install the cache hooks (see the module docstring) for ``layers`` of ``model``,
    replacing those of an earlier switch; returns the switch, kept on the model."""
    old = model.__dict__.pop(_STATE, None)
    if old is not None:
        old.remove_hooks()
    switch = _Switch(layers=list(layers))
    inside = tuple(n + "." for n in layers)
    for name, module in model.named_modules():
        if name in switch.layers:
            clear = (
                ()
                if getattr(type(module), "_can_checkpoint_with_cache", False)
                else tuple(a for a in _CACHE_ARGS if _arg_index(module, a) is not None)
            )
            at = _arg_index(module, "use_cache")
            if at is None and not clear:
                continue
        elif name.startswith(inside):
            continue
        else:
            at, clear = _arg_index(module, "use_cache"), ()
            if at is None:
                continue
        hook = _NoCache(switch, at, clear)
        switch.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    object.__setattr__(model, _STATE, switch)
    return switch


def checkpoint_layers(
    model: nn.Module,
    *,
    every: int = 1,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    **wrapper_kwargs: Any,
) -> list[str]:
    """Checkpoint a transformers model's layers with remat, in place; return their names.

    The counterpart of ``model.activation_checkpointing_enable()`` with remat's
    checkpoint: the layers of every stack (:func:`layer_names`), every ``every``-th
    one, wrapped by :func:`remat.checkpoint_wrapper`; caching turned off while
    training (see the module docstring). Calling it again replaces the earlier switch.

    Args:
        model: a transformers model (any ``nn.Module`` with such layers).
        every: checkpoint every ``every``-th layer (the 1st, the ``every+1``-th, ...).
        check_fn: ``(name, module) -> bool`` selecting other layers (default
            :func:`is_layer`).
        **wrapper_kwargs: options of :func:`remat.checkpoint_wrapper` (``policy``,
            ``offload_to_cpu``, ``use_reentrant``, ...).

    Returns:
        The names of the checkpointed layers.

    transformers' own checkpointing, if on, is turned off first (said once: see
    :func:`take_over_switch`).

    Raises:
        ValueError: no layer is found, or ``every`` < 1.
    """
    names = layer_names(model, check_fn)
    take_over_switch(model, names, "remat.integrations.hf.checkpoint_layers")
    uncheckpoint_layers(model)
    chosen = set(names)
    wrapped = apply_activation_checkpointing(
        model, check_fn=lambda name, module: name in chosen, every=every, **wrapper_kwargs
    )
    guard_cache(model, wrapped)
    return wrapped


def auto_checkpoint(
    model: nn.Module,
    *args: Any,
    budget: int | float | str,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    **kwargs: Any,
) -> Any:
    """:func:`remat.auto_checkpoint` over a transformers model's layers, caching handled.

    The candidate blocks are :func:`layer_names` (every stack's layers); the cache
    hooks of :func:`checkpoint_layers` are installed first, since the planner's steps
    run the model in training mode. Undo with :func:`uncheckpoint_layers`.

    Args:
        model: a transformers model (in place).
        *args: example inputs (usually none: pass the batch as keywords).
        budget: as in :func:`remat.auto_checkpoint` (``"60%"``, ``2**30``, ``"18GiB"``).
        check_fn: other layers (default :func:`is_layer`).
        **kwargs: the batch (``input_ids=..., labels=...``) and the options of
            :func:`remat.auto_checkpoint` (``optimizer``, ``set_to_none``, ``loss_fn``,
            ``timer``, ...); the default loss is the ``loss`` the model returns.

    Returns:
        The applied :class:`remat.Plan`.

    transformers' own checkpointing, if on, is turned off first and its layers planned
    (said once: see :func:`take_over_switch`).

    Raises:
        PlanError: as :func:`remat.auto_checkpoint` (the model is left as it was, but for
            transformers' switch, which stays off).
    """
    where = "remat.integrations.hf.auto_checkpoint"
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    check_options(where, budget=budget, check_fn=check_fn, **options)  # before the switch
    names = layer_names(model, check_fn)
    take_over_switch(model, names, where)
    uncheckpoint_layers(model)
    switch = guard_cache(model, names)
    chosen = set(names)
    try:
        plan = plan_and_apply(
            model,
            *args,
            budget=budget,
            check_fn=lambda name, module: name in chosen,
            **kwargs,
        )
    except BaseException:
        uncheckpoint_layers(model)
        raise
    switch.plan = plan
    return plan


def uncheckpoint_layers(model: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint_layers` or :func:`auto_checkpoint`: layers plain again, cache
    hooks removed (a no-op on a model without them); returns the model."""
    switch = model.__dict__.pop(_STATE, None)
    if switch is None:
        return model
    switch.remove_hooks()
    if switch.plan is not None:  # every block kept: spans removed, wrappers undone
        keep = {n: "keep" for n in switch.plan.decisions}
        dataclasses.replace(switch.plan, decisions=keep, block_spans=[]).apply(model)
    for name in switch.layers:
        unwrap(model.get_submodule(name))
    return model
