"""Blocks split in parts: a block's children with parameters (attention, MLP, norms) as
their own regions.

Checkpointing a block keeps its input and recomputes all of it at once in
backward. Splitting it checkpoints its children instead (each with
:func:`remat.checkpoint_wrapper`), so inside an enclosing region (the block
itself checkpointed, or a span, see :mod:`remat.modules.spans`) the block's
recompute keeps its children's inputs and holds one child's activations at a
time. By default the children chosen are those with parameters
(:func:`split_children`), and a block splits when it has two or more
(:func:`can_split`): the one rule for :func:`split_block`, spans with
``inner="split"`` and the planner's ``split`` decision, so what the planner
measures is what a span applies. Code of the block's forward between its
children (residual adds, functional activations, dropout) stays in the block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..engine.errors import PlanError
from .wrap import checkpoint_wrapper, is_wrapped, unwrap

SPLIT_ATTR = "_remat_split"  # the children a split wrapped, kept on the block


def resolve(model: nn.Module, name: Any, what: str) -> nn.Module:
    if not isinstance(name, str) or not name:
        raise PlanError(
            f"{what}: block names must be non-empty strings (submodule names of the model, as "
            f"in model.named_modules()), got {name!r}."
        )
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise PlanError(
            f"{what}: the model has no submodule {name!r}. Pass names from "
            "model.named_modules() (for example 'layers.0')."
        ) from None


def split_children(block: nn.Module) -> list[str]:
    """The names of ``block``'s children that splitting makes regions: those with parameters.

    Example:
        >>> import torch
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> split_children(block), can_split(block)
        (['0', '2'], True)
    """
    return [n for n, c in block.named_children() if any(True for _ in c.parameters())]


def can_split(block: nn.Module) -> bool:
    """Whether splitting means anything for ``block``: two or more children to checkpoint."""
    return len(split_children(block)) >= 2


def choose_children(block: nn.Module, name: str, children: Sequence[str] | None) -> list[str]:
    """The children of ``block`` to split it into, validated."""
    kids = dict(block.named_children())
    if children is None:
        chosen = split_children(block)
        if len(chosen) < 2:
            raise PlanError(
                f"split_block: {name!r} has {len(chosen)} children with parameters "
                f"({chosen or 'none'}; its children are {sorted(kids) or 'none'}): splitting "
                "needs two or more to make regions of. Pass children= to choose them."
            )
    else:
        if isinstance(children, str) or not children:
            raise PlanError(
                f"split_block: children must be a non-empty list of child names, got {children!r}."
            )
        chosen = list(children)
        for c in chosen:
            if c not in kids:
                raise PlanError(
                    f"split_block: {name!r} has no child {c!r}; its children are {sorted(kids)}."
                )
    for c in chosen:
        if is_wrapped(kids[c]):
            raise PlanError(f"split_block: {name}.{c} is already checkpointed; unwrap it first.")
    return chosen


def wrap_children(block: nn.Module, name: str, chosen: list[str]) -> list[str]:
    for c in chosen:
        checkpoint_wrapper(block.get_submodule(c))
    block.__dict__[SPLIT_ATTR] = tuple(chosen)
    return [f"{name}.{c}" for c in chosen]


def split_block(model: nn.Module, name: str, *, children: Sequence[str] | None = None) -> list[str]:
    """Make the children of block ``name`` their own checkpointed regions, in place.

    Each chosen child is checkpointed (:func:`remat.checkpoint_wrapper`), so
    the block keeps its children's inputs and, when recomputed inside an
    enclosing region (a checkpointed block, a span), holds one child's
    activations at a time. Code of the block's forward between the children
    (residual adds, functional activations) is not in any child's region.

    Args:
        model: the model (changed in place).
        name: the block's name in ``model``.
        children: the block's child names to checkpoint; default: its
            children with parameters (:func:`split_children`; two or more).

    Returns:
        The full names of the children made regions.

    Example:
        >>> import torch
        >>> from remat.modules.split import split_block, unsplit_block
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> model = torch.nn.Sequential(block)
        >>> split_block(model, "0")
        ['0.0', '0.2']
        >>> unsplit_block(model, "0")
        ['0.0', '0.2']
    """
    block = resolve(model, name, "split_block")
    done = block.__dict__.get(SPLIT_ATTR)
    if done is not None:
        raise PlanError(f"split_block: {name!r} is already split ({list(done)}); unsplit it first.")
    return wrap_children(block, name, choose_children(block, name, children))


def unsplit_block(model: nn.Module, name: str) -> list[str]:
    """Undo :func:`split_block`; return the full names of the children unwrapped."""
    block = resolve(model, name, "unsplit_block")
    chosen = block.__dict__.pop(SPLIT_ATTR, ())
    for c in chosen:
        unwrap(block.get_submodule(c))
    return [f"{name}.{c}" for c in chosen]


def is_split(block: nn.Module) -> bool:
    """True when :func:`split_block` split ``block``."""
    return SPLIT_ATTR in block.__dict__
