"""Tensors inside call arguments (remat.engine.tree): found in order, replaced in the same structure.

The containers users pass to checkpointed functions: tuples (named ones too), lists,
dicts and dataclass instances, nested at any depth; everything else is a leaf kept as is.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import torch

from remat.engine.tree import SLOT, has_nested, replace_tensors, tensors_in

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extras: dict
    scale: float = 1.0
    cache: torch.Tensor | None = dataclasses.field(default=None, init=False)


def _nested(t: list[torch.Tensor]) -> object:
    """Every container kind, nested; ``t`` in the order a depth-first walk meets them."""
    batch = Batch(t[1], {"a": t[2], "b": [t[3], "text"]})
    batch.cache = torch.ones(1)  # not an init field: not an argument tensor
    return (t[0], [batch, Pair(t[4], 7)], {"k": (t[5],)}, None)


def test_tensors_in_finds_every_tensor_depth_first_in_argument_order():
    t = [torch.full((1,), float(i)) for i in range(6)]
    found: list[torch.Tensor] = []
    tensors_in(_nested(t), found)
    assert len(found) == 6 and all(a is b for a, b in zip(found, t))


def test_replace_tensors_puts_replacements_back_in_the_same_structure():
    t = [torch.full((1,), float(i)) for i in range(6)]
    new = [torch.full((1,), float(10 + i)) for i in range(6)]
    obj = _nested(t)
    pos = [0]
    out = replace_tensors(obj, new, pos)
    assert pos == [6]  # every replacement used, in order
    found: list[torch.Tensor] = []
    tensors_in(out, found)
    assert all(a is b for a, b in zip(found, new)) and len(found) == 6
    # the structure and the leaves that are not tensors are kept
    batch, pair = out[1]
    assert type(batch) is Batch and type(pair) is Pair and pair.second == 7
    assert batch.extras["b"][1] == "text" and batch.scale == 1.0 and out[3] is None
    # containers are copies: the caller's arguments are left as they were
    assert obj[1][0].x is t[1] and obj[2]["k"][0] is t[5]
    assert out[1] is not obj[1] and out[2] is not obj[2]


def test_slot_marks_are_replaced_like_tensors():
    template = (SLOT, {"w": SLOT, "n": 3}, [SLOT])
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    out = replace_tensors(template, [a, b, c], [0])
    assert out[0] is a and out[1]["w"] is b and out[1]["n"] == 3 and out[2][0] is c


def test_has_nested_is_true_only_when_an_argument_is_a_container():
    t = torch.zeros(1)
    assert not has_nested((t, 1, "text", None))
    assert has_nested((t, [t]))
    assert has_nested(({"x": t},))
    assert has_nested((Pair(t, t),))
    assert has_nested((Batch(t, {}),))
    assert not has_nested((Batch,))  # a dataclass type is a leaf, not a container
