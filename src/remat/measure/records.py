"""Records of one instrumented step: what was allocated, why it is kept, where regions are.

The plain data :class:`remat.measure.probe.StepProbe` fills and :func:`remat.explain` and the
diagnostics (:mod:`remat.measure.diagnose`) read: :class:`Reason`, :class:`Alloc` (one storage
allocated during the step), :class:`RegionStats`, :class:`Nesting`, :class:`PeakPoint`,
and :func:`user_line`, the source line an operator is attributed to.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REMAT_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # the package, not measure/
_REMAT_MODELS = os.path.join(_REMAT_DIR, "bench") + os.sep  # the built-in models are user code
#: The label of an allocation in backward that no module's forward made a node for (the
#: nested backward of a reentrant recompute, gradient accumulation).
UNKNOWN = "(backward)"


class Reason(enum.Enum):
    """Why a tensor alive at the end of forward is kept.

    Example:
        >>> Reason.REGION_INPUT.value
        'region input'
    """

    NOT_CHECKPOINTED = "not checkpointed"
    """autograd saved it for backward outside any checkpoint"""
    REGION_INPUT = "region input"
    """a checkpoint keeps it as its input, to recompute from it"""
    SELECTIVE = "selective save"
    """a selective-checkpointing policy saved it"""
    OFFLOADED = "offloaded"
    """kept in host memory until backward (on a CPU-only setup: kept as it is)"""
    OUTPUT = "output"
    """the forward returned it (the loss, the logits): the caller holds it"""
    OTHER = "other"
    """held by a Python reference (a cache, a module attribute, ctx.attr in a custom Function)"""


_PRIORITY = {r: i for i, r in enumerate(Reason)}


def user_line(depth: int = 2, boundary: Any = None) -> str:
    """``file.py:123`` of the innermost caller outside torch and remat's engine; "" when there
    is none below ``boundary`` (the frame that runs the step: above it is not the model)."""
    f: Any = sys._getframe(depth)
    while f is not None and f is not boundary:
        name = f.f_code.co_filename
        if (
            not name.startswith(_TORCH_DIR)
            and not name.startswith("<frozen")
            and (not name.startswith(_REMAT_DIR) or name.startswith(_REMAT_MODELS))
        ):
            return f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back
    return ""


class Alloc:
    """One storage allocated during the step."""

    __slots__ = (
        "key",
        "nbytes",
        "device",
        "op",
        "module",
        "line",
        "shape",
        "dtype",
        "born",
        "died",
        "backward",
        "reasons",
        "ref",
        "__weakref__",
    )

    def __init__(self, key: int, nbytes: int, t: torch.Tensor, op: str, module: str, line: str):
        self.key = key
        self.nbytes = nbytes
        self.device = str(t.device)
        self.op = op
        self.module = module
        self.line = line
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.born = 0
        self.died: int | None = None
        self.backward = False
        self.reasons: list[tuple[Reason, str]] = []  # (why, who keeps it)
        self.ref: Any = None

    def because(self, reason: Reason, keeper: str) -> None:
        if all(r is not reason for r, _ in self.reasons):
            self.reasons.append((reason, keeper))

    def primary(self) -> tuple[Reason, str]:
        """The reason that binds most (a tensor saved by autograd is kept whatever else)."""
        return min(self.reasons, key=lambda rk: _PRIORITY[rk[0]])

    def alive_at(self, t: int) -> bool:
        return self.born <= t and (self.died is None or self.died >= t)


@dataclasses.dataclass
class RegionStats:
    """What one checkpoint region (all its calls together) keeps and drops.

    Attributes:
        label: the module it checkpoints (the module running when it started).
        kind: ``"checkpoint"``, ``"reentrant"`` or ``"span"``.
        calls: forward calls.
        recomputes: recomputes in backward.
        dropped_bytes: storages allocated inside it that autograd saved (what it
            would keep without checkpointing, above its inputs); -1 when unknown
            (the reentrant variant saves nothing to look at).
        saved_input_bytes: activations from before it that it saves anyway (its
            inputs, when an operator inside saves them).
        input_bytes: the inputs it keeps, allocated during the step.
        extra_input_bytes: of those, the bytes nothing else keeps and no operator
            inside would save: what checkpointing adds.
        nested: it ran inside another region's forward (a span, a checkpointed
            block): the enclosing region keeps its inputs, and drops what it keeps.
    """

    label: str
    kind: str
    calls: int = 0
    recomputes: int = 0
    dropped_bytes: int = 0
    saved_input_bytes: int = 0
    input_bytes: int = 0
    extra_input_bytes: int = 0
    nested: bool = False


@dataclasses.dataclass(frozen=True)
class Nesting:
    """A module checkpointed inside another checkpoint (recomputed twice)."""

    inner: str
    outer: str
    how: str


@dataclasses.dataclass(frozen=True)
class PeakPoint:
    """Where the most bytes were alive (allocated during the step)."""

    bytes: int
    backward: bool
    module: str
    op: str
    line: str
    recompute_of: str | None
    node: str | None
