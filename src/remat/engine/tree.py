"""Find the tensors inside call arguments and put replacements back.

A small pytree for the containers users pass to checkpointed functions:
tuples (named ones too), lists, dicts and dataclass instances, nested at any
depth. Everything else is a leaf kept as is. It is written for the hot path:
a flat argument tuple of tensors costs one pass and no allocation per leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class Slot:
    """Stands in a template for a tensor that is kept elsewhere."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"


SLOT = Slot()


def _is_container(obj: Any) -> bool:
    t = type(obj)
    return (
        t is tuple
        or t is list
        or t is dict
        or isinstance(obj, (tuple, list, dict))
        or (dataclasses.is_dataclass(obj) and not isinstance(obj, type))
    )


def has_nested(args: tuple[Any, ...]) -> bool:
    """True when some argument is a container (so the slow path is needed)."""
    for a in args:
        if type(a) is not torch.Tensor and not isinstance(a, torch.Tensor) and _is_container(a):
            return True
    return False


def tensors_in(obj: Any, out: list[torch.Tensor]) -> None:
    """Append every tensor inside ``obj`` to ``out``, depth first, in order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            tensors_in(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_in(v, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.init:
                tensors_in(getattr(obj, f.name), out)


def replace_tensors(obj: Any, new: list[Any], pos: list[int]) -> Any:
    """Return ``obj`` with its tensors (or :data:`SLOT` marks) replaced by ``new``, in order.

    ``pos`` is a one-element cursor into ``new``. Containers are copied;
    leaves that are not tensors are shared.
    """
    if isinstance(obj, (torch.Tensor, Slot)):
        t = new[pos[0]]
        pos[0] += 1
        return t
    if isinstance(obj, tuple):
        items = [replace_tensors(v, new, pos) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items) if type(obj) is not tuple else tuple(items)
    if isinstance(obj, list):
        return type(obj)(replace_tensors(v, new, pos) for v in obj)
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = replace_tensors(v, new, pos)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: replace_tensors(getattr(obj, f.name), new, pos)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj
